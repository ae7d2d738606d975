"""Reward components beside --reward (nanorl/rounds.py score, with_components; nanorl/build.py
make_scorers): a judge's and a reward model's scores join the rule reward as named components,
weighed by --reward-weights in Sample.total_reward, each logged as it was scored; a failed judge
call makes its sample a reward_fault, which leaves the step, and the run goes on.

The judge is a real HTTP server on 127.0.0.1 speaking vLLM's OpenAI chat-completions shape
(tests/test_judges.py JudgeServer), the run the real train.main.
"""
import json
import re

import pytest
from test_judges import JudgeServer

import train
from nanorl.rounds import with_components
from nanorl.trajectory import Sample


def test_components_statuses_and_weights():
    samples = [Sample([1], [2]), Sample([1], [3]), Sample([1], [4], status="aborted")]
    rewards = [1.0, {"a": 0.5, "b": 0.25}, 0.0]
    out = with_components(rewards, {"judge": [0.75, None, None]}, samples, {"judge": 2.0})
    assert out == [{"correct": 1.0, "judge": 0.75}, {"a": 0.5, "b": 0.25, "judge": 0.0},
                   {"correct": 0.0, "judge": 0.0}]
    # a failed judge call: reward_fault (leaves the step); an already failed sample keeps its status
    assert [s.status for s in samples] == ["completed", "reward_fault", "aborted"]
    for s, r in zip(samples, out):
        s.reward = r
    assert samples[0].total_reward == 1.0 + 2.0 * 0.75  # the weight applies in the total only
    with pytest.raises(ValueError, match="names \\['rm'\\], not components"):
        with_components([1.0], {"judge": [0.5]}, [Sample([1], [2])], {"rm": 1.0})


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--out-dir", str(out), "--prompts-per-step", "4", "--samples-per-prompt", "4",
            "--eval-every", "0", "--eval-limit", "4", "--threads", "1", "--quiet", "--kl-coef", "0", *extra]


def test_a_run_judged_through_an_endpoint_that_dies_mid_run(task, tmp_path, monkeypatch, capsys):
    """Steps 1-2 judged (score 7/10 when the response holds the label, else 2/10); the server stops
    before step 3: step 3's samples are all reward faults, counted and logged once, and the run ends
    normally. --reward-weights correct=0 trains on the judge alone. Resumed for a 4th step (the server
    still down), the fault totals go on from the checkpoint's (red when they are not saved: 16, not
    32)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    per_step = 16

    def grade(body, n):
        text = body["messages"][0]["content"]
        response, label = text.split("Response: ", 1)[1].split("\nLabel: ")
        return 200, "7" if label.strip() and label.strip() in response else "2"

    server = JudgeServer(grade)
    real_rl_step = train.rl_step

    def rl_step(run):
        if run.step == 2:  # as a killed `vllm serve`: nothing listens any more
            server.stop()
        return real_rl_step(run)

    monkeypatch.setattr(train, "rl_step", rl_step)
    template = "Grade 0-10.\nQuestion: {prompt}\nResponse: {response}\nLabel: {label}"
    try:
        judged = ["--judge", template, "--judge-url", server.url, "--judge-model", "judge",
                  "--reward-weights", "correct=0", "--judge-concurrency", "2", "--judge-timeout", "5",
                  "--judge-retries", "1"]
        res = train.main(args(task, tmp_path, "--steps", "3", *judged))
    finally:
        server.stop()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "rollout/dropped_frac" in line]
    assert len(rows) == 3 and res["step"] == 3
    # every sample of steps 1-2 was judged, none of step 3; and the 4 greedy eval responses at step 0
    assert len(server.requests) == 4 + 2 * per_step
    first = res["before"]  # eval logs the judge's component as a step does (0.7 or 0.2 each)
    assert 0.2 <= first["eval/test/reward/judge"] <= 0.7 and first["eval/test/reward/correct"] >= 0
    assert first["eval/test/reward_mean"] == pytest.approx(first["eval/test/reward/judge"])  # correct=0
    for r in rows[:2]:
        assert r["rollout/dropped_frac"] == 0.0
        # each sample 0.2 or 0.7: the mean is (0.7 − 0.5·k/16) for k samples graded 2
        k = (0.7 - r["rollout/reward/judge"]) / 0.5 * per_step
        assert abs(k - round(k)) < 1e-4 and 0 <= round(k) <= per_step
        # correct weighs 0: the reward the advantage reads is the judge's alone
        assert r["rollout/reward_mean"] == pytest.approx(r["rollout/reward/judge"])
    assert rows[2]["rollout/dropped_frac"] == 1.0 and rows[2]["rollout/dropped/reward_fault"] == per_step
    assert rows[2]["rollout/reward_faults/judge/unreachable"] == per_step
    # one clear line per call, not one per sample: step 3's, then the final eval's (its 4 greedy samples)
    assert capsys.readouterr().out.count("unreachable") == 2
    train.main(args(task, tmp_path, "--steps", "4", *judged, "--resume", "latest"))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "rollout/dropped_frac" in line]
    last = rows[-1]
    # the run totals count eval's failed calls too: run 1's step 3 and final eval, the resumed run's
    # step-3 eval and step 4 (red when they are not saved: 4 + 16)
    assert last["rollout/reward_faults/judge/unreachable"] == 2 * per_step + 2 * 4


def test_an_in_process_judge_runs_in_the_step(task, tmp_path, monkeypatch):
    """Without --judge-url the judge model is loaded in-process (an HF engine, greedy): here the task's
    own tiny model judges "{prompt}{response}=" — it answers with digits, a number on the 0-99 scale.
    With this seed every one of the step's 16 samples is judged (red when the judge calls fail: each
    would be a counted reward fault, dropped): no faults, and the logged `judge` component is the
    mean of the judge's own answers / 99, added to `correct` in the reward; the run finishes."""
    from nanorl import judges
    answers, real_ask = [], judges._InProcess.ask

    def ask(self, texts):  # what the in-process judge model answered, as the scorer got it
        out = real_ask(self, texts)
        answers.extend(out)
        return out

    monkeypatch.setattr(judges._InProcess, "ask", ask)
    res = train.main(args(task, tmp_path, "--steps", "1", "--judge", "{prompt}{response}=", "--judge-model",
                          task["model"], "--judge-parse", "number:0:99"))
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "rollout/dropped_frac" in line][0]
    faults = sum(v for k, v in row.items() if k.startswith("rollout/reward_faults/judge/"))
    assert res["step"] == 1
    # one answer per sample: the 4 greedy eval responses before and after, the step's 16 between
    assert len(answers) == 4 + 16 + 4 and all(isinstance(a, str) for a in answers)
    answers = answers[4:20]
    assert faults == 0 and row["rollout/dropped_frac"] == 0.0  # every call succeeded, nothing dropped
    scores = [float(re.search(r"-?\d+(?:\.\d+)?", a).group()) / 99 for a in answers]
    assert all(0.0 <= x <= 1.0 for x in scores)
    assert row["rollout/reward/judge"] == pytest.approx(sum(scores) / 16, rel=1e-5)
    total = row["rollout/reward/correct"] + row["rollout/reward/judge"]  # default weights: 1 each
    assert row["rollout/reward_mean"] == pytest.approx(total, rel=1e-5)


def tiny_rm(path) -> None:
    """A tiny random sequence classifier over the built-in task's tokenizer, saved at `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from nanorl.task import build_tokenizer
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                      pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def test_a_reward_model_scores_the_step_batched(task, tmp_path, monkeypatch):
    """--reward-model: the RM's score of every sample is the component `rm`, computed in one batched
    call over the step's samples (what RewardModel.score gives for them); --reward-weights correct=0
    trains on it alone, while eval/accuracy still checks the labels with --reward."""
    from nanorl import reward_models
    tiny_rm(tmp_path / "rm")
    calls, real_score = [], reward_models.RewardModel.score

    def score(self, prompts, responses):
        out = real_score(self, prompts, responses)
        calls.append((list(prompts), list(responses), out))
        return out

    monkeypatch.setattr(reward_models.RewardModel, "score", score)
    res = train.main(args(task, tmp_path / "run", "--steps", "2", "--reward-model", str(tmp_path / "rm"),
                          "--reward-weights", "correct=0,rm=1"))
    # one call per step, all 16 samples; one per eval (before, after) on its 4 greedy responses
    assert [len(c[0]) for c in calls] == [4, 16, 16, 4]
    for eval_row, (_, _, out) in ((res["before"], calls[0]), (res["after"], calls[3])):
        assert eval_row["eval/test/reward/rm"] == pytest.approx(sum(out) / 4, rel=1e-5)
    calls = calls[1:3]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
            if "rollout/reward/rm" in line]
    assert len(rows) == 2  # both steps logged the component (zip below would pass on none)
    for row, (_, _, out) in zip(rows, calls):
        assert row["rollout/reward/rm"] == pytest.approx(sum(out) / 16, rel=1e-5)
        assert row["rollout/reward_mean"] == pytest.approx(row["rollout/reward/rm"], rel=1e-5)  # correct=0
        assert 0.0 <= row["rollout/reward/correct"] <= 1.0  # the rule reward, still logged
    assert 0.0 <= res["after"]["eval/accuracy"] <= 1.0  # eval checks labels with --reward (exact)


# ----------------------------------------------------------------------------- in the async rollout worker
@pytest.mark.slow
def test_the_async_worker_judges_its_batches_and_the_trainer_counts_the_faults(task, tmp_path, monkeypatch):
    """--async-steps 1 --judge: the rollout worker (its own process) judges every sample of its batches
    as the synchronous step does — batch 0's 16 samples judged, logged as the component `judge` — and
    from request 17 on the judge answers 400 (not retried): batches 1-2 are reward faults, dropped, and
    the worker's fault counts reach the trainer's run totals (rollout/reward_faults/judge/..., which a
    checkpoint saves). The held-out sets are judged too, by the trainer's own judge (the server answers
    them always, before and after: 2 x 4 requests; red when eval drops the judge's component). Red
    before: --judge with --async-steps was refused."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    held_out = {json.loads(line)["prompt"] for line in open(task["test"])}
    train_calls = []

    def grade(body, n):
        text = body["messages"][0]["content"]
        question = text.split("Question: ", 1)[1].split("\nResponse: ")[0]
        if question not in held_out:  # the worker's calls (eval's run beside them, in any order)
            train_calls.append(n)
            if len(train_calls) > 16:
                return 400, "the judge refuses"
        response, label = text.split("Response: ", 1)[1].split("\nLabel: ")
        return 200, "7" if label.strip() and label.strip() in response else "2"

    server = JudgeServer(grade)
    template = "Grade 0-10.\nQuestion: {prompt}\nResponse: {response}\nLabel: {label}"
    try:
        res = train.main(args(task, tmp_path, "--steps", "3", "--async-steps", "1", "--judge", template,
                              "--judge-url", server.url, "--judge-model", "judge", "--judge-retries", "0",
                              "--reward-weights", "correct=0"))
    finally:
        server.stop()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "rollout/dropped_frac" in line]
    assert res["step"] == 3 and len(rows) == 3 and len(train_calls) == 3 * 16
    assert len(server.requests) == 3 * 16 + 2 * 4
    for when in ("before", "after"):  # judged, not faulted: each sample 0.7 or 0.2
        k = (0.7 - res[when]["eval/test/reward/judge"]) / 0.5 * 4
        assert abs(k - round(k)) < 1e-4, res[when]
    k = (0.7 - rows[0]["rollout/reward/judge"]) / 0.5 * 16  # each sample 0.7 or 0.2
    assert rows[0]["rollout/dropped_frac"] == 0.0 and abs(k - round(k)) < 1e-4
    assert rows[0]["rollout/reward_mean"] == pytest.approx(rows[0]["rollout/reward/judge"])  # correct=0
    assert [r["rollout/dropped_frac"] for r in rows[1:]] == [1.0, 1.0]
    faults = [sum(v for key, v in r.items() if key.startswith("rollout/reward_faults/judge/")) for r in rows]
    assert faults == [0, 16, 32], faults


@pytest.mark.slow
def test_the_async_worker_scores_with_the_reward_model(task, tmp_path):
    """--async-steps 1 --reward-model: the worker loads the RM beside its engine and every batch carries
    the component `rm` (--reward-weights correct=0,rm=1: the reward the advantage reads is the RM's)."""
    tiny_rm(tmp_path / "rm")
    res = train.main(args(task, tmp_path / "run", "--steps", "2", "--async-steps", "1", "--reward-model",
                          str(tmp_path / "rm"), "--reward-weights", "correct=0,rm=1"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
            if "rollout/reward/rm" in line]
    assert res["step"] == 2 and len(rows) == 2
    # the held-out set is scored by the trainer's own copy of the reward model, as a step's samples
    after = res["after"]
    assert after["eval/test/reward/rm"] != 0.0
    assert after["eval/test/reward_mean"] == pytest.approx(after["eval/test/reward/rm"], rel=1e-5)
    for row in rows:
        assert row["rollout/reward_mean"] == pytest.approx(row["rollout/reward/rm"], rel=1e-5)
        assert row["rollout/reward/rm"] != 0.0 and 0.0 <= row["rollout/reward/correct"] <= 1.0


@pytest.mark.slow
def test_an_async_reward_model_run_resumes_mid_flight_as_the_uninterrupted_run(task, tmp_path):
    """--async-steps 1 --reward-model, 4 steps, and the same run resumed from its step-2 checkpoint (batch
    2, sampled and scored by the worker from version 1, comes from pipeline.pt): steps 3-4 log the same
    metrics, the reward model's component included, and the same final eval."""
    tiny_rm(tmp_path / "rm")
    extra = ("--steps", "4", "--async-steps", "1", "--save-every", "2", "--keep-checkpoints", "3",
             "--reward-model", str(tmp_path / "rm"), "--reward-weights", "correct=1,rm=0.5")
    a = train.main(args(task, tmp_path / "a", *extra))
    b = train.main(args(task, tmp_path / "b", *extra, "--resume",
                        str(tmp_path / "a" / "checkpoints" / "step_000002")))

    def steps(out):
        rows = [json.loads(x) for x in open(out / "metrics.jsonl") if "train/loss" in x]
        return [{k: v for k, v in r.items() if not k.startswith(("perf/", "time/"))
                 and not k.endswith("_s")} for r in rows]
    la, lb = steps(tmp_path / "a"), steps(tmp_path / "b")
    assert [r["step"] for r in lb] == [3, 4] and "rollout/reward/rm" in lb[0]
    assert la[2:] == lb
    def evals(res):
        return {k: v for k, v in res["after"].items() if not k.startswith("perf/")}
    assert evals(a) == evals(b) and "eval/test/reward/rm" in b["after"]


@pytest.mark.parametrize("K", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_partial_rollouts_are_scored_by_the_reward_model(task, tmp_path, K):
    """--partial-rollout abort --over-sample 2 with --reward-model, synchronous (K = 0: sources.Partial)
    and in the async worker (K = 1): every batch, the groups resumed from the buffer included, carries
    the reward model's component, and with --reward-weights correct=0,rm=1 the reward the advantage reads
    is the RM's (red when the aborting rollout scores by --reward alone, as it did)."""
    tiny_rm(tmp_path / "rm")
    res = train.main(args(task, tmp_path / "run", "--steps", "4", "--async-steps", str(K),
                          "--partial-rollout", "abort", "--over-sample", "2", "--reward-model",
                          str(tmp_path / "rm"), "--reward-weights", "correct=0,rm=1"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "train/loss" in line]
    assert res["step"] == 4 and len(rows) == 4
    assert sum(r["rollout/async/resumed_groups"] for r in rows) > 0  # the buffer was resumed
    for row in rows:
        assert row["rollout/reward/rm"] != 0.0
        assert row["rollout/reward_mean"] == pytest.approx(row["rollout/reward/rm"], rel=1e-5)
