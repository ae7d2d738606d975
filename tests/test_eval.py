"""Evaluation: several named eval sets with their own metrics, eval sampling separate from training's,
and evaluation sharded over ranks with the 1-rank greedy numbers (nanorl/evaluation.py)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import train
from nanorl.config import Config
from nanorl.data import Prompt
from nanorl.evaluation import EvalSampling, EvalSet, Scorer, _score_slice, evaluate, load_eval_sets, set_name
from nanorl.rewards import RewardRunner, exact
from nanorl.rollout import RolloutEngine, stop_token_ids
from nanorl.task import make_default
from nanorl.trajectory import Sample
from nanorl.weight_broadcast import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


class ScriptedEngine(RolloutEngine):
    """Answers prompt "i" with str(i) greedily when i is even, and records every SamplingConfig."""

    def __init__(self):
        self.calls = []
        self.generator = torch.Generator()

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n, sampling))
        out = []
        for g, ids in enumerate(prompts):
            i = ids[0]
            for j in range(n):  # greedy: right for even i; sampled: sample j == 0 right for every i
                right = (i % 2 == 0) if sampling.temperature == 0 else j == 0
                out.append(Sample(prompt_ids=ids, response_ids=[i if right else i + 1] + [0] * (i % 3),
                                  group_id=g))
        return out


class Tok:
    eos_token_id = 0

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [str(s[0]) for s in seqs]


def fake_run(sets, rank=0, world=1, **cfg):
    cfg = Config.from_flags(**{"pass_k": 3, "max_new_tokens": 4, **cfg})
    return SimpleNamespace(cfg=cfg, eval_sets=sets, engine=ScriptedEngine(), tokenizer=Tok(), rank=rank,
                           world=world,
                           rewards=RewardRunner(exact), model=torch.nn.Linear(1, 1))


def run_eval(run) -> dict:
    """evaluate on a fake run's objects, passed one by one (evaluation takes no Run)."""
    sampling = EvalSampling.from_config(run.cfg, stop_token_ids(run.model, run.tokenizer))
    return evaluate(run.eval_sets, run.engine, sampling, run.cfg.seed, rewards=run.rewards,
                    tokenizer=run.tokenizer, rank=run.rank, world=run.world)


def prompts(ids):
    return [Prompt(ids=[i], text=str(i), label=str(i)) for i in ids]


def test_metrics_per_set_and_pooled():
    run = fake_run([EvalSet("a", prompts([0, 1, 2, 3])), EvalSet("b", prompts([4, 6, 7]))])
    m = run_eval(run)
    assert m["eval/a/accuracy"] == 0.5 and m["eval/b/accuracy"] == pytest.approx(2 / 3)
    assert m["eval/accuracy"] == pytest.approx(4 / 7)  # pooled over the 7 prompts, not a mean of means
    assert m["eval/a/pass@3"] == m["eval/b/pass@3"] == m["eval/pass@3"] == 1.0
    assert m["eval/a/response_length_mean"] == pytest.approx((1 + 2 + 3 + 1) / 4)  # 1 + i % 3 tokens
    assert m["perf/time/eval"] >= 0


def test_eval_sampling_flags_are_its_own():
    run = fake_run([EvalSet("a", prompts([0, 1]))], eval_temperature=0.6, eval_max_new_tokens=32,
                   temperature=1.0)
    run_eval(run)
    (n0, k0, greedy), (n1, k1, sampled) = run.engine.calls
    assert (k0, greedy.temperature, greedy.max_new_tokens) == (1, 0.0, 32)
    assert (k1, sampled.temperature, sampled.max_new_tokens) == (3, 0.6, 32)
    run = fake_run([EvalSet("a", prompts([0]))], temperature=0.9)  # 0 = training's temperature and length
    run_eval(run)
    assert run.engine.calls[1][2].temperature == 0.9 and run.engine.calls[0][2].max_new_tokens == 4


def test_rank_slices_cover_each_set_once():
    sets = [EvalSet("a", prompts([0, 1, 2, 3, 4]))]
    seen = []
    for rank in range(2):
        run = fake_run(sets, rank=rank, world=2)
        run_eval(run)  # one process: the all-reduce is a no-op, so each call sees its own slice
        seen.append(run.engine.calls[0][0])
    assert seen == [3, 2]


def test_eval_set_names_and_loading(task, tmp_path):
    from nanorl.data import PromptFormat
    from nanorl.task import build_tokenizer
    assert (set_name("data/gsm8k_test.jsonl") == "gsm8k_test"
            and set_name("openai/gsm8k:main@test") == "gsm8k_main_test")
    assert set_name("HuggingFaceH4/MATH-500") == "MATH-500"
    tok = build_tokenizer()
    sets = load_eval_sets(f"held={task['test']},{task['test']}", tok, "prompt", "answer", 64, PromptFormat(),
                          limit=5)
    assert [s.name for s in sets] == ["held", "test"] and [len(s.prompts) for s in sets] == [5, 5]
    with pytest.raises(ValueError, match="two eval sets are named 'test'"):
        load_eval_sets(f"{task['test']},{task['test']}", tok, "prompt", "answer", 64, PromptFormat())


def second_set(task, tmp_path) -> str:
    """Another eval set in another layout: the built-in held-out sums as `question`/`answer`."""
    rows = [json.loads(x) for x in open(task["test"])][:12]
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n"
                            for r in rows))
    return str(path)


def run_args(task, out, sets, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", sets,
            "--input-key", "prompt,question", "--steps", "1", "--prompts-per-step", "4",
            "--samples-per-prompt", "2",
            "--eval-limit", "40", "--pass-k", "2", "--quiet", "--threads", "1", "--out-dir", str(out), *extra]


def first_eval(out) -> dict:
    return json.loads(open(os.path.join(out, "metrics.jsonl")).readline())  # step 0: before training


@pytest.mark.slow
def test_train_logs_every_set_and_shards_over_two_ranks(task, tmp_path):
    """train.py with two eval sets logs eval/<name>/...; over 2 ranks (gloo) every rank scores a slice
    and the step-0 greedy accuracies equal the 1-rank run's exactly (same weights, same prompts)."""
    sets = f"held={task['test']},sums={second_set(task, tmp_path)}"
    train.main(run_args(task, tmp_path / "one", sets))
    one = first_eval(tmp_path / "one")
    assert {"eval/held/accuracy", "eval/sums/accuracy", "eval/held/pass@2", "eval/sums/response_length_mean",
            "eval/accuracy"} <= set(one)
    assert 0 < one["eval/held/accuracy"] < 1  # the warm-started model: partly right
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()),
           "train.py", *run_args(task, tmp_path / "two", sets)]
    res = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    two = first_eval(tmp_path / "two")
    for key in ("eval/held/accuracy", "eval/sums/accuracy", "eval/accuracy",
                "eval/held/response_length_mean"):
        assert two[key] == one[key], key


# ----------------------------------------------------------------------------- what a step's rows log too
class TruncatingEngine(ScriptedEngine):
    """ScriptedEngine whose response to prompt i is cut at the length limit (no EOS) when i % 3 == 2."""

    def generate(self, prompts, n, sampling):
        out = super().generate(prompts, n, sampling)
        for s in out:
            if s.prompt_ids[0] % 3 == 2:
                s.status = "truncated"
        return out


class FakeJudge:
    """A scorer with make_scorers' call (nanorl/build.py): 0.1 × the response's number, None (a failed
    call) for the response "6"; records what it was asked."""

    def __init__(self):
        self.asked, self.faults = [], {}

    def score(self, prompts, responses, labels):
        self.asked.append(list(responses))
        return [None if r == "6" else 0.1 * int(r) for r in responses]


def tenths(prompt, response, label):
    """A reward with a log-only field: right = 1, else 0.1 × the response's number; `_digits` logged."""
    return {"correct": 1.0 if response == label else 0.1 * int(response), "_digits": float(len(response))}


def tagged(prompt, response, label, sample):
    """--reward reading the Sample: writes metadata["len_seen"], which --log-metadata names."""
    sample.metadata["len_seen"] = float(sample.response_length)
    return exact(prompt, response, label)


def test_eval_logs_reward_mean_and_truncated_frac():
    run = fake_run([EvalSet("a", prompts([0, 1, 2, 3, 4, 5]))])
    run.engine, run.rewards = TruncatingEngine(), RewardRunner(tenths)
    m = run_eval(run)
    # greedy: even i answers i (right: 1), odd i answers i + 1 (0.1 × (i + 1))
    rewards = [1.0, 0.2, 1.0, 0.4, 1.0, 0.6]
    assert m["eval/a/reward_mean"] == pytest.approx(sum(rewards) / 6)
    assert m["eval/a/truncated_frac"] == pytest.approx(2 / 6)  # prompts 2 and 5
    assert m["eval/a/reward/correct"] == pytest.approx(sum(rewards) / 6)  # the dict's component
    assert m["eval/a/digits"] == pytest.approx(1.0)  # the log-only field, every response one digit
    assert m["eval/a/accuracy"] == 0.5


def test_eval_logs_judge_components_beside_the_reward():
    run = fake_run([EvalSet("a", prompts([0, 1, 2, 3, 4]))])
    judge = FakeJudge()
    sampling = EvalSampling.from_config(run.cfg, stop_token_ids(run.model, run.tokenizer))
    m = evaluate(run.eval_sets, run.engine, sampling, 0, rewards=run.rewards, tokenizer=run.tokenizer,
                 scorers={"judge": judge}, reward_weights={"judge": 2.0})
    assert judge.asked == [["0", "2", "2", "4", "4"]]  # the greedy responses only, once
    judged = [0.0, 0.2, 0.2, 0.4, 0.4]
    assert m["eval/a/reward/judge"] == pytest.approx(sum(judged) / 5)
    assert m["eval/a/reward/correct"] == pytest.approx(3 / 5)
    assert m["eval/a/reward_mean"] == pytest.approx((3 + 2 * sum(judged)) / 5)  # the weights apply
    assert m["eval/a/accuracy"] == pytest.approx(3 / 5)  # --reward's verdict, the judge aside
    # a failed call (response "6") scores 0, as with_components records it; accuracy stays --reward's
    judge = FakeJudge()
    m = evaluate([EvalSet("b", prompts([4, 5]))], ScriptedEngine(), sampling, 0, rewards=run.rewards,
                 tokenizer=run.tokenizer, scorers={"judge": judge})
    assert m["eval/b/reward/judge"] == pytest.approx(0.4 / 2) and m["eval/b/accuracy"] == 0.5
    # a rank with no prompt of the set still calls the scorer (a sharded reward model's forwards)
    judge = FakeJudge()
    scorer = Scorer(ScriptedEngine(), run.rewards, run.tokenizer, None, {"judge": judge})
    counts, fields = _score_slice(scorer, sampling, [])
    assert judge.asked == [[]] and counts.sum() == 0 and fields == {}


def test_eval_logs_the_metadata_fields_a_step_logs():
    run = fake_run([EvalSet("a", prompts([0, 1, 2]))])
    run.rewards = RewardRunner(tagged)
    sampling = EvalSampling.from_config(run.cfg, stop_token_ids(run.model, run.tokenizer))
    m = evaluate(run.eval_sets, run.engine, sampling, 0, rewards=run.rewards, tokenizer=run.tokenizer,
                 log_metadata=["len_seen"])
    assert m["eval/a/len_seen"] == pytest.approx((1 + 2 + 3) / 3)  # the greedy responses' 1 + i % 3 tokens
    m = evaluate(run.eval_sets, run.engine, sampling, 0, rewards=run.rewards, tokenizer=run.tokenizer)
    assert "eval/a/len_seen" not in m  # not named, not logged (as in a step)
