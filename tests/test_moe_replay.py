"""Routing replay (nanorl/moe_replay.py) on tiny random Qwen3-MoE and Mixtral models built in code.

Run: python -m pytest tests/test_moe_replay.py -q
"""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from nanorl import moe_replay as mr

ARCHS = ["qwen3_moe", "mixtral"]  # both renormalise the top-k gates (Qwen3: norm_topk_prob=True)


def seq_logprobs(model, ids, **kw):
    """[B, S-1] fp32 logprob of ids[:, 1:] under the model."""
    logits = model(ids, **kw).logits[:, :-1].float()                        # [B, S-1, V]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def make(arch):
    return mr.patch(mr.tiny_moe(arch, seed=0))


def routers(model):
    return mr._routers(model)


def hijack_unused_expert(model, experts, scale=4.0):
    """Per layer, make an expert the recording never used win the natural routing for many tokens.

    Replayed gates over the recorded pair (a, b) are exp(l_a) / (exp(l_a) + exp(l_b)) after
    renormalisation, so changing only the unused expert's logits leaves them unchanged: replayed
    logprobs must equal the recorded ones up to rounding, while natural routing changes.
    """
    for layer, router in enumerate(routers(model)):
        used = set(experts[:, :, layer].flatten().tolist())
        unused = [e for e in range(router.num_experts) if e not in used]
        assert unused, "test setup: every expert was used; shorten the sequence"
        top = max(used, key=lambda e: int((experts[:, :, layer] == e).sum()))
        with torch.no_grad():
            router.weight[unused[0]] = scale * router.weight[top]


def test_patch_is_idempotent_and_rejects_dense():
    """Patching changes nothing outside record/replay; patching twice is a no-op."""
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        before = mr.tiny_moe("qwen3_moe", seed=0)(ids).logits
        model = make("qwen3_moe")
        assert torch.equal(model(ids).logits, before)
    forwards = [r.forward for r in routers(model)]
    mr.patch(model)
    assert [r.forward for r in routers(model)] == forwards
    assert [r._nanorl_layer for r in routers(model)] == [0, 1]
    assert mr.is_moe(model)
    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not mr.is_moe(dense)
    with pytest.raises(ValueError, match="no supported MoE router"):
        mr.patch(dense)


@pytest.mark.parametrize("arch", ARCHS + ["qwen2_moe"])
def test_replay_of_natural_ids_is_bitwise_identical(arch):
    """Replaying the ids a forward chose re-implements the router exactly (guards against HF drift)."""
    model = make(arch).eval()
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        with mr.record(model) as rec:
            ref = seq_logprobs(model, ids)
        with mr.replay(model, rec.experts) as rep:
            out = seq_logprobs(model, ids)
    assert rec.experts.shape == (2, 9, 2, 2) and rec.experts.dtype == torch.uint8
    assert torch.equal(out, ref)
    assert torch.equal(rep.natural_experts, rec.experts)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_reproduces_record_time_logprobs_after_router_change(arch):
    """(1) routing changed by a router update: replay gives record-time logprobs, natural does not."""
    model = make(arch).eval()
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():
        with mr.record(model) as rec:
            ref = seq_logprobs(model, ids)
        hijack_unused_expert(model, rec.experts)
        with mr.record(model) as rec_after:
            natural = seq_logprobs(model, ids)
        with mr.replay(model, rec.experts) as rep:
            replayed = seq_logprobs(model, ids)
    changed = mr.routing_disagreement(rec.experts, rec_after.experts)
    assert changed >= 0.25, f"perturbation should change routing, changed {changed}"
    assert mr.routing_disagreement(rec.experts, rep.natural_experts) == changed  # the metric under replay
    torch.testing.assert_close(replayed, ref, atol=1e-5, rtol=0)
    assert (natural - ref).abs().max() > 1e-2


def test_masked_positions_route_naturally():
    model = make("qwen3_moe").eval()
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad(), mr.record(model) as rec:
        model(ids)
    forced = (rec.experts.long() + 1) % 8                                    # [1, 6, L, k] other experts
    mask = torch.tensor([[True, True, True, False, False, False]])
    # spy on what each router hands to the experts
    used = {}
    handles = [r.register_forward_hook(lambda m, a, o, i=i: used.__setitem__(i, o[2].clone()))
               for i, r in enumerate(routers(model))]
    with torch.no_grad(), mr.replay(model, forced, mask) as rep:
        model(ids)
    for h in handles:
        h.remove()
    for layer in range(2):
        got = used[layer].reshape(6, 2)
        assert torch.equal(got[:3], forced[0, :3, layer])
        assert torch.equal(got[3:], rep.natural_experts[0, 3:, layer].long())


@pytest.mark.parametrize("arch", ARCHS)
def test_router_gets_gradient_under_replay(arch):
    """(2) the router is trained through the recomputed gates; with ids equal to the natural ones the
    replayed gradient equals Hugging Face's own routing gradient for every parameter."""
    model = make(arch)
    ids = torch.randint(0, 32, (2, 8))
    with mr.record(model) as rec:
        seq_logprobs(model, ids).sum().backward()
    natural_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with mr.replay(model, rec.experts):
        seq_logprobs(model, ids).sum().backward()
    for r in routers(model):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    for n, p in model.named_parameters():
        if n in natural_grads:
            torch.testing.assert_close(p.grad, natural_grads[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_recompute_replays_same_experts(arch):
    """(4) replay-backward: the backward (outside the replay block) recomputes the checkpointed forward
    with the recorded ids; gradients equal the non-checkpointed replay's. Without context_fn: an error."""
    model = make(arch)
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad(), mr.record(model) as rec:
        model(ids)
    hijack_unused_expert(model, rec.experts)  # natural routing now differs: a wrong recompute shows

    def run(ckpt, context_fn=None):
        model.zero_grad(set_to_none=True)
        with mr.replay(model, rec.experts):
            if ckpt:
                kw = {} if context_fn is None else {"context_fn": context_fn}
                lp = checkpoint(seq_logprobs, model, ids, use_reentrant=False, **kw)
            else:
                lp = seq_logprobs(model, ids)
        lp.sum().backward()  # after the block: the recompute must not fall back to natural routing
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = run(False)
    ckpt = run(True, mr.checkpoint_context)
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="context_fn"):
        run(True)


def test_checkpoint_via_hf_gradient_checkpointing():
    """The same through transformers' own per-layer checkpointing (what a trainer turns on)."""
    model = make("qwen3_moe")
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad(), mr.record(model) as rec:
        model(ids)
    hijack_unused_expert(model, rec.experts)
    model.zero_grad(set_to_none=True)
    with mr.replay(model, rec.experts):
        seq_logprobs(model, ids).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": mr.checkpoint_context})
    model.train()
    with mr.replay(model, rec.experts):
        lp = seq_logprobs(model, ids, use_cache=False)
    lp.sum().backward()
    for n, p in model.named_parameters():
        if n in plain:
            torch.testing.assert_close(p.grad, plain[n], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_record_during_kv_cache_decode_equals_full_forward(arch):
    """(5) prefill + one-token steps with a KV cache record the same ids as one full forward."""
    from transformers import DynamicCache

    model = make(arch).eval()
    ids = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        with mr.record(model) as full:
            model(ids)
        cache = DynamicCache(config=model.config)
        with mr.record(model) as inc:
            model(ids[:, :6], past_key_values=cache, use_cache=True)
            for t in range(6, 10):
                model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    assert inc.experts.shape == (2, 10, 2, 2)
    assert torch.equal(inc.experts, full.experts)


def test_replay_rejects_wrong_shapes():
    model = make("qwen3_moe")
    with pytest.raises(ValueError, match="experts must be"):
        with mr.replay(model, torch.zeros(1, 4, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="outside"):
        with mr.replay(model, torch.full((1, 4, 2, 2), 8)):
            pass
    with pytest.raises(ValueError, match="same input"):
        with torch.no_grad(), mr.replay(model, torch.zeros(1, 4, 2, 2, dtype=torch.long)):
            model(torch.zeros(1, 5, dtype=torch.long))


def test_routing_disagreement_counts_sets_not_order():
    a = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])                 # [1, 2, L=2, k=2]
    b = torch.tensor([[[[1, 0], [2, 4]], [[4, 5], [7, 6]]]])                 # one pair differs as a set
    assert mr.routing_disagreement(a, b) == pytest.approx(1 / 4)
    assert mr.routing_disagreement(a, b, torch.tensor([[True, False]])) == pytest.approx(1 / 2)
    assert mr.routing_disagreement(a, b, torch.tensor([[False, False]])) == 0.0
    assert mr.routing_disagreement(a[0], b[0]) == pytest.approx(1 / 4)      # one sample's [n, L, k]


def test_ids_survive_collate_select_pack_and_replay():
    """(3) per-sample ids -> collate -> select -> pack stay aligned with their tokens, and replaying the
    collated (left-padded) batch reproduces each sample's record-time logprobs after a router change."""
    from nanorl import trajectory as traj  # written: an import error fails, never skips
    model = make("qwen3_moe").eval()
    prompts, responses = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[10, 11], [12, 13, 14], [15]]
    samples, refs = [], []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([p + r])
            with mr.record(model) as rec:
                refs.append(seq_logprobs(model, ids)[0, len(p) - 1:])       # [R] response logprobs
            samples.append(traj.Sample(prompt_ids=p, response_ids=r, routed_experts=rec.experts[0]))
    batch = traj.collate(samples, pad_id=0)
    P = batch.prompt_width
    assert batch.routed_experts.shape[:2] == batch.input_ids.shape
    for b, s in enumerate(samples):
        cols = torch.arange(P - len(s.prompt_ids), P + len(s.response_ids))
        assert torch.equal(batch.routed_experts[b, cols], s.routed_experts.long())
        assert batch.routed_mask[b].sum() == len(cols) and batch.routed_mask[b, cols].all()
    sub = batch.select([2, 0])
    for row, b in enumerate([2, 0]):
        real = sub.routed_mask[row]
        assert torch.equal(sub.routed_experts[row, real], samples[b].routed_experts.long())
        assert torch.equal(sub.input_ids[row, real], torch.tensor(prompts[b] + responses[b]))
    packed = traj.pack(batch)                 # a packed [1, N] forward replays packed.routed_experts
    flat = torch.cat([s.routed_experts.long() for s in samples])            # [N, L, k]
    assert torch.equal(packed.routed_experts[0], flat) and packed.routed_mask.all()
    hijack_unused_expert(model, batch.routed_experts[batch.routed_mask][None])
    with torch.no_grad(), mr.replay(model, batch.routed_experts, batch.routed_mask):
        logits = model(batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    logp = torch.log_softmax(logits, -1)
    for b, s in enumerate(samples):
        cols = torch.arange(len(s.response_ids)) + P - 1
        got = logp[b, cols].gather(-1, batch.response_ids[b, :len(s.response_ids), None])[:, 0]
        torch.testing.assert_close(got, refs[b], atol=1e-4, rtol=0)


def test_deepcopy_gives_an_independent_patched_model():
    """A reference model made by deepcopy(policy) keeps its own routing state."""
    import copy

    model = make("mixtral").eval()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad(), mr.record(model) as rec:
        model(ids)
    hijack_unused_expert(model, rec.experts)
    with torch.no_grad(), mr.record(ref) as rec_ref, mr.replay(model, rec.experts):
        ref(ids)
        model(ids)
    assert torch.equal(rec_ref.experts, rec.experts)  # ref: untouched weights, natural routing, recorded


def test_routing_disagreement_by_layer():
    """Per-layer shares: layer 1 flips half its valid tokens, layer 0 none; their token-weighted mean
    is the overall routing/disagreement; the order within k and masked tokens do not count."""
    # [1, 4, L=2, k=2]
    a = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [2, 3]]]])
    b = a.clone()
    b[0, 0, 0] = torch.tensor([1, 0])  # the same set in another order: agrees
    b[0, 1, 1] = torch.tensor([2, 4])  # layer 1 flips at token 1
    b[0, 3, 1] = torch.tensor([0, 0])  # ... and at token 3, which the mask drops
    mask = torch.tensor([[1, 1, 1, 0]])
    assert mr.routing_disagreement_by_layer(a, b, mask) == [0.0, pytest.approx(1 / 3)]
    assert mr.routing_disagreement(a, b, mask) == pytest.approx(1 / 6)
    assert mr.routing_disagreement_by_layer(a, b) == [0.0, 0.5]
    with pytest.raises(ValueError, match="equal"):
        mr.routing_disagreement_by_layer(a, b[..., :1])


def _r3_run_and_batch():
    """A learner namespace (what scoring.routing_forward reads) on a tiny Qwen3-MoE, and an R3 batch:
    two samples whose routing was recorded at 'rollout' (the model's own natural choice)."""
    from types import SimpleNamespace

    from nanorl import trajectory as traj
    from nanorl.config import Config
    model = make("qwen3_moe").eval()
    samples = []
    for p, r in ([[1, 2, 3], [10, 11]], [[4, 5], [12, 13, 14]]):
        with torch.no_grad(), mr.record(model) as rec:
            model(torch.tensor([p + r]))
        samples.append(traj.Sample(prompt_ids=p, response_ids=r, routed_experts=rec.experts[0]))
    run = SimpleNamespace(cfg=Config.from_flags(routing_replay=True), model=model, world=1)
    return run, traj.collate(samples, pad_id=0)


def test_routing_forward_r3_metric_on_the_batch_device(monkeypatch):
    """B2 (issue 45): R3's disagreement metric compares the recorded ids (on the batch's device, where
    stages.to_batch put them) with the trainer's own choice (gathered on the CPU). On CUDA the mixed
    devices raised "Expected all tensors to be on the same device" at the first recompute.

    A meta tensor stands in for the device copy of the recorded ids: torch refuses cpu-vs-meta
    operands exactly as it refuses cpu-vs-cuda. Replay itself is handed the real ids (the part a
    meta tensor cannot run), and the metric's value read (.item(), impossible on meta) is skipped."""
    from nanorl import scoring
    run, batch = _r3_run_and_batch()
    metrics = {}
    logp = scoring.routing_forward(run, batch, None, metrics)                # the CPU run, real values
    assert metrics["routing/replay_mode"] == 3.0 and metrics["routing/disagreement"] == 0.0
    ids, seen = batch.routed_experts, batch.routed_mask                     # [B, P+T, L, k], [B, P+T]
    real_replay, devices = mr.replay, []

    def replay(model, experts, mask=None):  # the device copy replays what it stands for
        return real_replay(model, ids if experts.is_meta else experts, seen if mask.is_meta else mask)

    def metric(a, b, mask=None):  # the real comparison (torch raises on mixed devices), no value read
        differ, valid = mr._differ(a, b, mask)                               # [B, P+T, L] each
        devices.append({t.device.type for t in (a, b, mask, differ & valid)})
        return 0.0

    monkeypatch.setattr(mr, "replay", replay)
    monkeypatch.setattr(mr, "routing_disagreement", metric)
    monkeypatch.setattr(mr, "routing_disagreement_by_layer", lambda a, b, m=None: [metric(a, b, m)])
    batch.routed_experts, batch.routed_mask = ids.to("meta"), seen.to("meta")
    metrics = {}
    again = scoring.routing_forward(run, batch, None, metrics)
    assert devices == [{"meta"}, {"meta"}], devices                          # both metrics, on its device
    assert torch.equal(again, logp) and metrics["routing/replay_mode"] == 3.0
