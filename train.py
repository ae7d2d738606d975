"""train.py — reinforcement learning on a language model, the whole chain in one loop.

    python train.py --algo grpo                      # built-in task + tiny model, a laptop CPU, ~3 min
    python train.py --algo ppo --steps 200           # any preset; flags override the preset
    python train.py --model Qwen/Qwen2.5-0.5B-Instruct --train-data data.jsonl --reward math --engine vllm
    accelerate launch --num_processes 2 train.py --algo grpo   # 2 GPUs, DDP (CPU: nanorl/distributed.py)

One optimizer step of RL is one pass down the chain (`rl_step`, one stage per link: nanorl/stages.py):

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync

1. rollout      the engine samples `samples_per_prompt` responses for each prompt (nanorl/rollout.py)
2. reward       each response is scored against its label (nanorl/rewards.py)
3. recompute    exactly what the step's plan needs, no gradient: π_old, reference, critic values, Σπ²,
                a teacher's log-probs of the sampled tokens (on-policy distillation: nanorl/teacher.py)
                (the estimator and loss declare it: nanorl/plan.py)
4. advantage    how much better each token did than expected (nanorl/advantage.py)
5. loss         policy loss + KL + entropy (+ value loss), aggregated (nanorl/losses.py, nanorl/kl.py)
6. backward     per micro-batch, with denominators of the whole step so splitting changes nothing
7. step         AdamW after gradient clipping; a non-finite loss or gradient skips the update
8. sync         the engine gets the new weights (free for the HF engine; verified for vLLM)

`setup` builds the run in chain order (its pieces: nanorl/build.py). With --async-steps K, steps 1-2
run in a worker process up to K batches ahead (nanorl/pipeline.py). Several ranks: each owns an
engine and a disjoint shard of the prompts, and N ranks take exactly the step one rank would take on
the whole batch (nanorl/distributed.py).
"""
from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
import time

import numpy as np
import torch

from nanorl import build, checkpoint, distributed, pipeline, precision, rounds, sources, stages
from nanorl.config import Config, ConfigError, parse_args, user_error_line
from nanorl.data import PromptFormat, PromptLoader, build_prompts, load_rows
from nanorl.evaluation import EvalSampling, evaluate, load_eval_sets
from nanorl.kl import AdaptiveKLController, FixedKLController
from nanorl.logger import Logger, PhaseTimer, RunDirError, RunDirLock, claim_run_dir
from nanorl.partial_rollout import AbortingRollout, GroupFilter
from nanorl.plan import Plan, make_plan
from nanorl.plugins import Hooks, apply as apply_plugins
from nanorl.rewards import RewardRunner, load_reward_fn
from nanorl.rollout import SamplingConfig, stop_token_ids
from nanorl.teacher import load_teacher
from nanorl.update import Learner, train_on

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
    teacher: torch.nn.Module | None = None  # --teacher: scores the sampled tokens (nanorl/teacher.py)
    critic: torch.nn.Module | None = None
    trained: torch.nn.Module | None = None  # policy + critic behind one forward; DDP with N ranks
    scaler: torch.amp.GradScaler | None = None  # fp16 only: the dynamic loss scale
    episodes: object | None = None  # --env's multi-turn driver / --agent's runner (nanorl/env.py, agent.py)
    hooks: Hooks | None = None  # --reward-postprocess, --sample-filter, --log-metadata (nanorl/plugins.py)
    # what a checkpoint saves in flight: --async-steps' end of the worker (nanorl/pipeline.py), or the
    # buffer of synchronous --partial-rollout abort (sources.Partial, also the run's source)
    pipeline: object | None = None
    source: object | None = None  # where the step's samples come from (nanorl/sources.py)
    plan: Plan | None = None  # what each step computes: the estimator's and loss's needs (nanorl/plan.py)
    sampling: SamplingConfig | None = None  # how each step samples (temperature, top-k/p, stop tokens)
    rounds: rounds.OneRound | None = None  # how each step draws: one round, DAPO's (nanorl/rounds.py)
    finishers: list = dataclasses.field(default_factory=list)  # after the filters (rounds.finishers)
    scorers: dict = dataclasses.field(default_factory=dict)  # reward model / judge components (build.py)
    reward_weights: dict | None = None  # --reward-weights: each component's weight in the total
    rank: int = 0
    world: int = 1
    step: int = 0
    counters: dict = dataclasses.field(default_factory=dict)  # skipped updates, data skips, ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(cfg: Config) -> Run:
    """Everything one run holds, built in chain order: task, policy, engine, trained modules, optimizer."""
    cfg = apply_plugins(cfg)  # a no-op when main already did (setup(Config.from_flags(...)) callers)
    rank, world, device = distributed.init()  # `accelerate launch` / `torchrun` env, or one process
    # FSDP shards over a process group, which a plain `python train.py` has not joined (torchrun or
    # accelerate launch with one process has: that runs)
    if cfg.memory.fsdp and not torch.distributed.is_initialized():
        raise ConfigError("--fsdp shards the model over a process group and this run joined none: launch "
                          "it with `torchrun --nproc-per-node N train.py ...` (or accelerate launch), or "
                          "drop --fsdp")
    # the built-in task: 1 thread unless told (Config.flag_default('threads'))
    if cfg.memory.threads or not cfg.model:
        torch.set_num_threads(cfg.memory.threads or 1)
    seed_everything(cfg.seed + rank)
    # several nodes: out_dir must be one shared directory (rank 0 writes task, logs, checkpoints once)
    distributed.check_shared_dir(cfg.out_dir, rank, world)
    cfg = build.with_task_files(cfg, rank, world)  # the built-in task without --model / --train-data
    precision.setup_device(device)  # TF32 on CUDA
    dtype = precision.compute_dtype(cfg.memory.dtype)  # compute dtype; `model` holds the fp32 master weights
    model, tokenizer = build.load_policy(cfg, device, dtype)
    teacher = load_teacher(cfg, model, tokenizer, device, dtype)  # first: a wrong vocabulary fails at start
    fmt = PromptFormat(cfg.prompts.system_prompt, cfg.prompts.prompt_template, cfg.prompts.chat_template,
                       cfg.chat_template_dict)
    train, skipped = build_prompts(load_rows(cfg.train_data), tokenizer, cfg.prompts.input_key,
                                   cfg.prompts.label_key, cfg.prompts.max_prompt_len, source=cfg.train_data,
                                   fmt=fmt, log=print if rank == 0 else None)
    eval_sets = load_eval_sets(cfg.test_data, tokenizer, cfg.prompts.input_key, cfg.prompts.label_key,
                               cfg.prompts.max_prompt_len,
                               fmt, limit=cfg.evaluation.eval_limit, seen={p.text for p in train})
    if cfg.engine == "auto":  # vLLM on a GPU when installed, never for a GGUF file (build.engine_of)
        cfg = cfg.replace(engine=build.engine_of(cfg, device))
    everything = train + [p for s in eval_sets for p in s.prompts]  # vLLM: sized for the longest request
    engine = build.make_engine(cfg, model, tokenizer, everything, device, dtype, rank)
    critic, ref, trained = build.make_trained(cfg, model, device, dtype)
    optimizer, scheduler = build.make_optimizer(cfg, model, critic)
    kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl.kl_target, horizon=10_000) if cfg.kl.kl_target
              else FixedKLController(cfg.kl_coef))
    logger = Logger(cfg.out_dir, cfg.steps, enabled=rank == 0, quiet=cfg.saving.quiet,
                    tensorboard=cfg.saving.tensorboard, wandb_project=cfg.saving.wandb_project,
                    config=cfg.as_flags(), resume=bool(cfg.saving.resume))
    # reward workers: half of this node's cores, shared by the ranks on this node (not by every node's)
    workers = max(1, min(8, (os.cpu_count() or 2) // (2 * distributed.local_world_size(world))))
    rewards = RewardRunner(load_reward_fn(cfg.reward), timeout=cfg.reward_timeout, log=logger.print,
                           workers=workers)
    loader = PromptLoader(train, cfg.prompts_per_step, seed=cfg.seed, rank=rank, world=world)
    run = Run(cfg, model, tokenizer, engine, loader, eval_sets, rewards, optimizer, scheduler, kl_ctl, logger,
              ref=ref, teacher=teacher, critic=critic, trained=trained,
              scaler=precision.grad_scaler(dtype, device),
              rank=rank, world=world, counters={"skipped_updates": 0,
                                                "prompts_skipped_empty": skipped["empty"],
                                                "prompts_skipped_too_long": skipped["too_long"]})
    # where samples come from: the engine, --env's episodes or --agent's (--async-steps: run_training
    # puts the worker in front of it, which chooses the same over its own engine)
    run.episodes, run.source = build.sample_source(cfg, engine, tokenizer, fmt, log=logger.print)
    run.hooks = Hooks(cfg)  # --reward-postprocess, --log-metadata (and what --plugin filled in)
    run.plan = make_plan(cfg, cfg.advantage_fn, cfg.policy_loss_fn)  # what each step computes
    run.sampling = SamplingConfig(temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
                                  top_p=cfg.sampling.top_p, max_new_tokens=cfg.max_new_tokens,
                                  stop_token_ids=stop_token_ids(model, tokenizer),
                                  keep_support=cfg.sampling.keep_sampling_mask,
                                  support_cap=cfg.sampling.support_cap)
    run.rounds = rounds.OneRound()
    # DAPO's dynamic sampling: its rounds run here, or in the async worker; with --partial-rollout abort
    # the source judges each group as it finishes (partial_rollout.GroupFilter) and brings kept ones
    if cfg.dapo.filter_groups:
        partial = cfg.pipeline.async_steps or cfg.pipeline.partial_rollout == "abort"
        run.rounds = rounds.FromWorker() if partial else rounds.DynamicSampling()
    run.finishers = rounds.finishers(cfg, tokenizer)  # overlong punishment, --mask-think
    # --reward-model, --judge: reward components beside --reward, weighed by --reward-weights. With
    # --async-steps the worker scores the steps' samples (its fault totals join these); the trainer builds
    # its own only for the held-out sets, which evaluation scores as a step does (a second reward model)
    run.scorers = build.make_scorers(cfg, device, dtype, logger.print) if not cfg.pipeline.async_steps or \
        eval_sets else {name: pipeline.WorkerScored() for name in build.scorer_names(cfg)}
    run.reward_weights = build.reward_weights(cfg)
    # --partial-rollout abort without --async-steps: the engine over-sampled, the unfinished groups
    # aborted into a buffer that the next step resumes first and a checkpoint saves (sources.Partial)
    if cfg.pipeline.partial_rollout == "abort" and not cfg.pipeline.async_steps:
        run.source = run.pipeline = partial_source(run)
    engine.update_weights(model, version=0)
    return run


def partial_source(run: Run) -> sources.Partial:
    """Synchronous --partial-rollout abort over the run's source (the engine's, or --env's episodes) and
    loader (sources.Partial); with --filter-groups each step's groups are judged as they finish by a
    GroupFilter over that source; scored as a step scores (rounds.score: --reward, reward model, judge)."""
    cfg = run.cfg
    inner = run.source  # the engine's, or --env's episodes: what is aborted and resumed

    def score(prompts, samples) -> list:  # as the step scores (--reward, reward model, judge)
        return rounds.score(dataclasses.replace(sampler_of(run), source=inner), prompts, samples)
    # several ranks: each its shard of the step's groups, over its own loader shard and buffer
    rollout = AbortingRollout(inner, run.engine, score, run.loader, cfg.prompts_per_step // run.world,
                              cfg.samples_per_prompt, cfg.dapo.over_sample)
    keep = None
    if cfg.dapo.filter_groups:
        def keep() -> GroupFilter:  # this step's (sampler_of reads run.step), scored as the step scores
            return GroupFilter(dataclasses.replace(sampler_of(run), source=inner), cfg.dapo.max_gen_batches)
    return sources.Partial(rollout, inner, keep, cfg.pipeline.mask_offpolicy_in_partial_rollout, run.rank)


def checkpoint_state(run: Run) -> checkpoint.State:
    """What a checkpoint saves and restores of the run (nanorl/checkpoint.py)."""
    return checkpoint.State(model=run.model, tokenizer=run.tokenizer, optimizer=run.optimizer,
                            scheduler=run.scheduler, loader=run.loader, kl_ctl=run.kl_ctl,
                            trained=run.trained, critic=run.critic, engine=run.engine, rewards=run.rewards,
                            scorers=run.scorers, pipeline=run.pipeline, counters=run.counters, step=run.step,
                            rank=run.rank, world=run.world)


def resume_run(run: Run, path_or_latest: str) -> str | None:
    """--resume: the run continues from a checkpoint (its step too); the checkpoint's path, or None."""
    state = checkpoint_state(run)
    try:
        return checkpoint.resume(state, run.cfg, path_or_latest, run.logger)
    finally:
        run.step = state.step


def evaluate_run(run: Run) -> dict:
    """Greedy (and pass@k) accuracy on every held-out set, each rank a slice (nanorl/evaluation.py)."""
    sampling = EvalSampling.from_config(run.cfg, run.sampling.stop_token_ids)  # training's stop tokens
    return evaluate(run.eval_sets, run.engine, sampling, run.cfg.seed, rewards=run.rewards,
                    tokenizer=run.tokenizer, episodes=run.episodes, rank=run.rank, world=run.world,
                    scorers=run.scorers, reward_weights=run.reward_weights,
                    log_metadata=run.hooks.log_metadata)


# ----------------------------------------------------------------------------- one RL step


def rl_step(run: Run) -> dict:
    """One optimizer step: the chain of the module docstring, one stage per link (nanorl/stages.py).
    The stages take the step's records: its sampler (what drawing samples reads), its learner (the
    policy and its optimizer, what the forwards and the update read) and its plan."""
    timer, metrics = PhaseTimer(), {}
    sampler, learner, plan = sampler_of(run), learner_of(run), run.plan
    prompts = run.loader.next_batch()
    samples, baselines = stages.rollout(sampler, plan, run.sampling, prompts, timer, metrics)  # 1-2.
    if run.cfg.saving.debug_rollout_only or not stages.enough_to_train(run.world, len(samples)):
        # only checking rollouts, or DAPO's filter left no rank a sample: no update
        stages.dump_step(learner, samples, None)
        run.source.publish(run.model, run.step + 1)  # async: batch step + 1 + K waits for version step + 1
        return stages.rollout_metrics(run.hooks, samples, timer, metrics)
    samples, batch = stages.to_batch(learner, run.engine, samples)
    valid = batch.response_mask  # [B, T] every response token (DAPO's overlong filter narrows the loss's)
    with timer("logprob"), torch.no_grad():
        stages.recompute(learner, plan, run.source, samples, batch, metrics)  # 3. what the plan needs
    with timer("advantage"):
        stages.advantages(learner, plan, batch, baselines, metrics)  # 4. (and the step's off-policy weights)
    with timer("logprob"), torch.no_grad():
        stages.reference_of_trained_rows(learner, plan, batch)  # a KL loss with --skip-zero-advantage
    with timer("train"):
        metrics.update(train_on(learner, batch))  # 5-7. loss, backward, optimizer step
    stages.dump_step(learner, samples, batch)
    precision.free_cached_memory(batch.input_ids.device)  # activations go back before the engine wakes
    with timer("sync"):
        stages.sync(learner, run.engine, run.source, metrics)  # 8. the next batch is sampled from them
    return stages.step_metrics(learner, plan, run.hooks, samples, batch, valid, timer, metrics)


def sampler_of(run: Run) -> rounds.Sampler:
    """This step's sampling side (nanorl/rounds.py): what drawing and scoring its samples reads."""
    return rounds.Sampler(cfg=run.cfg, source=run.source, engine=run.engine, loader=run.loader,
                          rewards=run.rewards, scorers=run.scorers, reward_weights=run.reward_weights,
                          tokenizer=run.tokenizer, hooks=run.hooks, world=run.world, counters=run.counters,
                          step=run.step, logger=run.logger, rounds=run.rounds, finishers=run.finishers)


def learner_of(run: Run) -> Learner:
    """This step's training side (nanorl/update.py): the policy, its optimizer, the frozen models it is
    scored against."""
    return Learner(cfg=run.cfg, model=run.model, trained=run.trained, ref=run.ref, teacher=run.teacher,
                   tokenizer=run.tokenizer, optimizer=run.optimizer, scheduler=run.scheduler,
                   scaler=run.scaler, kl_ctl=run.kl_ctl, counters=run.counters, logger=run.logger,
                   step=run.step, world=run.world, rank=run.rank)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    # user plug-ins are loaded and checked here, never while the Config is built (nanorl/plugins.py)
    cfg = apply_plugins(parse_args(argv) if not isinstance(argv, Config) else argv)
    rank, world, _ = distributed.init()  # first: an error anywhere after this stops every rank with it
    with distributed.fail_together(rank, world):
        lock = claim_out_dir(cfg, rank, world)  # before anything is written there
        try:
            result = run_training(cfg)
        finally:
            lock.release()
    # every rank got here: the group can go (a gloo group left alive can abort the exit)
    distributed.shutdown()
    return result


def claim_out_dir(cfg: Config, rank: int, world: int) -> RunDirLock:
    """--out-dir at start-up: rank 0 (its only writer) locks it for the run and refuses an earlier run's
    directory without --resume / --overwrite (nanorl/logger.py claim_run_dir); every rank raises the
    same RunDirError. `setup` alone claims nothing (benchmarks and tests drive runs side by side)."""
    lock, err = RunDirLock(None), None
    if rank == 0:
        try:
            lock = claim_run_dir(cfg.out_dir, cfg.saving.resume, cfg.saving.overwrite)
        except RunDirError as e:
            err = str(e)
    if world > 1:  # rank 0's verdict on every rank
        box = [err]
        torch.distributed.broadcast_object_list(box, src=0)
        err = box[0]
    if err is not None:
        raise RunDirError(err)
    return lock


def cli(argv: list[str] | None = None) -> None:
    """`python train.py ...`: `main`, where a user's mistake (a config rule, a refused --out-dir, a
    bad flag) ends the run with one line on stderr and exit status 2 (argparse's convention), and a
    checkpoint that cannot be written or read (a full disk, a damaged directory) with its one line and
    status 1, no traceback; a bug keeps its traceback. Programmatic callers of main get the exception."""
    prog = os.path.basename(sys.argv[0]) or "train.py"
    try:
        main(argv)
    except Exception as e:
        line, status = user_error_line(e, prog), 2
        if line is None and isinstance(e, checkpoint.CheckpointError):
            line, status = f"{prog}: error: {' '.join(str(e).split())}", 1
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        distributed.end_process(status)  # several ranks: exit without the interpreter's teardown (see there)
        raise SystemExit(status) from None
    distributed.end_process()  # several ranks: exit without the interpreter's teardown (see there)


def run_training(cfg: Config) -> dict:
    run = setup(cfg)
    resumed = resume_run(run, cfg.saving.resume) if cfg.saving.resume else None
    # the rollout worker starts from the (resumed) weights, during the first eval
    if cfg.pipeline.async_steps:
        run.pipeline = pipeline.start(run, resumed)
        run.source = sources.Worker(run.pipeline, run.source)
    stop = {"now": False}
    previous = {sig: signal.signal(sig, lambda *_: stop.update(now=True))  # finish the step, save,
                for sig in (signal.SIGINT, signal.SIGTERM)}                 # exit 0 with a resume hint
    before = evaluate_run(run)  # every rank scores a slice of every eval set (nanorl/evaluation.py)
    if before:
        run.logger.print(f"held-out greedy accuracy at step {run.step}: {100 * before['eval/accuracy']:.1f}%")
    # the training prompts that build_prompts dropped (said at start-up), once in the first row
    dropped = {} if resumed else {f"data/{k}": v for k, v in run.counters.items()
                                  if k.startswith("prompts_skipped_") and v}
    if before or dropped:
        run.logger.log(run.step, {**before, **dropped})
    start = time.time()
    while run.step < cfg.steps and not stop["now"]:
        metrics = distributed.reduce_metrics(rl_step(run), run.world)
        run.step += 1
        if cfg.evaluation.eval_every and run.step % cfg.evaluation.eval_every == 0 and run.step < cfg.steps:
            metrics.update(evaluate_run(run))
        run.logger.log(run.step, metrics)
        if cfg.saving.save_every and run.step % cfg.saving.save_every == 0:
            checkpoint.save(checkpoint_state(run), run.cfg, run.logger)
    if run.world > 1:  # every rank must hold (and have synced into its engine) the same weights
        # the HF engine's copy: what it samples from
        distributed.check_ranks_in_sync(run.engine.sampled_module() or run.model, run.world)
        run.logger.print(f"ranks in sync: parameters identical on {run.world} ranks")
    after = evaluate_run(run) if not stop["now"] else {}  # interrupted: save first, fast
    if after:
        run.logger.log(run.step, after)
        run.logger.print(f"accuracy before: {100 * before['eval/accuracy']:.1f}%")
        run.logger.print(f"accuracy after: {100 * after['eval/accuracy']:.1f}%")
    path = checkpoint.save(checkpoint_state(run), run.cfg, run.logger)
    run.logger.print(f"{run.step} steps in {time.time() - start:.0f}s; saved {path}")
    if stop["now"]:
        run.logger.print(f"interrupted at step {run.step}; resume with: python train.py "
                         f"{' '.join(sys.argv[1:])} --resume latest")
    # in order: the logger, the reward workers and scorers, --env's tool worker processes, the engine
    # (vLLM: one engine per process at a time), the async worker
    for part in (run.logger, run.rewards, *run.scorers.values(), run.episodes, run.engine, run.source):
        if part is not None:
            part.close()
    for sig, handler in previous.items():  # in-process callers (tests, notebooks) get theirs back
        signal.signal(sig, handler)
    return {"before": before, "after": after, "step": run.step, "last": run.logger.last,
            "counters": dict(run.counters)}


if __name__ == "__main__":
    cli()
