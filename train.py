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

With --async-steps K, steps 1-2 run in a worker process up to K batches ahead, on weights at most
K versions old, and step 8 publishes the new weights to it (nanorl/pipeline.py).

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

from nanorl import checkpoint, dapo, distributed, dump, moe_replay, pipeline, precision
from nanorl.evaluation import evaluate, load_eval_sets
from nanorl.advantage import compute_advantages, estimator_inputs, masked_whiten
from nanorl.config import Config, parse_args
from nanorl.distributed import Trained
from nanorl.data import PromptFormat, PromptLoader, build_prompts, load_rows
from nanorl.env import episode_metrics, turn_reward_tensor
from nanorl.kl import AdaptiveKLController, FixedKLController, kl_estimator, kl_penalized_rewards, masked_mean
from nanorl.losses import COV_LOSSES
from nanorl.metrics import memory_metrics, namespaced, reward_metrics
from nanorl.offpolicy import is_metrics, is_weights, mismatch_metrics
from nanorl.logger import Logger, PhaseTimer
from nanorl.plugins import Hooks, plugin_task
from nanorl.policy import ValueModel, frozen_copy, load_model
from nanorl.rewards import RewardRunner, load_reward_fn, score_samples
from nanorl.rollout import HFEngine, SamplingConfig, stop_token_ids
from nanorl.task import make_default
from nanorl.tool_envs import episode_runner, make_calc_task
from nanorl.trajectory import collate
from nanorl.update import (forward, old_policy_view, routing_forward, score_batch, score_rows, train_on, trains,
                           zero_weight_samples)

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
    episodes: object | None = None  # --env: the multi-turn driver over `engine` (nanorl/env.py)
    hooks: Hooks | None = None  # user plug-ins: reward post-processing, metadata metrics (nanorl/plugins.py)
    pipeline: object | None = None  # --async-steps: the trainer's end of the rollout worker (nanorl/pipeline.py)
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
    if cfg.threads or not cfg.model:  # the built-in task: 1 thread unless told (Config.threads)
        torch.set_num_threads(cfg.threads or 1)
    seed_everything(cfg.seed + rank)
    # several nodes: out_dir must be one shared directory (rank 0 writes task, logs, checkpoints once)
    distributed.check_shared_dir(cfg.out_dir, rank, world)
    if not cfg.model or not cfg.train_data:  # the built-in task: files and model made in code
        make = plugin_task(cfg.plugin) or (make_calc_task if cfg.env == "calc" else make_default)  # --plugin's
        # make_task, else --env calc's tool-using variant, else the built-in task
        default = make(os.path.join(cfg.out_dir, "task")) if rank == 0 else None
        if world > 1:
            box = [default]
            torch.distributed.broadcast_object_list(box, src=0)  # rank 0 builds, the others read the same files
            default = box[0]
        cfg = dataclasses.replace(cfg, model=cfg.model or default["model"],
                                  train_data=cfg.train_data or default["train"],
                                  test_data=cfg.test_data or default["test"])
    precision.setup_device(device)  # TF32 on CUDA
    dtype = precision.compute_dtype(cfg.dtype)  # compute dtype; `model` holds the fp32 master weights
    # --fsdp: loaded (and copied) in host memory; fully_shard then moves only each rank's shards to the device
    model, tokenizer = load_model(cfg.model, distributed.load_device(cfg.fsdp, device), dtype)
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
        longest += max(cfg.max_new_tokens, cfg.eval_max_new_tokens, cfg.episode_tokens)  # longest request,
        # not the model's context (an episode: its prompt + every turn and environment message)
        engine = VLLMEngine(cfg.model, dtype=cfg.dtype, seed=cfg.seed * 1000 + rank,
                            max_model_len=cfg.max_model_len or longest,
                            kv_cache_bytes=int(cfg.kv_cache_gb * 2**30) or None,  # None: GPU share / CPU default
                            gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                            record_routing=cfg.routing_replay, sleep_mode=cfg.sleep_level > 0)
    else:  # --fsdp shards `model` below: the engine then generates from its own full copy
        engine = HFEngine(frozen_copy(model, dtype).to(device) if cfg.fsdp else model,
                          pad_id=tokenizer.pad_token_id,
                          record_routing=cfg.routing_replay, compute_dtype=dtype)
        engine.generator.manual_seed(cfg.seed * 1000 + rank)
    critic = ValueModel(model).to(model.device) if cfg.vf_coef > 0 else None
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
    # reward workers: half of this node's cores, shared by the ranks on this node (not by every node's)
    workers = max(1, min(8, (os.cpu_count() or 2) // (2 * distributed.local_world_size(world))))
    rewards = RewardRunner(load_reward_fn(cfg.reward), timeout=cfg.reward_timeout, log=logger.print,
                           workers=workers)
    loader = PromptLoader(train, cfg.prompts_per_step, seed=cfg.seed, rank=rank, world=world)
    run = Run(cfg, model, tokenizer, engine, loader, eval_sets, rewards, optimizer, scheduler, kl_ctl, logger,
              ref=ref, critic=critic, trained=trained, scaler=precision.grad_scaler(dtype, device),
              rank=rank, world=world,
              counters={"skipped_updates": 0, "prompts_skipped_empty": skipped["empty"],
                        "prompts_skipped_too_long": skipped["too_long"]})
    if cfg.env:  # multi-turn episodes: the environment answers between turns and scores the episode
        run.episodes = episode_runner(cfg, engine, tokenizer, fmt, log=logger.print)
    run.hooks = Hooks(cfg)  # --reward-postprocess, --log-metadata (and what --plugin filled in)
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


def generate(run: Run, prompts, n: int, sampling: SamplingConfig) -> list:
    """n samples per prompt, consecutive: the engine's responses, or with --env the episodes of the
    multi-turn driver (the same Samples, with environment tokens masked out: nanorl/env.py)."""
    if run.pipeline is not None:  # --async-steps: sampled and scored ahead by the worker (nanorl/pipeline.py)
        return run.pipeline.take(run.step, prompts)
    if run.episodes is not None:
        return run.episodes.generate(prompts, n, sampling)
    return run.engine.generate([p.ids for p in prompts], n, sampling)


def score(run: Run, prompts, samples) -> list:
    """The reward of every sample (prompt i's n samples are consecutive)."""
    if run.episodes is not None or run.pipeline is not None:  # the environment / the worker scored them
        return [s.reward for s in samples]
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
        samples = generate(run, prompts, cfg.samples_per_prompt, sampling)
    # 2. reward
    with timer("reward"):
        for s, r in zip(samples, score(run, prompts, samples)):
            s.reward = r
        run.hooks.postprocess(samples)  # --reward-postprocess: the whole step's groups (here with --async-steps too)
    metrics.update(reward_metrics(samples))
    if run.pipeline is not None:  # staleness and who waited for whom (nanorl/pipeline.py)
        metrics.update(run.pipeline.metrics)
    if run.episodes is not None:  # turns, tool use, how episodes ended; env faults as run totals
        metrics.update(episode_metrics(samples), **{f"env_faults/{k}": v for k, v in run.episodes.faults.items()})
    baselines = remax_baselines(run, prompts, samples, timer) if cfg.advantage == "remax" else None
    if cfg.keep_sampling_mask:  # what keeping the sampling support costs (bounded by --support-cap)
        stored = sum(4 * s.sampling_support.numel() for s in samples if s.sampling_support is not None)
        metrics["ksm/support_bytes_per_token"] = stored / max(1, sum(s.response_length for s in samples))
    metrics.update({f"reward_faults/{k}": v for k, v in run.rewards.faults.items()})  # run totals
    if cfg.filter_groups:  # DAPO: drop zero-variance groups, draw more prompts until the step is full
        samples = refill_groups(run, prompts, samples, sampling, timer, metrics)
    if cfg.overlong_buffer:  # DAPO's soft overlong punishment, after the filter (which reads correctness)
        metrics["overlong_penalty_mean"] = dapo.apply_overlong_penalty(
            samples, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    if cfg.debug_rollout_only or not enough_to_train(run, len(samples)):  # only checking rollouts, or
        dump.rollouts(run, samples)                                   # DAPO's filter left no rank a sample
        return run.hooks.with_metadata(namespaced({**metrics, **{f"time/{k}": v for k, v in timer.seconds.items()}}),
                                       samples)  # no update
    if not samples:  # none left here, some elsewhere: join the step with rows that weigh nothing
        samples = zero_weight_samples(run.tokenizer.pad_token_id, cfg.samples_per_prompt)
    if cfg.sleep_level and hasattr(run.engine, "sleep"):  # vLLM: free its GPU memory until the sync
        run.engine.sleep(cfg.sleep_level)
    device = next(run.model.parameters()).device
    precision.free_cached_memory(device)  # the rollout's KV cache goes back before training allocates
    batch = collate(samples, run.tokenizer.pad_token_id).to(device)
    turn_rewards = turn_reward_tensor(samples, batch.response_ids.shape[1]) if run.episodes is not None else None
    if turn_rewards is not None:  # an environment rewarded turns before the last (advantage_inputs)
        batch.token_data["turn_rewards"] = turn_rewards.to(device)
    mask = batch.response_mask  # [B, T] valid response tokens
    support = batch.sampling_support if cfg.keep_sampling_mask else None
    # 3. logprob recompute (no gradient)
    on_policy = cfg.ppo_epochs == 1 and cfg.mini_batches == 1
    # π_old is needed off-policy, for the KL in the reward, and by everything that reads it before the
    # update: OTB, TIS/MIS weights, the per-step token selections (80/20 rule, KL-Cov / Clip-Cov).
    reads_old = (cfg.kl_in_reward or cfg.advantage == "otb" or cfg.tis_cap or cfg.mis_high
                 or cfg.top_entropy_quantile or cfg.policy_loss in COV_LOSSES)
    need_old = cfg.old_logprobs == "recompute" or (cfg.old_logprobs == "auto" and (not on_policy or reads_old))
    need_sq, need_ent = cfg.advantage == "otb", bool(cfg.top_entropy_quantile)  # by-products of that pass
    with timer("logprob"), torch.no_grad():
        if cfg.routing_replay:  # MoE: this forward also fixes (R2) or checks (R3) the routing to replay
            batch.token_data["old_logprobs"] = routing_forward(run, batch, support, metrics)
        elif cfg.old_logprobs == "rollout":
            batch.token_data["old_logprobs"] = batch.rollout_logprobs
        recompute = need_old and "old_logprobs" not in batch.token_data
        if recompute or run.critic is not None or need_sq or need_ent or dump.due(run):  # FSDP gathers
            old, values, ent, sum_sq = score_batch(run, run.trained, batch, support, sum_sq=need_sq)  # weights
            if recompute:                                       # in its forward (through `trained`);
                batch.token_data["old_logprobs"] = old          # micro-batched as training
            batch.token_data.update(trainer_logprobs=old, trainer_entropy=ent)  # π before the update (dumps)
            if values is not None:
                batch.token_data["old_values"] = values
            if need_ent:
                batch.token_data["old_entropy"] = ent
            if need_sq:
                batch.token_data["sum_sq_probs"] = sum_sq
        if run.pipeline is not None and run.ref is not None:  # --async-steps: the worker scored them
            batch.token_data["ref_logprobs"] = run.pipeline.ref_logprobs(samples, batch)
        elif run.ref is not None and (cfg.kl_in_reward or not cfg.skip_zero_advantage):
            batch.token_data["ref_logprobs"] = score_batch(run, run.ref, batch, support)[0]
    # 4. advantage (and the off-policy weights of the step, which OTB may read)
    with timer("advantage"):
        td = batch.token_data
        if cfg.tis_cap or cfg.mis_high:  # TIS / MIS: π_old/π_rollout, known before the update (offpolicy.py)
            w, changed, rho = is_weights(td["old_logprobs"], batch.rollout_logprobs, mask, level=cfg.is_level,
                                         tis=(cfg.tis_low, cfg.tis_cap) if cfg.tis_cap else None,
                                         mis=(cfg.mis_low, cfg.mis_high) if cfg.mis_high else None)
            td["is_weights"] = w
            metrics.update(is_metrics(w, changed, rho, mask))
        kl = None
        if cfg.kl_in_reward:  # KL as a per-token penalty in the reward (InstructGPT, REINFORCE++)
            kl = kl_estimator(td["old_logprobs"], td["ref_logprobs"], cfg.kl_estimator, mask=mask)  # [B, T]
            metrics["kl_ref"] = float(masked_mean(kl, mask))  # logged, and what --kl-target steers by
        adv, ret = compute_advantages(cfg.advantage_fn, **advantage_inputs(run, batch, kl, baselines))
        if cfg.advantage in ("gae", "gae_chunked") and cfg.whiten_advantages:  # PPO whitens GAE advantages
            adv = masked_whiten(adv, mask)                                     # (as verl and OpenRLHF do)
        td.update(advantages=adv, returns=ret)
        if cfg.drop_truncated:  # DAPO overlong filtering: truncated rows leave the loss, not the baselines
            batch.response_mask = dapo.truncated_loss_mask(batch.response_mask, batch.truncated)
    if run.ref is not None and "ref_logprobs" not in td:  # KL as a loss: only rows that train need it
        with timer("logprob"), torch.no_grad():
            td["ref_logprobs"] = score_rows(run, run.ref, batch, support, trains(batch))  # [B, T]
    # 5-7. loss, backward, optimizer step — ppo_epochs passes, mini_batches optimizer steps each
    with timer("train"):
        metrics.update(train_on(run, batch))
    trainer_logp, _, scored = old_policy_view(batch)  # [B, T] the trainer's π_old, and where it scored
    metrics.update(mismatch_metrics(trainer_logp, batch.rollout_logprobs, mask * scored))  # π_old/π_rollout
    dump.rollouts(run, samples, batch)  # every --dump-rollouts steps (nanorl/dump.py)
    precision.free_cached_memory(device)  # training's activations go back before the engine wakes
    # 8. weight sync: the engine samples the next batch from the new weights
    with timer("sync"):
        try:  # vLLM asleep: it wakes its weights, streams them in, then wakes its KV cache
            run.engine.update_weights(run.model, version=run.step + 1)
        except Exception as e:  # going on would sample from stale weights: silent divergence
            raise RuntimeError(f"step {run.step + 1}: the {cfg.engine} engine failed to load the new weights "
                               f"({type(e).__name__}: {e}); resume from the last checkpoint with "
                               "--resume latest") from e
        if run.pipeline is not None:  # the worker samples batch step + 1 + K from this version
            run.pipeline.publish(run.model, run.step + 1)
        if cfg.sync_check_every and hasattr(run.engine, "check_sync") and (run.step + 1) % cfg.sync_check_every == 0:
            # Never trust a sync silently: score a probe with both and fail loudly on a mismatch.
            with distributed.root_gathered(run.trained):
                metrics.update({f"sync/{k}": v for k, v in run.engine.check_sync(run.model).items()})
    if cfg.kl_target:  # the per-token KL to the reference, in either placement; one β for every rank
        n_tok = float(mask.sum()) if "kl_ref" in metrics else 0.0  # a rank of pads only has none
        kl_sum, n = distributed.all_reduce(torch.tensor([metrics.get("kl_ref", 0.0) * n_tok, n_tok])).tolist()
        if n > 0 and math.isfinite(kl_sum / n):
            run.kl_ctl.update(kl_sum / n, n_steps=len(samples))
    step_time = sum(timer.seconds.values())
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()}, **{"time/step": step_time})
    metrics["tokens_per_s"] = float(mask.sum()) * run.world / max(step_time, 1e-9)
    metrics["kl_beta"] = run.kl_ctl.beta
    metrics["advantage_abs_mean"] = float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))
    metrics = namespaced({**metrics, **memory_metrics(device)})  # rollout/, train/, perf/ (nanorl/metrics.py)
    return run.hooks.with_metadata(metrics, samples)  # --log-metadata fields, under their own names


def enough_to_train(run: Run, n: int) -> bool:
    """Whether this step updates: when any rank holds a sample (all ranks agree: an all-reduce). A
    rank with none, or with fewer than mini-batches, still takes every pass of the step (zero-weight
    rows and pads, nanorl/update.py), so the others' samples train as one process would train them."""
    if run.world == 1:
        return n > 0
    return int(distributed.all_reduce(torch.tensor([n]))) > 0


def refill_groups(run: Run, prompts, samples, sampling, timer, metrics) -> list:
    """DAPO dynamic sampling (nanorl/dapo.py): keep the groups whose rewards differ and generate rounds
    of fresh prompts until this rank holds len(prompts) of them, at most max_gen_batches rounds."""
    cfg, first = run.cfg, [samples]

    def draw(wanted: bool) -> list:
        if first:
            return first.pop()
        more = run.loader.next_batch()  # every rank advances its prompt stream alike
        if not wanted:
            return []
        with timer("generate"):
            new = generate(run, more, cfg.samples_per_prompt, sampling)
        with timer("reward"):
            for s, r in zip(new, score(run, more, new)):
                s.reward = r
            run.hooks.postprocess(new)  # before the filter reads the rewards, as in the step
        return new

    def any_short(short: bool) -> bool:  # all ranks draw the same rounds
        return short if run.world == 1 else int(distributed.all_reduce(torch.tensor([int(short)]))) > 0

    kept, rounds, generated, gave_up = dapo.dynamic_sampling(draw, len(prompts), cfg.max_gen_batches, any_short)
    found = len({s.group_id for s in kept})
    metrics.update({"groups_kept_frac": found / max(generated, 1), "dapo/gen_rounds": rounds})
    if gave_up:
        run.counters["dapo_gave_up"] = run.counters.get("dapo_gave_up", 0) + 1
        run.logger.print(f"step {run.step}: dynamic sampling found {found} of {len(prompts)} groups with reward "
                         f"variance in {rounds} generation rounds (--max-gen-batches {cfg.max_gen_batches}); "
                         "training on those. Raise --max-gen-batches, or use easier data / a stronger start.")
    return kept


def remax_baselines(run: Run, prompts, samples, timer) -> torch.Tensor:
    """ReMax: the reward of one greedy response per prompt, the baseline of that prompt's samples [B]."""
    cfg = run.cfg
    with timer("generate"):
        greedy = generate(run, prompts, 1, SamplingConfig(
            temperature=0.0, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop_tokens(run)))
    with timer("reward"):
        for g, r in zip(greedy, score(run, prompts, greedy)):
            g.reward = r
    return torch.tensor([greedy[s.group_id].total_reward for s in samples])


def advantage_inputs(run: Run, batch, kl, baselines) -> dict:
    """The chosen estimator's inputs. What every step has is passed where the estimator reads it; what a
    flag asks for (KL in the reward, no whitening, GDPO weights, ReMax baselines) is passed as such, so an
    estimator that cannot use it raises (nanorl/advantage.py compute_advantages)."""
    cfg, td, mask = run.cfg, batch.token_data, batch.response_mask
    uses = estimator_inputs(cfg.advantage_fn)  # a registry name or a user function (nanorl/plugins.py)
    comps = torch.stack(list(batch.reward_components.values()), -1) if batch.reward_components else None
    have = dict(mask=mask, index=batch.group_ids, values=td.get("old_values"), components=comps,
                old_logprobs=td.get("old_logprobs"), sum_sq_probs=td.get("sum_sq_probs"),
                rollout_is_weights=td.get("is_weights"), gamma=cfg.gamma, lam=cfg.lam, pass_k=cfg.pass_k,
                metadata=batch.metadata)  # per-row Sample.metadata: for a user estimator
    inputs = {k: v for k, v in have.items() if k in uses and v is not None}
    if "turn_rewards" in td and "token_rewards" in uses:  # an environment rewarded turns (nanorl/env.py): each
        kl_part = 0 if kl is None else kl_penalized_rewards(torch.zeros_like(batch.rewards), kl, mask, run.kl_ctl.beta)
        inputs["token_rewards"] = td["turn_rewards"] + kl_part  # on its turn's last token, −β·KL on every token
    elif kl is None:
        inputs["scores"] = batch.rewards
    elif "kl_penalty" in uses:  # slime's REINFORCE++-baseline: the KL stays per token
        inputs.update(scores=batch.rewards, kl_penalty=run.kl_ctl.beta * kl)
    else:  # −β·KL per token + the score on the last one; outcome estimators score Σ_t of it (verl)
        inputs["token_rewards"] = kl_penalized_rewards(batch.rewards, kl, mask, run.kl_ctl.beta)
    if not cfg.whiten_advantages and cfg.advantage not in ("gae", "gae_chunked"):
        inputs["whiten"] = False
    if cfg.gdpo_weights:
        inputs["component_weights"] = [float(x) for x in cfg.gdpo_weights.split(",")]
    if baselines is not None:
        inputs["baselines"] = baselines.to(mask.device)
    return inputs


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(argv) if not isinstance(argv, Config) else argv
    rank, world, _ = distributed.init()  # first: an error anywhere after this stops every rank with it
    with distributed.fail_together(rank, world):
        result = run_training(cfg)
    distributed.shutdown()  # every rank got here: the group can go (a gloo group left alive can abort the exit)
    return result


def run_training(cfg: Config) -> dict:
    run = setup(cfg)
    resumed = checkpoint.resume(run, cfg.resume) if cfg.resume else None
    if cfg.async_steps:  # the rollout worker starts from the (resumed) weights, during the first eval
        run.pipeline = pipeline.start(run, resumed)
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
    if run.episodes is not None:  # tool worker processes
        run.episodes.close()
    if hasattr(run.engine, "close"):  # vLLM: free the engine (one per process at a time)
        run.engine.close()
    if run.pipeline is not None:
        run.pipeline.close()
    for sig, handler in previous.items():  # in-process callers (tests, notebooks) get theirs back
        signal.signal(sig, handler)
    return {"before": before, "after": after, "step": run.step, "last": run.logger.last,
            "counters": dict(run.counters)}


if __name__ == "__main__":
    main()
