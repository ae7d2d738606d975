"""Run by tests/test_lockstep.py: ranks holding different amounts of work finish the step, and take
exactly the step one process takes on the union of their samples.

    python tests/lockstep_check.py MODEL TRAIN OUT CASE...                          # 1 process: the reference
    torchrun --nproc_per_node 2 tests/lockstep_check.py MODEL TRAIN OUT CASE...    # 2 ranks (gloo)

Every process samples the same 8 prompts × 4 responses (same weights, same seed). Rewards are set so
that DAPO's group filter (--filter-groups, one generation round: --max-gen-batches 1, so no refill
evens the ranks out, as when dynamic sampling gives up) keeps groups 0, 1, 2 and 4 (rank 0 keeps 12
samples, rank 1 keeps 4) or 0, 1, 2 (the "empty" cases: rank 1 keeps none); rank r holds groups
4r..4r+3, one process all 8. Two rl_steps of train.py run on these samples (the engine and the reward
are patched to return them), then the full parameters go to OUT/CASE_wWORLD.pt.
FSDP cases also count gradient reductions (FSDP2's foreach_reduce) and optimizer steps. Prints one
line per case and rank: "case C rank R kept K reductions N steps S units U" (N should be S × U).
"""
import copy
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import train  # noqa: E402
from nanorl import distributed, rounds, update  # noqa: E402
from nanorl.config import parse_args  # noqa: E402
from nanorl.rollout import SamplingConfig, stop_token_ids  # noqa: E402

CASES = {  # name: (groups with signal, flags)
    "budget": ({0, 1, 2, 4}, ["--max-tokens-per-micro-batch", "24"]),  # 1 sample per micro-batch: 12 vs 4
    "mbs": ({0, 1, 2, 4}, ["--micro-batch-size", "2"]),
    "fsdp_budget": ({0, 1, 2, 4}, ["--fsdp", "--max-tokens-per-micro-batch", "24"]),
    "fsdp_mbs": ({0, 1, 2, 4}, ["--fsdp", "--micro-batch-size", "2"]),
    "empty": ({0, 1, 2}, []),  # rank 1: no sample at all, whole-batch micro-batches
    "fsdp_empty_mbs": ({0, 1, 2}, ["--fsdp", "--micro-batch-size", "2"]),
    # 6 optimizer steps per rollout: rank 1's 4 rows leave it 2 steps with no row at all (pads only);
    # the mini-batch split differs from one process's, so only finishing in sync is checked here
    "fsdp_minibatches": ({0, 1, 2, 4}, ["--fsdp", "--mini-batches", "6"]),
}

model, train_data, out, *cases = sys.argv[1:]
for case in cases:
    signal, flags = CASES[case]
    if os.environ.get("WORLD_SIZE", "1") == "1":  # the reference: one process, the same step unsharded
        flags = [f for f in flags if f != "--fsdp"]
    # no refill
    cfg = parse_args(["--algo", "grpo", "--filter-groups", "--max-gen-batches", "1", "--model", model,
                      "--train-data", train_data,
                      "--out-dir", f"{out}/{case}", "--max-new-tokens", "6", "--prompts-per-step", "8",
                      "--samples-per-prompt", "4", "--threads", "1", "--quiet", "--eval-every", "0",
                      "--lr", "1e-3", "--warmup-steps", "0", *flags])
    run = train.setup(cfg)
    rank, world = run.rank, run.world
    prompts = run.loader.prompts[:8]  # the same 8 prompts in every process
    samples = run.engine.generate([p.ids for p in prompts], 4, SamplingConfig(
        max_new_tokens=6, stop_token_ids=stop_token_ids(run.model, run.tokenizer), seed=123))
    mine = range(8) if world == 1 else range(4 * rank, 4 * rank + 4)
    my_prompts = [prompts[g] for g in mine]
    my_samples = [s for s in samples if s.group_id in mine]
    for i, s in enumerate(samples):  # a group with signal: rewards 1, 0, 1, 0; else all 0
        s.metadata["reward"] = float(s.group_id in signal and i % 2 == 0)
    run.loader.next_batch = lambda: my_prompts
    run.engine.generate = lambda ids, n, sampling: [copy.deepcopy(s) for s in my_samples]
    rounds.score = lambda run, prompts, batch: [s.metadata["reward"] for s in batch]
    reductions, steps, real_step = [0], [0], update.sync_and_step

    def stepped(*a, **k):
        steps[0] += 1
        return real_step(*a, **k)
    update.sync_and_step = stepped
    if cfg.memory.fsdp:  # count FSDP2's gradient reductions (one call per unit and reduction)
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
        real = pg.foreach_reduce

        def counted(*a, _real=real, **k):
            reductions[0] += 1
            return _real(*a, **k)
        pg.foreach_reduce = counted
    for _ in range(2):
        train.rl_step(run)
        run.step += 1
    update.sync_and_step = real_step
    if cfg.memory.fsdp:
        pg.foreach_reduce = real
    from torch.distributed.fsdp import FSDPModule
    units = sum(isinstance(m, FSDPModule) for m in distributed.unwrap(run.trained).modules())
    full = {k: v.detach().clone() for k, v in distributed.full_state_dict(run.model).items()}
    if world > 1:
        distributed.check_ranks_in_sync(run.model, world)
    if rank == 0:
        torch.save(full, f"{out}/{case}_w{world}.pt")
    kept = sum(1 for s in my_samples if s.group_id in signal)
    print(f"\ncase {case} rank {rank} kept {kept} reductions {reductions[0]} steps {steps[0]} units {units}",
          flush=True)
distributed.end_process()  # without the teardown that can abort a gloo rank at exit
