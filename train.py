"""train.py — reinforcement learning on a language model, the whole chain in one loop.

    python train.py --algo grpo                      # built-in task + tiny model, a laptop CPU, ~3 min
    python train.py --algo ppo --steps 200           # any preset; flags override the preset
    python train.py --model Qwen/Qwen2.5-0.5B-Instruct --train-data data.jsonl --reward math --engine vllm
    accelerate launch --num_processes 2 train.py --algo grpo   # 2 GPUs, DDP (CPU: nanorl/distributed.py)

One optimizer step of RL is one pass down the chain:

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync

1. rollout      the engine samples `samples_per_prompt` responses for each prompt (nanorl/rollout.py)
2. reward       each response is scored against its label (nanorl/rewards.py)
3. recompute    old / reference / critic values per token, no gradient (nanorl/policy.py)
4. advantage    how much better each token did than expected (nanorl/advantage.py)
5. loss         policy loss + KL + entropy (+ value loss), aggregated (nanorl/losses.py, nanorl/kl.py)
6. backward     per micro-batch, with denominators of the whole step so splitting changes nothing
7. step         AdamW after gradient clipping; a non-finite loss or gradient skips the update
8. sync         the engine gets the new weights (free for the HF engine; verified for vLLM)
                (vLLM sleeps from after the rollout to here, giving its GPU memory to training)

Multi-rank: every rank owns an engine and a disjoint shard of the prompts; a GRPO group never
crosses ranks (group statistics stay local); loss denominators are summed over ranks and accelerate's
DDP sums the gradients, so N ranks take exactly the step one rank would on the whole batch.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch

from nanorl import checkpoint, distributed, moe_replay, precision
from nanorl.evaluation import evaluate, load_eval_sets
from nanorl.advantage import compute_advantages, masked_whiten
from nanorl.config import Config, parse_args
from nanorl.distributed import Trained
from nanorl.data import PromptFormat, PromptLoader, build_prompts, load_rows
from nanorl.kl import AdaptiveKLController, FixedKLController, kl_estimator, kl_penalized_rewards
from nanorl.logger import Logger, PhaseTimer
from nanorl.policy import ValueModel, frozen_copy, load_model
from nanorl.rewards import RewardRunner, correct, load_reward_fn, score_samples
from nanorl.rollout import HFEngine, SamplingConfig, stop_token_ids
from nanorl.task import make_default
from nanorl.trajectory import collate
from nanorl.update import forward, routing_forward, score_batch, train_on

# ----------------------------------------------------------------------------- set-up


@dataclasses.dataclass
class Run:
    """Everything one training run holds (a checkpoint saves the stateful parts of it)."""
    cfg: Config
    model: torch.nn.Module
    tokenizer: object
    engine: object
    loader: PromptLoader
    eval_sets: list  # [EvalSet] (nanorl/evaluation.py)
    rewards: RewardRunner
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_ctl: object
    logger: Logger
    ref: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    trained: torch.nn.Module | None = None  # policy + critic behind one forward; DDP with N ranks
    scaler: torch.amp.GradScaler | None = None  # fp16 only: the dynamic loss scale
    rank: int = 0
    world: int = 1
    step: int = 0
    counters: dict = dataclasses.field(default_factory=dict)  # skipped updates, data skips, ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(cfg: Config) -> Run:
    rank, world, device = distributed.init()  # `accelerate launch` / `torchrun` env, or one process
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed + rank)
    if not cfg.model or not cfg.train_data:  # the built-in task: files and model made in code
        default = make_default(os.path.join(cfg.out_dir, "task")) if rank == 0 else None
        if world > 1:
            box = [default]
            torch.distributed.broadcast_object_list(box, src=0)  # rank 0 builds, the others read the same files
            default = box[0]
        cfg = dataclasses.replace(cfg, model=cfg.model or default["model"],
                                  train_data=cfg.train_data or default["train"],
                                  test_data=cfg.test_data or default["test"])
    precision.setup_device(device)  # TF32 on CUDA
    dtype = precision.compute_dtype(cfg.dtype)  # compute dtype; `model` holds the fp32 master weights
    model, tokenizer = load_model(cfg.model, device)
    if cfg.routing_replay:
        if not moe_replay.is_moe(model):
            raise ValueError("--routing-replay needs a mixture-of-experts model")
        moe_replay.patch(model)
    if cfg.fp32_lm_head:
        precision.keep_lm_head_fp32(model)
    if cfg.gradient_checkpointing:
        precision.enable_gradient_checkpointing(model, routing_replay=cfg.routing_replay)
    model.train()  # Hugging Face checkpoints only in train mode; dropout is 0 in these models
    fmt = PromptFormat(cfg.system_prompt, cfg.prompt_template, cfg.chat_template, cfg.chat_template_dict)
    train, skipped = build_prompts(load_rows(cfg.train_data), tokenizer, cfg.input_key, cfg.label_key,
                                   cfg.max_prompt_len, source=cfg.train_data, fmt=fmt)
    eval_sets = load_eval_sets(cfg.test_data, tokenizer, cfg.input_key, cfg.label_key, cfg.max_prompt_len, fmt,
                               limit=cfg.eval_limit)
    if cfg.engine == "auto":
        cfg = dataclasses.replace(cfg, engine="vllm" if device.type == "cuda" and vllm_importable() else "hf")
    if cfg.engine == "vllm":  # its own copy of the weights, loaded from the same path, synced below
        from nanorl.vllm_engine import VLLMEngine
        longest = max(len(p.ids) for p in train + [p for s in eval_sets for p in s.prompts])  # the run's
        longest += max(cfg.max_new_tokens, cfg.eval_max_new_tokens)  # longest request, not the model's context
        engine = VLLMEngine(cfg.model, dtype=cfg.dtype, seed=cfg.seed * 1000 + rank,
                            max_model_len=cfg.max_model_len or longest,
                            kv_cache_bytes=int(cfg.kv_cache_gb * 2**30) or None,  # None: GPU share / CPU default
                            gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                            record_routing=cfg.routing_replay, sleep_mode=cfg.sleep_level > 0)
    else:  # --fsdp shards `model` below: the engine then generates from its own full copy
        engine = HFEngine(frozen_copy(model, dtype) if cfg.fsdp else model, pad_id=tokenizer.pad_token_id,
                          record_routing=cfg.routing_replay, compute_dtype=dtype)
        engine.generator.manual_seed(cfg.seed * 1000 + rank)
    critic = ValueModel(model).to(device) if cfg.vf_coef > 0 else None
    score = functools.partial(forward, cfg)  # padded or packed scoring, MoE replay (nanorl/update.py)
    ref = Trained(frozen_copy(model, dtype), None, score, dtype) if cfg.uses_reference else None
    if ref is not None and cfg.fsdp:
        ref = distributed.shard(ref, device)
    accelerator = distributed.make_accelerator(find_unused_parameters=moe_replay.is_moe(model))
    trained = distributed.wrap(accelerator, Trained(model, critic, score, dtype), fsdp=cfg.fsdp)  # DDP / FSDP
    params = [{"params": [p for p in model.parameters() if p.requires_grad]}]  # after sharding (FSDP
    if critic is not None:                                                      # swaps in sharded ones)
        params.append({"params": list(critic.parameters())})
    # fused AdamW: one kernel over all tensors, no full-size temporaries (10x faster than foreach on
    # a 166M-parameter CPU model here); FSDP's sharded DTensors keep the default implementation.
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay,
                                  fused=not cfg.fsdp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, horizon=10_000) if cfg.kl_target
              else FixedKLController(cfg.kl_coef))
    logger = Logger(cfg.out_dir, cfg.steps, enabled=rank == 0, quiet=cfg.quiet, tensorboard=cfg.tensorboard,
                    wandb_project=cfg.wandb_project, config=dataclasses.asdict(cfg), resume=bool(cfg.resume))
    rewards = RewardRunner(load_reward_fn(cfg.reward), timeout=cfg.reward_timeout, log=logger.print,
                           workers=max(1, min(8, (os.cpu_count() or 2) // (2 * world))))  # half the cores
    loader = PromptLoader(train, cfg.prompts_per_step, seed=cfg.seed, rank=rank, world=world)
    run = Run(cfg, model, tokenizer, engine, loader, eval_sets, rewards, optimizer, scheduler, kl_ctl, logger,
              ref=ref, critic=critic, trained=trained, scaler=precision.grad_scaler(dtype, device),
              rank=rank, world=world,
              counters={"skipped_updates": 0, "prompts_skipped_empty": skipped["empty"],
                        "prompts_skipped_too_long": skipped["too_long"]})
    engine.update_weights(model, version=0)
    return run


def vllm_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warm-up, then constant or cosine decay to 10%."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------- scoring


def score(run: Run, prompts, samples) -> list:
    """The reward of every sample (prompt i's n samples are consecutive)."""
    return score_samples(run.rewards, run.tokenizer, prompts, samples)


def stop_tokens(run: Run) -> tuple[int, ...]:
    return stop_token_ids(run.model, run.tokenizer)


# ----------------------------------------------------------------------------- one RL step


def rl_step(run: Run) -> dict:
    cfg, timer, metrics = run.cfg, PhaseTimer(), {}
    prompts = run.loader.next_batch()
    # 1. rollout
    with timer("generate"):
        sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                  max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop_tokens(run),
                                  keep_support=cfg.keep_sampling_mask, support_cap=cfg.support_cap)
        samples = run.engine.generate([p.ids for p in prompts], cfg.samples_per_prompt, sampling)
    # 2. reward
    with timer("reward"):
        for s, r in zip(samples, score(run, prompts, samples)):
            s.reward = r
    metrics.update(reward_metrics(samples))
    if cfg.keep_sampling_mask:  # what keeping the sampling support costs (bounded by --support-cap)
        stored = sum(4 * s.sampling_support.numel() for s in samples if s.sampling_support is not None)
        metrics["ksm/support_bytes_per_token"] = stored / max(1, sum(s.response_length for s in samples))
    metrics.update({f"reward_faults/{k}": v for k, v in run.rewards.faults.items()})  # run totals
    if cfg.filter_groups:  # DAPO: a group whose rewards are all equal has zero advantage everywhere
        samples = [s for s in samples if group_has_signal(samples, s.group_id)]
        metrics["groups_kept_frac"] = len(samples) / (len(prompts) * cfg.samples_per_prompt)
    if not enough_to_train(run, len(samples)):  # DAPO's filter can leave a rank with (next to) nothing
        return {**metrics, **{f"time/{k}": v for k, v in timer.seconds.items()}}
    if cfg.sleep_level and hasattr(run.engine, "sleep"):  # vLLM: free its GPU memory until the sync
        run.engine.sleep(cfg.sleep_level)
    device = next(run.model.parameters()).device
    precision.free_cached_memory(device)  # the rollout's KV cache goes back before training allocates
    batch = collate(samples, run.tokenizer.pad_token_id).to(device)
    mask = batch.response_mask  # [B, T] valid response tokens
    support = batch.sampling_support if cfg.keep_sampling_mask else None
    # 3. logprob recompute (no gradient)
    on_policy = cfg.ppo_epochs == 1 and cfg.mini_batches == 1
    need_old = cfg.old_logprobs == "recompute" or (cfg.old_logprobs == "auto" and (not on_policy or cfg.kl_in_reward))
    with timer("logprob"), torch.no_grad():
        if cfg.routing_replay:  # MoE: this forward also fixes (R2) or checks (R3) the routing to replay
            batch.token_data["old_logprobs"] = routing_forward(run, batch, support, metrics)
        elif cfg.old_logprobs == "rollout":
            batch.token_data["old_logprobs"] = batch.rollout_logprobs
        recompute = need_old and "old_logprobs" not in batch.token_data
        if recompute or run.critic is not None:  # through `trained`: FSDP gathers weights in its forward
            old, values = score_batch(run, run.trained, batch, support)  # micro-batched as training
            if recompute:
                batch.token_data["old_logprobs"] = old
            if values is not None:
                batch.token_data["old_values"] = values
        if run.ref is not None:
            batch.token_data["ref_logprobs"] = score_batch(run, run.ref, batch, support)[0]
    # 4. advantage
    with timer("advantage"):
        token_rewards = None
        if cfg.kl_in_reward:  # KL as a per-token penalty in the reward (InstructGPT, REINFORCE++)
            kl = kl_estimator(batch.token_data["old_logprobs"], batch.token_data["ref_logprobs"], cfg.kl_estimator,
                              mask=mask)
            token_rewards = kl_penalized_rewards(batch.rewards, kl, mask, run.kl_ctl.beta)
        comps = (torch.stack(list(batch.reward_components.values()), -1) if batch.reward_components else None)
        adv, ret = compute_advantages(
            cfg.advantage, scores=batch.rewards, mask=mask, index=batch.group_ids, token_rewards=token_rewards,
            values=batch.token_data.get("old_values"), components=comps, gamma=cfg.gamma, lam=cfg.lam,
            old_logprobs=batch.token_data.get("old_logprobs"), pass_k=cfg.pass_k)
        if cfg.advantage == "gae":  # PPO whitens GAE advantages over the batch (as verl and OpenRLHF do)
            adv = masked_whiten(adv, mask)
        batch.token_data.update(advantages=adv, returns=ret)
    # 5-7. loss, backward, optimizer step — ppo_epochs passes, mini_batches optimizer steps each
    with timer("train"):
        metrics.update(train_on(run, batch))
    precision.free_cached_memory(device)  # training's activations go back before the engine wakes
    # 8. weight sync: the engine samples the next batch from the new weights
    with timer("sync"):
        try:  # vLLM asleep: it wakes its weights, streams them in, then wakes its KV cache
            run.engine.update_weights(run.model, version=run.step + 1)
        except Exception as e:  # going on would sample from stale weights: silent divergence
            raise RuntimeError(f"step {run.step + 1}: the {cfg.engine} engine failed to load the new weights "
                               f"({type(e).__name__}: {e}); resume from the last checkpoint with "
                               "--resume latest") from e
        if cfg.sync_check_every and hasattr(run.engine, "check_sync") and (run.step + 1) % cfg.sync_check_every == 0:
            # Never trust a sync silently: score a probe with both and fail loudly on a mismatch.
            with distributed.root_gathered(run.trained):
                metrics.update({f"sync/{k}": v for k, v in run.engine.check_sync(run.model).items()})
    if cfg.kl_target and run.ref is not None and math.isfinite(metrics.get("kl_loss", 0.0)):
        run.kl_ctl.update(metrics.get("kl_loss", 0.0), n_steps=len(samples))
    step_time = sum(timer.seconds.values())
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()}, **{"time/step": step_time})
    metrics["tokens_per_s"] = float(mask.sum()) * run.world / max(step_time, 1e-9)
    metrics["kl_beta"] = run.kl_ctl.beta
    metrics["advantage_abs_mean"] = float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))
    return metrics


def enough_to_train(run: Run, n: int) -> bool:
    """Every rank must take the same optimizer steps (each holds one DDP all-reduce), so all ranks
    skip the update when any rank has fewer samples than mini-batches."""
    if run.world == 1:
        return n > 0
    fewest = distributed.all_reduce(torch.tensor([n]), torch.distributed.ReduceOp.MIN)
    return int(fewest) >= run.cfg.mini_batches


def group_has_signal(samples, gid) -> bool:
    vals = {s.total_reward for s in samples if s.group_id == gid}
    return len(vals) > 1


def reward_metrics(samples) -> dict:
    r = torch.tensor([s.total_reward for s in samples])
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float)
    m = {"reward_mean": r.mean(), "reward_std": r.std() if len(r) > 1 else torch.tensor(0.0),
         "accuracy": torch.tensor([correct(s.reward) >= 1.0 for s in samples]).float().mean(),
         "response_length_mean": lengths.mean(), "response_length_max": lengths.max(),
         "truncated_frac": torch.tensor([s.status == "truncated" for s in samples]).float().mean()}
    if isinstance(samples[0].reward, dict):
        for k in samples[0].reward:
            m[f"reward/{k}"] = torch.tensor([s.reward.get(k, 0.0) for s in samples]).mean()
    return {k: float(v) for k, v in m.items()}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv) if not isinstance(argv, Config) else argv
    run = setup(cfg)
    if cfg.resume:
        checkpoint.resume(run, cfg.resume)
    stop = {"now": False}
    previous = {sig: signal.signal(sig, lambda *_: stop.update(now=True))  # finish the step, save,
                for sig in (signal.SIGINT, signal.SIGTERM)}                 # exit 0 with a resume hint
    before = evaluate(run)  # every rank scores a slice of every eval set (nanorl/evaluation.py)
    if before:
        run.logger.print(f"held-out greedy accuracy at step {run.step}: {100 * before['eval/accuracy']:.1f}%")
        run.logger.log(run.step, before)
    start = time.time()
    while run.step < cfg.steps and not stop["now"]:
        metrics = distributed.reduce_metrics(rl_step(run), run.world)
        run.step += 1
        if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < cfg.steps:
            metrics.update(evaluate(run))
        run.logger.log(run.step, metrics)
        if cfg.save_every and run.step % cfg.save_every == 0:
            checkpoint.save(run)
    if run.world > 1:  # every rank must hold (and have synced into its engine) the same weights
        distributed.check_ranks_in_sync(getattr(run.engine, "model", run.model), run.world)  # HF: what it samples
        run.logger.print(f"ranks in sync: parameters identical on {run.world} ranks")
    after = evaluate(run) if not stop["now"] else {}  # interrupted: save first, fast
    if after:
        run.logger.log(run.step, after)
        run.logger.print(f"accuracy before: {100 * before['eval/accuracy']:.1f}%")
        run.logger.print(f"accuracy after: {100 * after['eval/accuracy']:.1f}%")
    path = checkpoint.save(run)
    run.logger.print(f"{run.step} steps in {time.time() - start:.0f}s; saved {path}")
    if stop["now"]:
        run.logger.print(f"interrupted at step {run.step}; resume with: python train.py "
                         f"{' '.join(sys.argv[1:])} --resume latest")
    run.logger.close()
    run.rewards.close()
    if hasattr(run.engine, "close"):  # vLLM: free the engine (one per process at a time)
        run.engine.close()
    for sig, handler in previous.items():  # in-process callers (tests, notebooks) get theirs back
        signal.signal(sig, handler)
    return {"before": before, "after": after, "step": run.step, "last": run.logger.last,
            "counters": dict(run.counters)}


if __name__ == "__main__":
    main()
