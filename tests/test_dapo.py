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
    assert cfg.filter_groups and cfg.max_gen_batches == 10 and cfg.drop_truncated
    assert (cfg.overlong_buffer, cfg.overlong_penalty, cfg.kl_coef) == (0.2, 1.0, 0.0)
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
