"""The plug-in points (nanorl/plugins.py), each on toy inputs: --reward (with the Sample, log-only "_"
fields, in worker processes too), --reward-postprocess, --advantage fn, --policy-loss fn,
--log-metadata, --plugin; signature errors name the expected signature; and one short run of
train.py wiring all of them (also with --async-steps). DCPO, the worked example: tests/test_dcpo.py.

    python -m pytest tests/test_plugins.py -q
"""
import json
import math
import textwrap

import pytest
import torch

import train
from nanorl import plugins
from nanorl.advantage import compute_advantages
from nanorl.config import Config
from nanorl.losses import LossConfig, ppo_clip_loss, total_loss
from nanorl.metrics import metadata_metrics, with_metadata
from nanorl.plugins import Hooks
from nanorl.rewards import RewardRunner, score_samples
from nanorl.trajectory import Sample, collate


def write(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


def sample(group=0, reward=None, **meta):
    return Sample(prompt_ids=[2], response_ids=[3, 4], group_id=group, reward=reward, metadata=dict(meta))


class _Tok:  # the two calls score_samples makes
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x" * len(i) for i in ids]


class _Prompt:
    text, label = "p", "l"


# ----------------------------------------------------------------------------- --reward
def _reward_with_sample(prompt, response, label, sample):
    return {"correct": float(sample.group_id == 1), "_toy/len": float(sample.response_length)}


@pytest.mark.parametrize("timeout", [0.0, 5.0], ids=["in-process", "workers"])
def test_reward_gets_the_sample_and_log_only_fields_go_to_metadata(timeout):
    runner = RewardRunner(_reward_with_sample, timeout=timeout, workers=1, log=lambda s: None)
    try:
        samples = [sample(0), sample(1)]
        out = score_samples(runner, _Tok(), [_Prompt(), _Prompt()], samples)
    finally:
        runner.close()
    assert out == [{"correct": 0.0}, {"correct": 1.0}]  # "_" keys are never part of the trained reward
    for s in samples:
        assert s.metadata["toy/len"] == 2.0 and s.log_only == ["toy/len"] and "logged" not in s.metadata
    s = samples[1]
    s.reward = out[1]
    assert s.total_reward == 1.0  # a log-only 2.0 would have made it 3.0
    assert metadata_metrics(samples, []) == {"toy/len": 2.0}  # log-only fields are logged unasked


def test_a_faulted_reward_fills_trained_fields_only():
    def flaky(prompt, response, label):
        if response == "xxx":
            raise RuntimeError("boom")
        return {"correct": 1.0, "_toy/conf": 0.5}
    runner = RewardRunner(flaky, log=lambda s: None)
    samples = [sample(), Sample(prompt_ids=[2], response_ids=[3, 4, 5])]
    assert score_samples(runner, _Tok(), [_Prompt(), _Prompt()], samples) == [{"correct": 1.0},
                                                                              {"correct": 0.0}]
    assert "toy/conf" not in samples[1].metadata and runner.faults == {"RuntimeError": 1}


def test_signature_errors_name_the_expected_signature(tmp_path):
    f = write(tmp_path, "bad.py", """
        def two(prompt, response): return 0.0
        def extra(prompt, response, label, foo): return 0.0
        def post(samples, k): pass
        def adv(*, mask, index, scores, foo): return mask, mask
        def loss(logp, old_logp, mask): return logp
        def loss_extra(logp, old_logp, advantages, mask, *, bar): return logp
        """)
    cases = [("reward", "two", r"fn\(prompt, response, label\) or fn\(prompt, response, label, sample\)"),
             ("reward", "extra", r"asks for foo"),
             ("reward_postprocess", "post", r"asks for k.*fn\(samples\)"),
             ("advantage", "adv", r"asks for foo, which nanorl does not give; expected fn\(\*, mask, index"),
             ("policy_loss", "loss", r"cannot be called as fn\(logp, old_logp, advantages, mask"),
             ("policy_loss", "loss_extra", r"asks for bar")]
    for field, fn, message in cases:
        with pytest.raises(TypeError, match=message):
            plugins.apply(Config.from_flags(**{field: f"{f}:{fn}"}))
    with pytest.raises(ValueError, match="reward_postprocess must be module:function"):
        Config.from_flags(reward_postprocess="nope")
    with pytest.raises(ValueError, match="remax is not supported"):
        Config.from_flags(reward_postprocess="tests.test_plugins:_post", advantage="remax")


# ----------------------------------------------------------------------------- --reward-postprocess
def _post(samples):
    for s in samples:
        s.metadata["toy/group_size"] = sum(t.group_id == s.group_id for t in samples)


def test_reward_postprocess_runs_on_the_batch_and_must_return_none():
    hooks = Hooks(Config.from_flags(reward_postprocess="tests.test_plugins:_post", log_metadata="toy/"))
    samples = [sample(0), sample(0), sample(1)]
    hooks.postprocess(samples)
    assert [s.metadata["toy/group_size"] for s in samples] == [2, 2, 1]
    hooks.postprocess_fn = lambda samples: samples
    with pytest.raises(TypeError, match="must edit the Samples in place and return None"):
        hooks.postprocess(samples)


# ----------------------------------------------------------------------------- --advantage
def _adv_from_metadata(*, mask, index, scores, metadata):
    a = torch.tensor([m["toy/a"] for m in metadata])  # [B]
    return a[:, None] * mask, scores[:, None] * mask


def test_user_advantage_reads_metadata_and_its_output_is_checked():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [B, T]
    kw = dict(mask=mask, index=torch.tensor([0, 0]), scores=torch.tensor([1.0, 0.0]))
    adv, ret = compute_advantages(_adv_from_metadata, **kw, metadata=[{"toy/a": 2.0}, {"toy/a": -1.0}])
    assert adv.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]] and ret.tolist() == [[1, 1, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="cannot use values"):  # an input it does not take is never dropped
        compute_advantages(_adv_from_metadata, **kw, metadata=[{}, {}], values=mask)

    def nan_masked(*, mask, index, scores):  # NaN where mask = 0 is zeroed; on a valid token it raises
        return torch.where(mask > 0, 1.0, math.nan), mask
    assert compute_advantages(nan_masked, **kw)[0].tolist() == [[1, 1, 0], [1, 0, 0]]
    with pytest.raises(ValueError, match="NaN/inf on valid"):
        compute_advantages(lambda *, mask, index, scores: (mask * math.nan, mask), **kw)
    with pytest.raises(ValueError, match="expected"):
        compute_advantages(lambda *, mask, index, scores: (mask[:, :2], mask), **kw)
    with pytest.raises(TypeError, match=r"must return \(advantages"):
        compute_advantages(lambda *, mask, index, scores: mask, **kw)


# ----------------------------------------------------------------------------- --policy-loss
def _my_ppo(logp, old_logp, advantages, mask, *, clip_low, clip_high, metadata):
    assert [m["row"] for m in metadata] == list(range(mask.shape[0]))
    return ppo_clip_loss(logp, old_logp, advantages, mask, clip_low, clip_high)


def test_user_policy_loss_equals_the_builtin_it_wraps():
    torch.manual_seed(0)
    logp = torch.randn(3, 4, requires_grad=True)
    old, adv, mask = torch.randn(3, 4), torch.randn(3,
                                                    4), torch.tensor([[1.0] * 4, [1, 1, 0, 0], [1, 0, 0, 0]])
    meta = [{"row": i} for i in range(3)]
    mine, m1 = total_loss(LossConfig(policy=_my_ppo, dual_clip=None), logp, old, adv, mask, metadata=meta)
    ref, m2 = total_loss(LossConfig(policy="ppo", dual_clip=None), logp, old, adv, mask)
    assert torch.allclose(mine, ref) and torch.allclose(m1["pg_clipfrac"], m2["pg_clipfrac"])
    g1, = torch.autograd.grad(mine, logp)
    g2, = torch.autograd.grad(ref, logp)
    assert torch.allclose(g1, g2)
    with pytest.raises(ValueError, match="`metadata` is for a user policy loss"):
        total_loss(LossConfig(policy="ppo"), logp, old, adv, mask, metadata=meta)
    with pytest.raises(TypeError, match=r"must return a loss \[B, T\]"):
        total_loss(LossConfig(policy=lambda lp, o, a, m: lp.sum()), logp, old, adv, mask)


# ----------------------------------------------------------------------------- --log-metadata, collate
def test_metadata_metrics_names_prefixes_and_nonfinite():
    samples = [sample(a=1.0, b=2, c="text", d=[1, 2], **{"x/p": 1.0, "x/q": math.nan}),
               sample(a=3.0, **{"x/p": 0.0, "y/r": 5.0})]
    assert metadata_metrics(samples, ["a", "x/"]) == {"a": 2.0, "x/p": 0.5, "x/q/nonfinite": 1}
    assert metadata_metrics(samples, ["b", "c", "d"]) == {"b": 2.0}  # only numbers are averaged
    patterns = Hooks(Config.from_flags(log_metadata="a")).log_metadata
    with pytest.raises(ValueError, match="also metric names of the step"):
        with_metadata({"a": 0.0}, samples, patterns)


def _rank_metrics(rank, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:  # rank 0 has x/a = 1 only; rank 1 has x/a = 3, 5 and x/b (which rank 0 never saw)
        rows = [{"x/a": 1.0}] if rank == 0 else [{"x/a": 3.0}, {"x/a": 5.0, "x/b": 2.0}]
        patterns = Hooks(Config.from_flags(log_metadata="x/")).log_metadata
        m = with_metadata({}, [sample(**r) for r in rows], patterns)
        (out_dir / f"{rank}.json").write_text(json.dumps(m))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_metadata_metrics_are_pooled_over_ranks(tmp_path):
    torch.multiprocessing.spawn(_rank_metrics, args=(str(tmp_path / "init"), tmp_path), nprocs=2)
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1] == {"x/a": 3.0, "x/b": 2.0}  # the same keys on every rank: the all-reduce aligns


def test_collate_carries_metadata_row_by_row():
    batch = collate([sample(row=0), sample(row=1), sample(row=2)], pad_id=0)
    assert [m["row"] for m in batch.metadata] == [0, 1, 2]
    assert [m["row"] for m in batch.select([2, 0]).metadata] == [2, 0]


# ----------------------------------------------------------------------------- --plugin
PLUGIN = """
    import torch
    LOG_METADATA = "toy/"
    CONFIG = {"temperature": 0.9}

    def reward(prompt, response, label, sample):
        return {"correct": float(response.strip() == label),
                "_toy/response_len": float(sample.response_length)}

    def reward_postprocess(samples):
        for s in samples:
            s.metadata["toy/postprocessed"] = 1.0

    def advantage(*, mask, index, scores, metadata):
        for m in metadata:
            m["toy/advantage_saw_postprocess"] = m["toy/postprocessed"]
        mean = torch.zeros(int(index.max()) + 1).index_add_(0, index, scores) / torch.bincount(index)
        return (scores - mean[index])[:, None] * mask, scores[:, None] * mask

    def policy_loss(logp, old_logp, advantages, mask, *, metadata):
        for m in metadata:
            m["toy/loss_calls"] = m.get("toy/loss_calls", 0) + 1
        # a stat of its own: logged as train/positive_adv
        return -advantages * torch.exp(logp - old_logp), {"positive_adv": (advantages > 0).float()}
    """


def test_plugin_fills_flags_left_at_defaults(tmp_path):
    f = write(tmp_path, "toy.py", PLUGIN)
    cfg = plugins.apply(Config.from_flags(plugin=f))
    assert (cfg.reward, cfg.advantage, cfg.policy_loss, cfg.log_metadata) == (
        f"{f}:reward", f"{f}:advantage", f"{f}:policy_loss", "toy/")
    assert cfg.sampling.temperature == 0.9  # CONFIG: any other field
    assert cfg.advantage_fn is plugins.load_object(f"{f}:advantage", "advantage")  # imported once
    with pytest.raises(ValueError, match="already 'rloo'"):  # a preset's value and the plugin's disagree
        plugins.apply(Config.from_flags(plugin=f, advantage="rloo"))
    bad = write(tmp_path, "bad_plugin.py", "CONFIG = {'no_such_field': 1}\n")
    with pytest.raises(ValueError, match="not a Config field"):
        plugins.apply(Config.from_flags(plugin=bad))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


@pytest.mark.parametrize("extra", [[], ["--async-steps", "1"]], ids=["sync", "async"])
def test_train_runs_every_plug_in_point(task_dir, tmp_path, extra):
    f = write(tmp_path, "toy.py", PLUGIN)
    train.main(["--plugin", f, "--model", task_dir["model"], "--train-data", task_dir["train"],
                "--test-data", task_dir["test"], "--out-dir", str(tmp_path / "run"), "--steps", "2",
                "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit",
                "4",
                "--pass-k", "2", "--quiet", "--threads", "1", *extra])
    steps = [x for x in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "toy/postprocessed" in x]
    assert len(steps) == 2
    for m in steps:  # each plug-in ran, in the chain's order, and its metadata was logged by name
        assert m["toy/postprocessed"] == m["toy/advantage_saw_postprocess"] == 1.0
        assert m["toy/loss_calls"] == 1.0 and 1.0 <= m["toy/response_len"] <= 4.0
        assert 0.0 <= m["train/positive_adv"] <= 1.0


def _loss_with_stats(logp, old_logp, advantages, mask):
    loss, stats = ppo_clip_loss(logp, old_logp, advantages, mask, 0.2, 0.2)
    stats.update(positive=(advantages > 0).float(), ratio_gap_max=(logp - old_logp).detach().abs(), scale=3.0)
    return loss, stats


def test_a_user_losss_own_stats_are_logged_by_name():
    """Every key beyond the clip masks: a [B, T] value as its masked token mean (the max for *_max),
    a number as itself; over several micro-batches, update.accumulate weights them by tokens."""
    torch.manual_seed(0)
    logp, old = torch.randn(3, 4), torch.randn(3, 4)
    adv = torch.tensor([[1.0, -1, 1, 1], [-1, -1, 5, 5], [2, 9, 9, 9]])
    mask = torch.tensor([[1.0] * 4, [1, 1, 0, 0], [1, 0, 0, 0]])
    _, m = total_loss(LossConfig(policy=_loss_with_stats, dual_clip=None), logp, old, adv, mask)
    assert m["positive"].item() == pytest.approx(4 / 7)  # 3 of row 0's, none of row 1's, row 2's one
    gap = (logp - old).abs()[mask.bool()].max()
    assert m["ratio_gap_max"].item() == pytest.approx(gap.item()) and m["scale"].item() == 3.0
    clash = lambda lp, o, a, mk: (lp * mk, {"entropy": mk})  # noqa: E731
    with pytest.raises(ValueError, match=r"returns stats \['entropy'\], which are metric names"):
        total_loss(LossConfig(policy=clash), logp, old, adv, mask)
    wrong = lambda lp, o, a, mk: (lp * mk, {"row": mk[:, 0]})  # noqa: E731
    with pytest.raises(TypeError, match=r"stat 'row' must be a number or \[B, T\]"):
        total_loss(LossConfig(policy=wrong), logp, old, adv, mask)
