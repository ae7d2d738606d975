"""--async-steps with --fsdp (nanorl/pipeline.py): each published version is gathered tensor by
tensor from the trainer ranks' shards (distributed.full_tensors, every rank in every gather) and
written by rank 0 into the worker's slot. Checked on 2 gloo ranks: the slot holds the trainer's full
parameters after each publish (no train.py, default tier); a train.py run trains and takes DDP's steps;
a run resumed mid-flight from its sharded checkpoint is the uninterrupted run (slow tier).

    python -m pytest tests/test_async_fsdp.py -q          # the publish
    python -m pytest tests/test_async_fsdp.py -q -m slow  # the train.py runs
"""
import glob
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanorl.weight_broadcast import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the publish, 2 ranks


def _receive(spec, out) -> None:
    """The vLLM worker's end of the weight channel (a child forked by rank 0): versions 0 and 1 as
    it holds them, sent back whole."""
    import pickle

    from nanorl import weight_broadcast
    rx = weight_broadcast.Receiver(spec)
    for v in (0, 1):
        assert rx.wait_for(v, timeout=120), f"version {v} never arrived"
        out.put(pickle.dumps({k: t.clone() for k, t in rx.slot(v).items()}))
        rx.release(v)


class _Channel:
    """Rank 0's end of one way to the worker, as pipeline.Pipeline builds it: "shm" the HF engine's
    shared slots, "gloo" / "ipc" (its host stand-in) --engine vllm's weight channel to a forked
    receiver; `held(v)` is version v as the worker holds it."""

    def __init__(self, kind: str, model, dtype):
        import pickle

        import torch.multiprocessing as mp

        from nanorl import weight_broadcast as wb
        from nanorl.shared_weights import SharedWeights, slot_layout
        ctx, self.pickle = mp.get_context("fork"), pickle
        if kind == "shm":
            self.weights, self.child = SharedWeights(model, 1, ctx, dtype), None
            return
        layout, size = slot_layout(model, dtype)
        spec = wb.ChannelSpec(wb.free_port(), kind, layout, size, slots=3, device="cpu")
        self.weights, self.out = wb.Sender(spec, torch.device("cpu")), ctx.Queue()
        self.child = ctx.Process(target=_receive, args=(spec, self.out))
        self.child.start()
        self.weights.connect()
        self.got = {}

    def held(self, v: int) -> dict:
        if self.child is None:
            return self.weights.slot(v)
        while v not in self.got:
            self.got[len(self.got)] = self.pickle.loads(self.out.get(timeout=120))
        return self.got[v]

    def close(self) -> None:
        if self.child is not None:
            self.held(1)
            self.child.join(30)
            self.child.kill()
            self.weights.close()


def _publish_rank(init_file: str, rank: int, world: int) -> dict:
    """One rank: a tiny tied Qwen2 sharded by FSDP2, versions 0 and 1 published as the pipeline does
    (rank 0 through each kind of `_Channel`, rank 1 a Follower); rank 0 compares what the worker holds
    of each version with the full weights."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl import distributed
    from nanorl.pipeline import Follower

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out = {}
    for kind, name, dtype in (("shm", "float32", torch.float32), ("shm", "bfloat16", torch.bfloat16),
                              ("gloo", "bfloat16", torch.bfloat16), ("ipc", "float32", torch.float32)):
        torch.manual_seed(0)  # the same model on both ranks
        # 3 layers of uneven shards (vocab 67, hidden 30 over 2 ranks), embeddings tied to the head
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=67, hidden_size=30, intermediate_size=34,
                                             num_hidden_layers=3, num_attention_heads=2,
                                             num_key_value_heads=1, tie_word_embeddings=True)).float()
        distributed.shard(model, torch.device("cpu"))
        cfg = SimpleNamespace(memory=SimpleNamespace(fsdp=True, dtype=name))
        if rank == 0:
            channel = _Channel(kind, model, dtype)
            channel.weights.publish(model, 0)
        else:
            follower = Follower(SimpleNamespace(cfg=cfg, model=model, step=0))  # takes part in version 0
        full = {0: {k: v.clone() for k, v in distributed.full_state_dict(model).items()}}
        with torch.no_grad():  # "train": every shard moves, differently on each rank
            for p in model.parameters():
                p.to_local().add_(0.1 * (rank + 1)).mul_(1.5)
        if rank == 0:
            channel.weights.publish(model, 1)
        else:
            follower.publish(model, 1)
        full[1] = distributed.full_state_dict(model)
        if rank == 0:
            case = out[f"{kind}-{name}"] = {}
            # what the worker loads (rollout_worker.Worker.load): every name of each version
            for v in (0, 1):
                held = channel.held(v)
                case[v] = {k: bool(torch.equal(held[k], full[v][k].to(dtype))) for k in full[v]}
            case["names"] = sorted(channel.held(1)) == sorted(full[1])
            case["moved"] = not torch.equal(full[0]["lm_head.weight"], full[1]["lm_head.weight"])
            channel.close()
    dist.destroy_process_group()
    return out


def test_a_publish_from_fsdp_shards_is_the_trainers_full_weights(tmp_path):
    """Versions 0 and 1 of a 2-rank FSDP model, in fp32 (bit for bit) and bf16 (the cast of each full
    tensor), into the HF engine's shared slots and over --engine vllm's weight channel (gloo; ipc's
    host stand-in): the worker holds every full tensor of each version, tied names included. Goes red
    when rank 0 writes its own shard, a stale version, or a rank skips a gather (a hang, timed out)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, __file__, str(tmp_path / "pg"), str(r), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert all(p.returncode == 0 for p in ranks), [err[-3000:] for _, err in outs]
    got = json.loads(outs[0][0].strip().splitlines()[-1])  # rank 0's verdicts
    assert sorted(got) == ["gloo-bfloat16", "ipc-float32", "shm-bfloat16", "shm-float32"]
    for case, verdict in got.items():
        assert verdict["names"] and verdict["moved"], (case, verdict)
        for v in ("0", "1"):
            wrong = [k for k, ok in verdict[v].items() if not ok]
            assert not wrong and len(verdict[v]) > 10, (case, v, wrong)


# ----------------------------------------------------------------------------- train.py on 2 ranks

BASE = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
        "--quiet", "--threads", "1", "--schedule", "constant", "--lr", "3e-4", "--warmup-steps", "0",
        "--async-steps", "1", "--steps", "4", "--save-every", "2", "--keep-checkpoints", "3"]
TIMING = ("perf/", "time/", "rollout/async/", "rollout/time/")  # wall-clock figures: differ run to run


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0, sft_steps=60)


def train(task, out, *extra) -> str:
    """train.py on 2 gloo ranks under torchrun, under a timeout (test_lockstep.run kills a hang)."""
    from test_lockstep import run as launch
    proc = launch("train.py", "--model", task["model"], "--train-data", task["train"], "--test-data",
                  task["test"], "--out-dir", str(out), *BASE, *extra, ranks=2, port=free_port(), timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def step_lines(out) -> list[dict]:
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith(TIMING)} for x in lines
            if "rollout/reward_mean" in x]


def weights(out, step) -> dict:
    """The step's saved weights, whole tensors (an FSDP checkpoint's consolidated safetensors too)."""
    from nanorl import checkpoint
    files = glob.glob(os.path.join(out, "checkpoints", f"step_{step:06d}", "*.safetensors"))
    return {k: v for f in files for k, v in checkpoint.load_file(f).items()}


@pytest.fixture(scope="module")
def fsdp_run(task, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, train(task, out, "--fsdp")


@pytest.mark.slow
def test_fsdp_async_run_trains_and_takes_ddps_steps(task, fsdp_run, tmp_path):
    """K = 1, 2 ranks, 4 steps: with --fsdp the run trains, ends with the ranks in sync, and logs the
    steps the DDP run logs (the same samples, from the same published versions: a stale or partial
    version would sample other tokens), its weights within the fp32 floor of DDP's."""
    out, log = fsdp_run
    assert "ranks in sync" in log
    train(task, tmp_path / "ddp")
    fsdp, ddp = weights(out, 4), weights(tmp_path / "ddp", 4)
    from nanorl import checkpoint
    init = checkpoint.load_file(os.path.join(task["model"], "model.safetensors"))
    assert max(float((fsdp[k] - init[k]).abs().max()) for k in init) > 1e-3  # it trained
    assert max(float((fsdp[k] - ddp[k]).abs().max()) for k in ddp) < 1e-5
    a, b = step_lines(out), step_lines(tmp_path / "ddp")
    assert len(a) == 4 and [x["step"] for x in a] == [1, 2, 3, 4]
    reward = "rollout/reward_mean"
    assert [x[reward] for x in a] == [x[reward] for x in b]  # the very samples
    assert all("train/loss" in x for x in a)  # every step updated
    assert [x["train/loss"] for x in a] == pytest.approx([x["train/loss"] for x in b], abs=1e-5)


@pytest.mark.slow
def test_fsdp_async_resume_mid_flight_is_the_uninterrupted_run(task, fsdp_run, tmp_path):
    """Resumed from the step-2 sharded checkpoint (batch 2, sampled ahead from version 1, comes from
    rank 0's pipeline.pt): steps 3-4 log what the uninterrupted run logged and end on its weights."""
    from nanorl import checkpoint, pipeline
    out, _ = fsdp_run
    ck = os.path.join(out, "checkpoints", "step_000002")
    assert pipeline.FILE in checkpoint.verify(ck)["files"]
    train(task, tmp_path / "resumed", "--fsdp", "--resume", ck)
    a, b = step_lines(out), step_lines(tmp_path / "resumed")
    assert [x["step"] for x in b] == [3, 4] and a[2:] == b
    wa, wb = weights(out, 4), weights(tmp_path / "resumed", 4)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


if __name__ == "__main__":  # one rank of the publish test
    print(json.dumps(_publish_rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
