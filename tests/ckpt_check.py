"""Run by tests/test_lockstep.py: sharded FSDP checkpoints, resumed on 2 ranks and resharded on 1.

    torchrun --nproc_per_node 2 tests/ckpt_check.py save MODEL TRAIN OUT     # FSDP: a step, save, resume
    python tests/ckpt_check.py resume MODEL TRAIN OUT                         # 1 process, no FSDP

save: one rl_step under --fsdp, checkpoint.save, the full weights and optimizer state gathered to
OUT/reference.pt (for the 1-process check only), then checkpoint.resume of that checkpoint in the
same processes, its peak extra host memory measured (Linux VmHWM, reset through /proc/self/clear_refs):
prints "rank R resume_peak_mib X anon_peak_mib A shard_mib Y full_mib Z" (VmHWM growth, which
counts the file pages of mmapped safetensors; anonymous memory growth, sampled; model + Adam state:
this rank's shards / all of it). resume: a fresh process loads the checkpoint and compares every weight and
optimizer tensor with OUT/reference.pt bitwise, then trains one more step: prints "resharded max|Δ| D".
"""
import re
import sys
import threading

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])
import train  # noqa: E402
from nanorl import checkpoint, distributed, rounds  # noqa: E402
from nanorl.config import parse_args  # noqa: E402

MiB = 2**20
mode, model, train_data, out = sys.argv[1:5]
cfg = parse_args(["--algo", "grpo", "--kl-coef", "0", "--model", model, "--train-data", train_data,
                  "--out-dir", out,
                  "--max-new-tokens", "4", "--prompts-per-step", "4", "--samples-per-prompt", "2",
                  "--threads", "1",
                  "--quiet", "--eval-every", "0", *(["--fsdp"] if mode == "save" else [])])
run = train.setup(cfg)
rounds.score = lambda run, prompts, batch: [float(i % 2) for i in range(len(batch))]  # a real gradient


def status_mib(key: str) -> float:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def anon_peak_during(fn) -> float:
    """Peak growth of anonymous memory (RssAnon: no file pages, unlike VmHWM) while fn runs, sampled."""
    base, peak, done = status_mib("RssAnon"), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], status_mib("RssAnon") - base)
            done.wait(0.002)
    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return peak[0]


def optimizer_tensors(full: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    opts = StateDictOptions(full_state_dict=full, cpu_offload=full)
    state = get_optimizer_state_dict(distributed.unwrap(run.trained), run.optimizer, options=opts)
    state = state.get("state", {})  # full: on rank 0 only
    return {f"{p}.{k}": v for p, s in state.items() for k, v in s.items()}


def nbytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


if mode == "save":
    train.rl_step(run)
    run.step += 1
    path = checkpoint.save(train.checkpoint_state(run), run.cfg, run.logger)
    weights = {k: v.clone() for k, v in distributed.full_state_dict(run.model).items()}
    optim = optimizer_tensors(full=True)
    if run.rank == 0:
        torch.save({"weights": weights, "optimizer": optim, "path": path}, f"{out}/reference.pt")
    shard = sum(nbytes(p) for p in run.model.parameters()) + sum(nbytes(v)
                                                                 for v in optimizer_tensors(False).values())
    # + Adam's 2
    full = sum(v.numel() * v.element_size() for v in dict(run.model.named_parameters()).values()) * 3
    del weights, optim
    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on
        f.write("5")
    base = status_mib("VmHWM")
    anon = anon_peak_during(lambda: train.resume_run(run, path))
    print(f"\nrank {run.rank} resume_peak_mib {status_mib('VmHWM') - base:.1f} anon_peak_mib {anon:.1f} "
          f"shard_mib {shard / MiB:.1f} full_mib {full / MiB:.1f}", flush=True)
else:
    ref = torch.load(f"{out}/reference.pt", weights_only=True)
    train.resume_run(run, ref["path"])
    got = {k: v for k, v in run.model.state_dict().items()}
    diffs = [float((got[k] - v).abs().max()) for k, v in ref["weights"].items()]
    mine = optimizer_tensors(full=False)
    assert sorted(mine) == sorted(ref["optimizer"]), (sorted(mine)[:4], sorted(ref["optimizer"])[:4])
    diffs += [float((mine[k].float() - v.float()).abs().max()) for k, v in ref["optimizer"].items()]
    moments = max(float(v.abs().max()) for k, v in ref["optimizer"].items() if k.endswith("exp_avg"))
    train.rl_step(run)  # and it trains on
    print(f"\nresharded max|Δ| {max(diffs):.3e} tensors {len(diffs)} max|exp_avg| {moments:.3e}", flush=True)
distributed.end_process()  # without the teardown that can abort a gloo rank at exit
