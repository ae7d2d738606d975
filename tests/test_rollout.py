"""HF rollout engine: grouping, stopping, truncation, and rollout logprobs equal to the trainer's."""
import pytest
import torch

from nanorl.policy import response_logprobs
from nanorl.rollout import HFEngine, SamplingConfig
from nanorl.task import build_model
from nanorl.trajectory import collate

V, EOS, PAD = 24, 1, 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(V, seed=0).eval()


def prompts():
    return [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def test_groups_status_and_stop(model):
    eng = HFEngine(model, pad_id=PAD)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=(EOS, 2, 3), seed=1)
    out = eng.generate(prompts(), 4, sp)
    assert len(out) == 12 and [s.group_id for s in out] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(s.prompt_ids == prompts()[s.group_id] for s in out)
    for s in out:
        stops = [i for i, t in enumerate(s.response_ids) if t in (EOS, 2, 3)]
        if s.status == "completed":  # ends exactly at its first stop token
            assert stops == [len(s.response_ids) - 1]
        else:
            assert s.status == "truncated" and stops == [] and len(s.response_ids) == 6
    assert {s.status for s in out} == {"completed", "truncated"}  # both happen with these stop ids
    again = eng.generate(prompts(), 4, sp)  # same seed, same samples
    assert [s.response_ids for s in again] == [s.response_ids for s in out]


def test_rollout_logprobs_match_trainer_recompute(model):
    eng = HFEngine(model, pad_id=PAD)
    for temperature in (1.0, 0.7):
        sp = SamplingConfig(temperature=temperature, max_new_tokens=5, stop_token_ids=(EOS, 2), seed=2)
        samples = eng.generate(prompts(), 3, sp)
        batch = collate(samples, PAD)
        with torch.no_grad():
            lp, _ = response_logprobs(model, batch, temperature)
        diff = ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max()
        assert diff < 1e-5, diff  # left-padded KV-cache decode == right-padded full forward
        assert (lp * (1 - batch.response_mask)).abs().max() == 0  # padding scores exactly 0


def test_greedy_is_argmax_of_full_forward(model):
    eng = HFEngine(model, pad_id=PAD)
    s = eng.generate([[5, 6, 7]], 1, SamplingConfig(temperature=0.0, max_new_tokens=4))[0]
    assert len(s.response_ids) == 4  # no stop token: the whole budget (an empty response checks nothing)
    ids = [5, 6, 7]
    for tok in s.response_ids:
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        assert tok == nxt
        ids.append(nxt)


def test_keep_sampling_mask_first_epoch_ratio_is_one(model):
    """Issue 7: with the recorded support, the trainer's on-policy ratio is 1 on every token; without
    it (full-vocabulary recompute of support-renormalised rollout logprobs) it is not."""
    eng = HFEngine(model, pad_id=PAD)
    sp = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=5, stop_token_ids=(EOS,),
                        keep_support=True, seed=3)
    samples = eng.generate(prompts(), 4, sp)
    batch = collate(samples, PAD)
    m = batch.response_mask > 0
    with torch.no_grad():
        lp_ksm, _ = response_logprobs(model, batch, 1.0, support=batch.sampling_support)
        lp_full, _ = response_logprobs(model, batch, 1.0)
    ratio_ksm = torch.exp(lp_ksm - batch.rollout_logprobs)[m]
    ratio_full = torch.exp(lp_full - batch.rollout_logprobs)[m]
    assert (ratio_ksm - 1).abs().max() <= 1e-6
    assert (ratio_full - 1).abs().max() > 1e-3 and (ratio_full <= 1 + 1e-6).all()


def test_shared_prefill_runs_each_prompt_once_and_changes_no_sample(model, monkeypatch):
    """The n samples of a prompt share its prefill (issue 23): the first forward sees each distinct
    prompt once, and the samples — tokens, logprobs — are those of prefilling every row."""
    sp = SamplingConfig(temperature=1.0, max_new_tokens=5, stop_token_ids=(EOS,), seed=3)
    rows, real = [], model.forward

    def counted(*a, **k):
        rows.append(k["input_ids"].shape)
        return real(*a, **k)
    monkeypatch.setattr(model, "forward", counted)
    eng = HFEngine(model, pad_id=PAD)
    shared = eng.generate(prompts(), 4, sp)
    assert rows[0] == (3, 5) and all(r == (12, 1) for r in rows[1:])  # 3 prompts prefilled, 12 rows decoded
    rows.clear()
    monkeypatch.setattr(HFEngine, "_shared_prefill", lambda self, rows_, device: (None, None))  # every row
    each = HFEngine(model, pad_id=PAD).generate(prompts(), 4, sp)
    assert rows[0] == (12, 5)
    assert [s.response_ids for s in shared] == [s.response_ids for s in each]
    for a, b in zip(shared, each):
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < 1e-5


def test_shared_prompt_forward_equals_the_full_one(model, monkeypatch):
    """The trainer's forward runs a prompt shared by consecutive rows once (nanorl/policy.py
    _hidden_shared_prefix, issue 23): logprobs, entropies and the gradient of every parameter equal
    one full forward's, and the prefix pass sees one row per distinct prompt."""
    from nanorl import policy
    model.train()
    sp = SamplingConfig(temperature=1.0, max_new_tokens=5, stop_token_ids=(EOS,), seed=5)
    batch = collate(HFEngine(model, pad_id=PAD).generate(prompts(), 4, sp), PAD)  # ragged prompts + responses

    def scored():
        model.zero_grad()
        lp, ent = response_logprobs(model, batch, 0.8)
        ((lp * 1.3).sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])
    widths, real = [], model.base_model.forward

    def counted(*a, **k):
        widths.append(tuple(k["input_ids"].shape))
        return real(*a, **k)
    monkeypatch.setattr(model.base_model, "forward", counted)
    shared = scored()
    P = batch.prompt_width
    # 3 prompts once, then 12 rows
    assert widths == [(3, P - 1), (12, 1 + batch.response_ids.shape[1])], widths
    monkeypatch.setattr(policy, "_shared_prompts", lambda m, b: None)
    full = scored()
    model.eval()
    assert (shared[0] - full[0]).abs().max() < 1e-5 and (shared[1] - full[1]).abs().max() < 1e-5
    assert float((shared[2] - full[2]).norm() / full[2].norm()) < 1e-5 and full[2].norm() > 0
