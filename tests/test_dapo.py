"""DAPO's data-side pieces (nanorl/dapo.py) and the trainer's dynamic sampling (refill_groups in
nanorl/stages.py).

The overlong penalty against the paper's formula on hand values; the refill loop with a scripted
generator; and a real run on the built-in task whose reward gives most groups zero variance, which
must still train on a full batch of groups with signal.

Run: python -m pytest tests/test_dapo.py -q
"""
import json

import pytest
import torch

import train
from nanorl.config import parse_args
from nanorl.dapo import buffer_tokens, dynamic_sampling, overlong_penalty, truncated_loss_mask
from nanorl.trajectory import Sample


def test_soft_overlong_punishment_matches_the_paper_by_hand():
    """Yu et al. 2025, eq. (13): 0 for |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|)/L_cache inside."""
    L_max, L_cache = 20, 5
    lengths = [3, 15, 16, 18, 20]
    hand = [0.0 if n <= L_max - L_cache else ((L_max - L_cache) - n) / L_cache for n in lengths]
    got = overlong_penalty(torch.tensor(lengths), L_max, L_cache)
    assert torch.allclose(got, torch.tensor(hand)) and hand[-1] == -1.0
    assert torch.allclose(overlong_penalty(torch.tensor(lengths), L_max, L_cache, factor=0.5),
                          0.5 * torch.tensor(hand))
    assert buffer_tokens(0.2, 20480) == 4096 and buffer_tokens(0.2, 4) == 1  # the paper's share; ≥ 1 token
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 4, 0)


def _round(rewards, n=2):
    return [Sample([1], [2], reward=float(r), group_id=i // n) for i, r in enumerate(rewards)]


def test_dynamic_sampling_refills_to_exactly_the_target():
    rounds = iter([_round([0, 0, 1, 1, 0, 1]), _round([1, 1, 0, 0, 0, 0]), _round([1, 0, 0, 1, 1, 1])])
    calls = []

    def draw(generate):
        calls.append(generate)
        return next(rounds)
    kept, n, generated, gave_up = dynamic_sampling(draw, target=3, max_rounds=5)
    # round 1 gives group 2, round 2 none, round 3 groups 0 and 1: then it stops, cut to 3
    assert (n, generated, gave_up) == (3, 9, False) and calls == [True, True, True]
    assert [s.total_reward for s in kept] == [0, 1, 1, 0, 0, 1]
    assert [s.group_id for s in kept] == [0, 0, 1, 1, 2, 2]


def test_dynamic_sampling_gives_up_after_max_rounds_and_keeps_ranks_in_step():
    draws = []

    def draw(generate):
        draws.append(generate)
        return _round([0, 0, 0, 1]) if generate else []
    # another rank is still short: this one keeps advancing its prompts without generating
    kept, n, _, gave_up = dynamic_sampling(draw, target=1, max_rounds=3, any_short=lambda short: True)
    assert n == 3 and not gave_up and len(kept) == 2 and draws == [True, False, False]
    kept, n, _, gave_up = dynamic_sampling(lambda g: _round([1, 1]), target=2, max_rounds=4)
    assert kept == [] and n == 4 and gave_up


def test_truncated_rows_leave_the_loss_mask():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = truncated_loss_mask(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]


def test_dapo_preset_is_the_papers_recipe():
    cfg = parse_args(["--algo", "dapo"])
    assert (cfg.advantage, cfg.clip_low, cfg.clip_high, cfg.loss_agg) == ("grpo", 0.2, 0.28, "token-mean")
    assert cfg.dapo.filter_groups and cfg.dapo.max_gen_batches == 10 and cfg.dapo.drop_truncated
    assert (cfg.dapo.overlong_buffer, cfg.dapo.overlong_penalty, cfg.kl_coef) == (0.2, 1.0, 0.0)
    with pytest.raises(ValueError, match="max_gen_batches needs filter_groups"):
        parse_args(["--max-gen-batches", "3"])
    with pytest.raises(ValueError, match="overlong_penalty needs overlong_buffer"):
        parse_args(["--overlong-penalty", "0.5"])


SPARSE = '''
from nanorl.rewards import exact


def reward(prompt, response, label):
    """The exact reward on the prompts whose answer ends in 0 or 5 (a fifth of them), else 0: most
    groups have all-equal rewards."""
    return exact(prompt, response, label) if label[-1] in "05" else 0.0
'''


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def test_refill_trains_a_full_batch_when_most_groups_have_no_variance(task_dir, tmp_path, monkeypatch):
    (tmp_path / "sparse.py").write_text(SPARSE)
    seen = []
    real = train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real(run, batch))
    common = ["--model", task_dir["model"], "--train-data", task_dir["train"], "--test-data",
              task_dir["test"],
              "--algo", "dapo", "--prompts-per-step", "2", "--samples-per-prompt", "8", "--eval-limit", "2",
              "--eval-every", "0", "--pass-k", "1", "--quiet", "--threads", "1", "--max-new-tokens", "4",
              "--reward", f"{tmp_path / 'sparse.py'}:reward"]
    res = train.main([*common, "--steps", "2", "--max-gen-batches", "30", "--out-dir", str(tmp_path / "a")])
    lines = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    rounds = [x["rollout/dapo/gen_rounds"] for x in lines if "rollout/dapo/gen_rounds" in x]
    assert len(seen) == 2 and max(rounds) > 1 and res["counters"].get("dapo_gave_up", 0) == 0
    for batch in seen:  # a full batch: 2 groups of 8, every group with reward variance
        assert batch.group_ids.tolist() == [0] * 8 + [1] * 8
        for g in (0, 1):
            assert batch.rewards[batch.group_ids == g].unique().numel() > 1
        # overlong filtering: truncated rows carry no loss; soft punishment: a 4-token answer (the
        # budget, buffer round(0.2·4) = 1 token) lost 1 and the raw reward is at most 1
        assert batch.response_mask[batch.truncated].sum() == 0
        at_budget = batch.response_lens == 4
        assert (batch.rewards[at_budget] <= 0.0).all() and (batch.rewards[~at_budget] >= 0.0).all()
    # out of rounds: it trains on what it found, and says so
    seen.clear()
    res = train.main([*common, "--steps", "1", "--max-gen-batches", "1", "--seed", "3",
                      "--out-dir", str(tmp_path / "b")])
    assert res["counters"]["dapo_gave_up"] == 1


HALF = '''
from nanorl.rewards import exact


def reward(prompt, response, label):
    """The exact reward on the prompts whose answer is even (about half of them), else 0."""
    return exact(prompt, response, label) if int(label) % 2 == 0 else 0.0
'''


def assert_full(batches, groups=2, n=8) -> None:
    """Every trained batch is full: `groups` whole groups of n samples, each with reward variance."""
    for batch in batches:
        assert batch.group_ids.tolist() == [g for g in range(groups) for _ in range(n)]
        for g in range(groups):
            assert batch.rewards[batch.group_ids == g].unique().numel() > 1


def test_until_aborts_the_running_requests_and_changes_nothing_before(task_dir):
    """HFEngine.generate(until=...): a callback that never says stop changes no sample (tokens,
    logprobs, statuses: the same random stream); one that stops at the first finished groups leaves
    those groups whole and every other request "aborted", its tokens a prefix of the full run's; the
    engine's row chunks hold whole groups (red check: chunks of max_batch rows split a group)."""
    from nanorl.policy import load_model
    from nanorl.rollout import HFEngine, SamplingConfig
    from nanorl.task import problems
    model, tok = load_model(task_dir["model"], "cpu", torch.float32)
    engine = HFEngine(model, pad_id=tok.pad_token_id)
    prompts = [tok(x["prompt"])["input_ids"] for x in problems()[0][:8]]
    sp = SamplingConfig(max_new_tokens=8, stop_token_ids=(tok.eos_token_id,), seed=3)
    full = engine.generate(prompts, 4, sp)
    seen = []
    same = engine.generate(prompts, 4, sp, until=lambda done: seen.append(done) and False)
    key = [(s.response_ids, s.rollout_logprobs, s.status) for s in full]
    assert [(s.response_ids, s.rollout_logprobs, s.status) for s in same] == key and seen
    first = []
    cut = engine.generate(prompts, 4, sp, until=lambda done: first.extend(done) or True)
    assert first and all(any(s is f for f in first) for s in cut if s.status != "aborted")
    assert {s.group_id for s in first} == {s.group_id for s in cut if s.status != "aborted"}
    assert any(s.status == "aborted" for s in cut)
    for s, f in zip(cut, full):
        assert f.response_ids[:s.response_length] == s.response_ids
        if s.status != "aborted":
            assert s.response_ids == f.response_ids
    # chunks of max_batch rows hold whole groups when `until` is given (10 rows, n = 4: two groups)
    engine.max_batch, chunks, real = 10, [], engine._generate_rows
    engine._generate_rows = lambda rows, *a: chunks.append([g for g, _ in rows]) or real(rows, *a)
    engine.generate(prompts, 4, sp, until=lambda done: False)
    assert len(chunks) == 4 and all(len(c) == 8 and all(c.count(g) == 4 for g in c) for c in chunks)


def test_over_sample_fills_the_batch_in_one_round(task_dir, tmp_path, monkeypatch):
    """DAPO with a reward that only half the prompts can earn: the refill takes several rounds for
    some step; --over-sample 4 fills every step in one round (2 groups with variance of 8 started),
    aborting the rest (aborted tokens logged), and no aborted sample reaches the update. Red check:
    `until` ignored by the stage (never aborting) leaves dapo/aborted_tokens 0 and fails."""
    (tmp_path / "half.py").write_text(HALF)
    seen = []
    real = train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real(run, batch))
    common = ["--model", task_dir["model"], "--train-data", task_dir["train"], "--test-data",
              task_dir["test"], "--algo", "dapo", "--prompts-per-step", "2", "--samples-per-prompt", "8",
              "--eval-limit", "2", "--eval-every", "0", "--pass-k", "1", "--quiet", "--threads", "1",
              "--max-new-tokens", "4", "--reward", f"{tmp_path / 'half.py'}:reward", "--steps", "4"]

    def logged(out, key):
        return [x[key] for x in map(json.loads, open(out / "metrics.jsonl")) if key in x]
    train.main([*common, "--out-dir", str(tmp_path / "refill")])
    assert max(logged(tmp_path / "refill", "rollout/dapo/gen_rounds")) > 1
    seen.clear()
    train.main([*common, "--over-sample", "4", "--out-dir", str(tmp_path / "over")])
    assert logged(tmp_path / "over", "rollout/dapo/gen_rounds") == [1] * 4
    assert logged(tmp_path / "over", "rollout/dapo/oversampled_groups") == [8] * 4
    assert sum(logged(tmp_path / "over", "rollout/dapo/aborted_tokens")) > 0
    assert len(seen) == 4
    assert_full(seen)


def test_over_sample_refuses_what_it_cannot_do():
    for argv, msg in ((["--over-sample", "2"], "over_sample needs filter_groups"),
                      (["--algo", "dapo", "--over-sample", "0"], "over_sample must be >= 1"),
                      (["--algo", "dapo", "--over-sample", "2", "--env", "calc", "--reward-timeout", "0",
                       "--max-new-tokens", "12"], "over_sample with --env")):
        with pytest.raises(ValueError, match=msg):
            parse_args(argv)
