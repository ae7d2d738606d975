"""Rollout dumps (nanorl/dump.py) and --debug-rollout-only: what is written is what the step held.

- records → write → read round-trips per-token tensors exactly (float32), non-finite values become null;
- through the real rl_step: the dump equals the step's tensors, and its trainer logprobs are the
  PRE-update policy's (scored independently here) on every row, also those --skip-zero-advantage keeps
  out of the update (a dump step runs the recompute); between dumps, the first-pass view covers the
  rows that trained, and only those;
- the size cap holds (a dump is cut at whole lines; the oldest dumps are deleted first);
- --debug-rollout-only makes no optimizer step: weights, optimizer and scheduler state unchanged.

Run: python -m pytest tests/test_dump.py -q
"""
import copy
import json
import math
import os

import pytest
import torch

import train
from nanorl import dump, update
from nanorl.config import parse_args
from nanorl.policy import response_logprobs
from nanorl.trajectory import Sample


class CharTokenizer:  # the two calls dump.records makes, on a fixed vocabulary
    vocab = ["<pad>", "<eos>", "a", "b", " ", "é", "<b>"]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def batch_decode(self, seqs):
        return [self.decode(s) for s in seqs]


def toy():
    samples = [Sample(prompt_ids=[2, 3], response_ids=[2, 4, 5, 1],
                      rollout_logprobs=[-0.1, -1.5, -2.25, -0.3],
                      reward={"correct": 1.0, "format": 0.5}, group_id=0, weight_version=3),
               Sample(prompt_ids=[2, 3], response_ids=[6, 1], rollout_logprobs=[-0.7, -0.01],
                      loss_mask=[0, 1],
                      reward={"correct": 0.0, "format": 0.5}, group_id=0, status="truncated",
                      weight_version=3)]
    g = torch.Generator().manual_seed(0)
    B, T = 2, 4
    tokens = {k: torch.randn(B, T, generator=g) for k in ("trainer_logprob", "entropy", "advantage")}
    tokens["loss_mask"] = torch.tensor([[1, 1, 1, 1], [0, 1, 0, 0]])
    tokens["entropy"][1, 3] = math.nan  # a padding position: never written
    return samples, tokens


def test_round_trip_equals_the_tensors(tmp_path):
    samples, tokens = toy()
    tokens["advantage"][0, 2] = math.inf  # a non-finite valid value: null, and the file stays strict JSON
    path, n = dump.write(str(tmp_path), 7, dump.records(samples, CharTokenizer(), 7, tokens), 2**20)
    assert n == 2 and path.endswith("step_000007.jsonl")
    for line in open(path):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = dump.read(path)
    assert [r["response"] for r in back] == ["a é<eos>", "<b><eos>"] and back[0]["prompt"] == "ab"
    assert back[0]["tokens"]["text"] == ["a", " ", "é", "<eos>"] and back[1]["tokens"]["id"] == [6, 1]
    assert back[0]["reward"] == 1.5 and back[0]["reward_components"] == {"correct": 1.0, "format": 0.5}
    assert (back[1]["status"], back[1]["weight_version"], back[1]["group"]) == ("truncated", 3, 0)
    lengths = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()  # [B, T] the responses' tokens
    for field in ("trainer_logprob", "entropy", "loss_mask"):
        got = dump.as_tensor(back, field, 4)  # [B, T]
        assert torch.equal(got[lengths], tokens[field].float()[lengths]), field  # bit-exact float32
    assert back[0]["tokens"]["advantage"][2] is None
    adv = dump.as_tensor(back, "advantage", 4)
    keep = lengths.clone()
    keep[0, 2] = False
    assert torch.equal(adv[keep], tokens["advantage"][keep])
    roll = dump.as_tensor(back, "rollout_logprob", 4)
    assert torch.equal(roll[lengths], torch.tensor([-0.1, -1.5, -2.25, -0.3, -0.7, -0.01])[:6].float())


def test_unknown_field_raises():
    samples, tokens = toy()
    with pytest.raises(ValueError, match="unknown per-token fields"):
        dump.records(samples, CharTokenizer(), 1, {**tokens, "advantages": tokens["advantage"]})


def test_size_cap_cuts_whole_lines_and_rotates_oldest(tmp_path):
    samples, tokens = toy()
    recs = dump.records(samples * 20, CharTokenizer(), 1, {k: v.repeat(20, 1) for k, v in tokens.items()})
    line = len((json.dumps(recs[0], ensure_ascii=False) + "\n").encode())
    cap = 10 * line  # room for ~10 of the 40 samples
    path, n = dump.write(str(tmp_path), 1, recs, cap)
    assert 5 <= n < 40 and os.path.getsize(path) <= cap
    assert len(dump.read(path)) == n  # every written line is a whole, parseable sample
    for step in (2, 3, 4):
        dump.write(str(tmp_path), step, recs[:3], cap)
        files = sorted(os.listdir(tmp_path))
        assert (sum(os.path.getsize(tmp_path / f) for f in files) <= cap
                and files[-1] == f"step_{step:06d}.jsonl")
    assert "step_000001.jsonl" not in os.listdir(tmp_path)  # the oldest went first
    assert "step_000004.jsonl" in os.listdir(tmp_path) and "step_000003.jsonl" in os.listdir(tmp_path)


# ----------------------------------------------------------------------------- through rl_step


# Groups of odd labels all score 0 (advantage 0: --skip-zero-advantage skips them); even labels score by
# a hash of the response (signal wherever the group's responses differ): both kinds of row in every step.
HALF = ("def half(prompt, response, label):\n"
        "    return 0.0 if int(label) % 2 else sum(map(ord, response)) % 7 / 7\n")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    d = tmp_path_factory.mktemp("task")
    paths = make_default(str(d), seed=0)
    (d / "half.py").write_text(HALF)
    paths["half"] = f"{d / 'half.py'}:half"
    return paths


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"], "--out-dir",
            str(out), "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0",
            "--eval-limit",
            "8", "--pass-k", "2", "--threads", "1", "--quiet", "--steps", "2", *extra]


def test_rl_step_dump_equals_the_step_tensors(task, tmp_path, monkeypatch):
    """On-policy (the default: one epoch, one mini-batch, the π_old recompute skipped) the trainer's
    π_old is each row's first forward of the update — but not for the rows --skip-zero-advantage keeps
    out (the default), which no forward scores: step 1 (no dump due) checks that view against an
    independent forward of a copy of the weights taken before the step. A dump step (step 2) runs the
    recompute, so EVERY row's dumped trainer logprob and entropy is the pre-update policy's."""
    run = train.setup(parse_args(args(task, tmp_path, "--dump-rollouts", "2", "--ppo-epochs", "1",
                                      "--kl-coef", "0", "--reward", task["half"])))
    seen = {}
    real = dump.rollouts

    def capture(samples, batch, *args, **kwargs):
        seen.update(samples=samples, batch=batch)
        return real(samples, batch, *args, **kwargs)
    monkeypatch.setattr(dump, "rollouts", capture)
    try:
        before = copy.deepcopy(run.model)
        metrics = train.rl_step(run)  # step 1: no dump
        run.step += 1
        batch = seen["batch"]
        # the HF engine in fp32 samples from the trainer's own distribution: ρ = π_old/π_rollout ≈ 1 on
        # every token the trainer scored (a skipped row's 0 in place of π_old would give ρ = 1/π_rollout)
        assert 0.999 < metrics["train/mismatch/ratio_p01"] <= metrics["train/mismatch/ratio_max"] < 1.001
        assert batch.tensors.old_logprobs is None and batch.tensors.trainer_logprobs is None
        assert not (tmp_path / "rollouts").exists()
        logp, ent, covered = update.old_policy_view(batch)
        valid = batch.attention_mask[:, batch.prompt_width:].bool()  # [B, T] real response tokens
        trained = (batch.tensors.advantages != 0).any(-1)  # [B]
        assert 0 < int(trained.sum()) < 16, trained  # both kinds of row: the test means something
        assert torch.equal(covered.bool() & valid, valid & trained[:, None])  # covered = the rows trained
        scored = valid & trained[:, None]
        with torch.no_grad():
            # [B, T] the weights before the step
            lp, en = response_logprobs(before, batch, run.cfg.sampling.temperature)
        assert (logp - lp)[scored].abs().max() < 1e-5 and (ent - en)[scored].abs().max() < 1e-5

        before = copy.deepcopy(run.model)
        train.rl_step(run)  # step 2: a dump step
    finally:
        run.logger.close()
        run.rewards.close()
    batch = seen["batch"]
    assert batch.tensors.old_logprobs is None  # the π_old the loss reads is still the first pass
    back = dump.read(str(tmp_path / "rollouts" / "step_000002.jsonl"))
    B, T = batch.response_ids.shape
    assert len(back) == B == 16 and [r["index"] for r in back] == list(range(B))
    valid = batch.attention_mask[:, batch.prompt_width:].bool()  # [B, T] real response tokens
    assert torch.equal(dump.as_tensor(back, "id", T).long()[valid], batch.response_ids[valid])
    td = batch.tensors
    trained = (td.advantages != 0).any(-1)  # [B]
    assert int(trained.sum()) < B  # some rows skipped training, and still have their numbers:
    assert all(r["tokens"]["trainer_logprob"] is not None and None not in r["tokens"]["trainer_logprob"]
               for r in back)
    for field, want in (("rollout_logprob", batch.rollout_logprobs), ("advantage", td.advantages),
                        ("loss_mask", batch.response_mask), ("trainer_logprob", td.trainer_logprobs),
                        ("entropy", td.trainer_entropy)):
        assert torch.equal(dump.as_tensor(back, field, T)[valid], want.float()[valid]), field
    with torch.no_grad():
        # [B, T] the weights before the step
        lp, ent = response_logprobs(before, batch, run.cfg.sampling.temperature)
    got = dump.as_tensor(back, "trainer_logprob", T)
    assert (got - lp)[valid].abs().max() < 1e-5 and (dump.as_tensor(back, "entropy", T) -
                                                     ent)[valid].abs().max() < 1e-5
    with torch.no_grad():
        after, _ = response_logprobs(run.model, batch, run.cfg.sampling.temperature)
    # the update moved the policy: "before" is not trivially equal
    assert (got - after)[valid].abs().max() > 1e-4
    assert [r["reward"] for r in back] == [s.total_reward for s in seen["samples"]]


def test_debug_rollout_only_makes_no_optimizer_step(task, tmp_path):
    run = train.setup(parse_args(args(task, tmp_path, "--debug-rollout-only", "--dump-rollouts", "1")))
    weights = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    sched = copy.deepcopy(run.scheduler.state_dict())
    try:
        metrics = []
        for _ in range(2):
            metrics.append(train.rl_step(run))
            run.step += 1  # as run_training counts steps
    finally:
        run.logger.close()
        run.rewards.close()
    assert all(torch.equal(weights[k], v) for k, v in run.model.state_dict().items())
    assert not run.optimizer.state and run.scheduler.state_dict() == sched  # AdamW never stepped
    assert all("rollout/reward_mean" in m and not any(k.startswith("train/") for k in m) for m in metrics)
    back = dump.read(str(tmp_path / "rollouts" / "step_000002.jsonl"))
    assert len(back) == 16 and all(r["tokens"]["advantage"] is None and r["tokens"]["trainer_logprob"] is None
                                   for r in back)
    assert all(len(r["tokens"]["rollout_logprob"]) == len(r["tokens"]["id"]) > 0 for r in back)


def test_routing_replay_run_logs_per_layer_disagreement(task, tmp_path):
    """One R3 step on a tiny random MoE (no warm start: only the logging is checked): the per-layer
    routing/disagreement/layer_<i> are logged, one per MoE layer, and average to the overall share."""
    from nanorl import moe_replay, task as builtin
    tok = builtin.build_tokenizer()
    model = moe_replay.tiny_moe("qwen3_moe", seed=0, vocab_size=len(tok), pad_token_id=0, eos_token_id=1)
    model.save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    res = train.main(args(task, tmp_path / "run", "--model", str(tmp_path / "moe"), "--routing-replay",
                          "--steps", "1", "--max-new-tokens", "4"))
    last = res["last"]
    layers = sorted(k for k in last if k.startswith("routing/disagreement/layer_"))
    assert layers == [f"routing/disagreement/layer_{i}" for i in range(model.config.num_hidden_layers)]
    assert sum(last[k] for k in layers) / len(layers) == pytest.approx(last["routing/disagreement"])


def test_flags_are_validated():
    from nanorl.config import Config
    with pytest.raises(ValueError, match="dump_rollouts must be >= 0"):
        Config.from_flags(dump_rollouts=-1)
    with pytest.raises(ValueError, match="dump_rollouts_mb must be > 0"):
        Config.from_flags(dump_rollouts_mb=0)
    with pytest.raises(ValueError, match="debug_rollout_only makes no update"):
        Config.from_flags(debug_rollout_only=True, async_steps=1)
