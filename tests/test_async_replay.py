"""--async-steps K with --routing-replay (issue 48): the rollout worker's engine records each sample's
experts under the version that sampled it, they travel with the batch (and through a checkpoint), and
the trainer replays exactly those: batch t's replayed experts are version max(0, t − K)'s own routing
of its tokens, not the trainer's newer one. A tiny random Qwen3-MoE on the built-in task.

    python -m pytest tests/test_async_replay.py -q
"""
import json
import math
import os

import pytest
import torch

import train
from nanorl import moe_replay, pipeline, rollout, shared_weights, stages
from nanorl.config import Config
from nanorl.weight_broadcast import free_port

TINY = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "4",
        "--quiet", "--pass-k", "2", "--threads", "1", "--schedule", "constant", "--max-new-tokens", "4",
        "--routing-replay"]
TIMING = ("perf/", "time/")  # wall-clock figures: differ run to run


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl import task as builtin
    root = str(tmp_path_factory.mktemp("moe_task"))
    paths = builtin.make_default(os.path.join(root, "task"), seed=0)
    tok = builtin.build_tokenizer()
    moe = moe_replay.tiny_moe("qwen3_moe", seed=0, vocab_size=len(tok), pad_token_id=0, eos_token_id=1)
    moe.save_pretrained(os.path.join(root, "moe"))
    tok.save_pretrained(os.path.join(root, "moe"))
    # the random MoE answers nothing right: a reward that varies within each group, so every step trains
    reward = os.path.join(root, "varied.py")
    with open(reward, "w") as f:
        f.write("def reward(prompt, response, label):\n    return sum(map(ord, response)) % 7 / 6.0\n")
    return {**paths, "model": os.path.join(root, "moe"), "reward": f"{reward}:reward"}


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--reward", task["reward"], "--out-dir", str(out), *TINY, *extra]


def step_lines(out) -> list[dict]:
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith(TIMING)} for x in lines if "train/loss" in x]


def patched(model_path: str, state: dict) -> torch.nn.Module:
    """The tiny MoE with the weights `state`, patched to record its routing."""
    from nanorl.policy import load_model
    model = moe_replay.patch(load_model(model_path, "cpu", torch.float32)[0]).eval()
    model.load_state_dict(state)
    return model


def routing_under(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[n, L, k] the experts `model` routes the tokens ids [n] to in one full forward."""
    with torch.no_grad(), moe_replay.record(model) as rec:
        model(ids[None])
    return rec.experts[0]


def test_config_builds_async_with_routing_replay():
    cfg = Config.from_flags(async_steps=1, routing_replay=True)
    assert cfg.pipeline.async_steps == 1 and cfg.memory.routing_replay


def test_the_trainer_replays_the_routing_of_the_version_that_sampled_the_batch(task, tmp_path, monkeypatch):
    """train.py end to end, K = 1, lr large enough that each update moves some routing: every version
    the trainer publishes is kept, and what the trainer replays at step t (the batch routing_forward
    gets: π_old and every training forward read it) is, row by row, version max(0, t − 1)'s own
    routing of the row's tokens — and not version t's (the trainer's, which R2 would record), nor
    another version's. Step 0 replays the trainer's own version: disagreement 0."""
    versions, replayed = {}, []
    publish, routing_forward = shared_weights.SharedWeights.publish, stages.routing_forward

    def keep(self, model, version):  # the trainer's side: the worker only reads the slots
        versions[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return publish(self, model, version)

    def spy(learner, batch, support, metrics):
        replayed.append((batch.input_ids.cpu(), None if batch.routed_experts is None else
                         (batch.routed_experts.cpu(), batch.routed_mask.cpu())))
        return routing_forward(learner, batch, support, metrics)

    monkeypatch.setattr(shared_weights.SharedWeights, "publish", keep)
    monkeypatch.setattr(stages, "routing_forward", spy)
    steps = 4
    train.main(args(task, tmp_path / "run", "--steps", str(steps), "--async-steps", "1", "--lr", "1e-2"))
    lines = step_lines(tmp_path / "run")
    assert len(lines) == steps and all(x["routing/replay_mode"] == 3.0 for x in lines)
    assert all(math.isfinite(x["train/loss"]) for x in lines)
    assert [x["rollout/async/staleness_routing_max"] for x in lines] == [0, 1, 1, 1]
    assert lines[0]["routing/disagreement"] == 0.0
    assert len(replayed) == steps and sorted(versions) == list(range(steps + 1))
    models = {v: patched(task["model"], state) for v, state in versions.items()}
    wrong_somewhere = {}
    for t, (ids, routed) in enumerate(replayed):
        assert routed is not None, f"step {t} replayed no rollout routing"
        experts, mask = routed  # [B, P+T, L, k], [B, P+T]
        for b in range(ids.shape[0]):
            row = mask[b]  # the recorded columns: the sample's tokens but its last
            for v, model in models.items():
                got = routing_under(model, ids[b][row])
                same = torch.equal(got.long(), experts[b][row])
                if v == max(0, t - 1):
                    assert same, f"step {t}, row {b}: the replayed experts are not version {v}'s"
                elif not same:
                    wrong_somewhere[v, t] = True
    # the check has teeth: a neighbouring version routes some replayed row differently
    assert any(wrong_somewhere.get((t, t)) for t in range(1, steps)), wrong_somewhere


def test_a_routing_of_another_version_stops_the_run(task, tmp_path, monkeypatch):
    """Planted: the worker's engine labels its routing with the previous version (as if recorded from
    the last batch's weights). The trainer refuses the batch before it trains."""
    samples = rollout.HFEngine._samples

    def stale(self, *a):
        out = samples(self, *a)
        for s in out:
            s.routing_version = self.version - 1
        return out
    monkeypatch.setattr(rollout.HFEngine, "_samples", stale)  # inherited by the forked worker
    with pytest.raises(RuntimeError, match="reached step 0 with routing recorded under version -1"):
        train.main(args(task, tmp_path / "bad", "--steps", "3", "--async-steps", "1"))
    assert len(step_lines(tmp_path / "bad")) == 0


def test_a_batch_without_routing_stops_the_run(task, tmp_path, monkeypatch):
    """Planted: the worker's engine records no routing. The trainer would silently record its own
    (R2, its newer weights) instead of replaying the rollout's: it refuses the batch."""
    samples = rollout.HFEngine._samples

    def unrouted(self, *a):
        out = samples(self, *a)
        for s in out:
            s.routed_experts = s.routing_version = None
        return out
    monkeypatch.setattr(rollout.HFEngine, "_samples", unrouted)
    with pytest.raises(RuntimeError, match="carries no routed experts"):
        train.main(args(task, tmp_path / "bad", "--steps", "2", "--async-steps", "1"))


def test_a_worker_engine_that_records_no_routing_fails_at_start(task, tmp_path, monkeypatch):
    """An engine whose samples carry no routing (vLLM on CPU: its R2 fallback) is refused in the worker
    before it samples: the trainer would record its own routing while the worker's reference ran
    unreplayed."""
    from nanorl import build
    make = build.worker_engine

    def unrecording(*a, **kw):
        engine = make(*a, **kw)
        engine.record_routing = False
        return engine
    monkeypatch.setattr(build, "worker_engine", unrecording)  # inherited by the forked worker
    with pytest.raises(RuntimeError, match="needs an engine that records routing"):
        train.main(args(task, tmp_path / "bad", "--steps", "2", "--async-steps", "1"))


@pytest.mark.parametrize("K", [1, 0])
def test_routing_replay_resume_is_the_uninterrupted_run(task, tmp_path, K):
    """4 steps, and the same run resumed from its step-2 checkpoint, log the same steps 3-4 and end on
    the same weights. K = 1: batch 2 (version 1's, its routing with it) comes from pipeline.pt. K = 0
    (synchronous): the MoE's fused experts, saved split by transformers, load back exactly."""
    from nanorl import checkpoint
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", "--async-steps", str(K), "--save-every", "2", "--keep-checkpoints", "3")
    train.main(args(task, a, *extra))
    ck = os.path.join(a, "checkpoints", "step_000002")
    if K:
        saved = torch.load(os.path.join(ck, pipeline.FILE), weights_only=True)
        assert [x["batch"] for x in saved["batches"]] == [2]
        assert all(s["routed_experts"] is not None and s["routing_version"] == s["weight_version"] == 1
                   for s in saved["batches"][0]["samples"])
    train.main(args(task, b, *extra, "--resume", ck))
    la, lb = step_lines(a), step_lines(b)
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    assert all(x["routing/replay_mode"] == 3.0 for x in lb)
    if K:
        assert lb[0]["rollout/async/staleness_routing_max"] == 1
    wa = checkpoint.load_file(os.path.join(a, "checkpoints", "step_000004", "model.safetensors"))
    wb = checkpoint.load_file(os.path.join(b, "checkpoints", "step_000004", "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_ranks_replay_the_workers_routing_as_one_process(task, tmp_path):
    """torchrun, 2 gloo ranks, --async-steps 1 --routing-replay: rank 0's worker records the experts of
    every rank's samples, each rank replays its shard's; the logged rewards and routing staleness are the
    one process's, the routing disagreement within its rank-averaging, and the ranks end in sync
    (train.py's check)."""
    from test_lockstep import run as launch
    extra = ("--steps", "3", "--async-steps", "1", "--lr", "1e-2")
    logged = {}
    for d, ranks in (("one", 1), ("two", 2)):
        proc = launch("train.py", *args(task, tmp_path / d, *extra), ranks=ranks, port=free_port())
        assert proc.returncode == 0, proc.stdout[-3000:]
        rows = step_lines(tmp_path / d)
        logged[d] = [(r["rollout/reward_mean"], r["rollout/async/staleness_routing_max"],
                      r["routing/disagreement"]) for r in rows]
    assert "ranks in sync" in proc.stdout
    assert len(logged["one"]) == 3 and [x[1] for x in logged["one"]] == [0.0, 1.0, 1.0]
    # the same samples, their means reduced in another order over 2 ranks
    for i in range(2):
        assert [x[i] for x in logged["two"]] == pytest.approx([x[i] for x in logged["one"]], abs=1e-6)
    # routing/disagreement is each rank's share of its tokens, averaged over the ranks (not pooled)
    assert [x[2] for x in logged["two"]] == pytest.approx([x[2] for x in logged["one"]], abs=0.01)
