"""Tests for nanorl/batching.py: token-capped balanced micro-batches, packed forward, global denominators.

Run: python -m pytest tests/test_batching.py -q
"""
import heapq
import math
import random
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanorl import batching, bin_packing
from nanorl.batching import (
    agree_num_micro_batches,
    block_causal_mask,
    global_denominators,
    make_micro_batches,
    packed_response_logprobs,
    padding_share,
    split_fixed,
)
from nanorl.losses import aggregate
from nanorl.policy import response_logprobs
from nanorl.trajectory import Sample, collate, pack


def loads(bins, lengths):
    return [sum(lengths[i] for i in b) for b in bins]


def check_partition(bins, lengths, cap):
    """The invariants every answer must satisfy."""
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every sample exactly once"
    assert all(b for b in bins), "no empty micro-batch"
    for b, load in zip(bins, loads(bins, lengths)):
        assert load <= cap or len(b) == 1, f"bucket {b} holds {load} > cap {cap} tokens"
        if len(b) == 1 and load > cap:
            assert lengths[b[0]] > cap


def cap_blind_kk(lengths, k):
    """k-way Karmarkar–Karp largest differencing, as verl/slime balance micro-batches: no cap. Returns
    the bucket loads. Merge the two partitions of largest spread, heaviest part with lightest part."""
    heap = [(-n, i, [n] + [0] * (k - 1)) for i, n in enumerate(sorted(lengths, reverse=True))]
    heapq.heapify(heap)
    order = len(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = sorted((x + y for x, y in zip(a, reversed(b))), reverse=True)
        order += 1
        heapq.heappush(heap, (-(merged[0] - merged[-1]), order, merged))
    return heap[0][2]


def ffd_count(lengths, cap):
    normal = [i for i, n in enumerate(lengths) if n <= cap]
    return len(bin_packing.first_fit_decreasing(normal, lengths, cap, None)) + len(lengths) - len(normal)


def set_partitions(items):
    """All partitions of a list into non-empty blocks (Bell(8) = 4140 for 8 items)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for j in range(len(part)):
            yield part[:j] + [[first] + part[j]] + part[j + 1:]
        yield [[first]] + part


def brute_force(lengths, cap):
    """{k: optimal heaviest normal bucket over capped partitions into exactly k non-empty buckets}."""
    best = {}
    for part in set_partitions(list(range(len(lengths)))):
        ls = loads(part, lengths)
        if all(l <= cap or len(b) == 1 for b, l in zip(part, ls)):
            normal = [l for l in ls if l <= cap] or [0]
            best[len(part)] = min(best.get(len(part), math.inf), max(normal))
    return best


# ----------------------------------------------------------------------------- partition properties

@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=40), cap=st.integers(1, 400),
       extra=st.integers(0, 5), impose=st.booleans())
def test_partition_properties(lengths, cap, extra, impose):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bins = make_micro_batches(lengths, cap)
    check_partition(bins, lengths, cap)
    n_over = sum(n > cap for n in lengths)
    warned = any("longer than max_tokens" in str(w.message) for w in caught)
    assert warned == (n_over > 0), "over-long samples warn, others don't"
    lower = n_over + max(math.ceil(sum(n for n in lengths if n <= cap) / cap),
                         sum(2 * n > cap for n in lengths if n <= cap))
    assert lower <= len(bins) <= ffd_count(lengths, cap), "fewest buckets: between the bound and FFD"
    if impose:
        m = min(len(bins) + extra, len(lengths))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            forced = make_micro_batches(lengths, cap, m)
        assert len(forced) == m
        check_partition(forced, lengths, cap)


def test_balance_within_lpt_bound_of_brute_force_optimum():
    """Heaviest bucket <= (4/3 − 1/(3k)) × the optimal capped k-partition (the bound of the docstring),
    and the minimal count equals the true optimum, on 150 small random cases checked exhaustively."""
    rng = random.Random(0)
    worst, count_gap = 0.0, 0
    for _ in range(150):
        n, cap = rng.randint(1, 7), rng.randint(4, 40)
        lengths = [rng.randint(1, 30) for _ in range(n)]
        opt = brute_force(lengths, cap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bins = make_micro_batches(lengths, cap)
            count_gap += len(bins) - min(opt)
            for k in range(len(bins), n + 1):
                got = make_micro_batches(lengths, cap, k) if k > len(bins) else bins
                heaviest = max([l for l in loads(got, lengths) if l <= cap] or [0])
                assert heaviest <= (4 / 3 - 1 / (3 * k)) * opt[k] + 1e-9, (lengths, cap, k, got, opt[k])
                worst = max(worst, heaviest / max(opt[k], 1))
    assert count_gap == 0
    print(f"worst heaviest/optimal ratio over the small cases: {worst:.3f}")


def test_ceil_sum_over_cap_count_is_not_forced_when_it_cannot_fit():
    """verl PR #7553's example: ceil(56/8) = 7 buckets cannot hold eight 7-token samples under cap 8.
    Cap-blind KK at 7 buckets pairs two of them (14 tokens); we answer 8 singletons."""
    lengths = [7] * 8
    assert max(cap_blind_kk(lengths, 7)) == 14
    bins = make_micro_batches(lengths, 8)
    assert sorted(loads(bins, lengths)) == [7] * 8


def test_slime_1838_imposed_count_cap_and_no_empty_bucket():
    """slime #1838: this rank needs 13 micro-batches, another rank needs 14, all-reduce MAX → 14. KK at
    14 ignores the cap (a bucket of 18 > 17 tokens) and slime's capped first-fit fallback fills only 13
    bins, leaving an empty one (torch.cat([]) crash). Ours: 14 non-empty buckets, all <= 17."""
    lengths = [11, 6, 3, 9, 14, 10, 7, 5, 4, 8, 7, 10, 9, 2, 4, 5, 16, 9, 5, 3, 4, 7, 17, 8, 8, 5, 15, 7]
    cap, idx = 17, list(range(len(lengths)))
    assert len(make_micro_batches(lengths, cap)) == 13
    assert max(cap_blind_kk(lengths, 14)) > cap                                        # the cap-blind KK
    first_fit = bin_packing.first_fit_decreasing(idx, lengths, cap, max_bins=14)
    assert len(first_fit) == 13                                                        # → one bin empty
    bins = make_micro_batches(lengths, cap, num_micro_batches=14)
    check_partition(bins, lengths, cap)
    assert len(bins) == 14 and max(loads(bins, lengths)) <= cap


def test_imposed_count_splits_instead_of_adding_empties():
    lengths = [9, 9, 1, 1]  # needs 2 buckets of 10; imposing 4 must split them, not add 2 empties
    bins = make_micro_batches(lengths, 10, num_micro_batches=4)
    assert sorted(loads(bins, lengths)) == [1, 1, 9, 9]
    assert sorted(loads(make_micro_batches(lengths, 10, 3), lengths)) == [2, 9, 9]  # best max is 9


def test_over_long_sample_gets_its_own_bucket_with_a_warning():
    with pytest.warns(UserWarning, match="longer than max_tokens=10"):
        bins = make_micro_batches([25, 3, 4, 5], 10)
    assert [0] in bins and sorted(i for b in bins for i in b) == [0, 1, 2, 3]
    assert len(bins) == 3  # [25] alone, then 3+4+5 = 12 > 10 needs two buckets


def test_bad_inputs_raise_clear_errors():
    assert make_micro_batches([1, 2, 3], 10, num_micro_batches=4) == [[2], [1], [0], []]  # lockstep pad
    with pytest.raises(ValueError, match="below"):
        make_micro_batches([8, 8, 8], 10, num_micro_batches=2)
    with pytest.raises(ValueError, match="positive integer"):
        make_micro_batches([3, 0], 10)
    with pytest.raises(ValueError, match="max_tokens"):
        make_micro_batches([3], 0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        split_fixed(4, 0)
    assert make_micro_batches([], 10) == []


def test_split_fixed_and_agree_without_distributed():
    assert split_fixed(5, 2) == [[0, 1], [2, 3], [4]]
    assert split_fixed(0, 3) == []
    assert agree_num_micro_batches(7) == 7  # no process group: identity


def test_distributed_reductions_use_max_for_counts_and_sum_for_denominators(monkeypatch):
    """The collective path against a planted peer rank: all_reduce is replaced by one that combines this
    rank's tensor with a second rank's values by the op it is given, so a wrong op gives a wrong number:
    MAX for the micro-batch count (every rank runs as many as the busiest), SUM for the token and row
    counts. No real process group in pytest's own process: one left behind (even destroyed) can abort
    the interpreter at exit with "terminate called without an active exception" (nanorl/rank_lifecycle.py,
    end_process), which failed a CI run whose tests had all passed. Two gloo ranks run in
    tests/test_reduce_metrics.py and tests/test_plugins.py."""
    import torch.distributed as dist
    ops, world = [], {"size": 1}
    peer = {dist.ReduceOp.MAX: torch.tensor([9]), dist.ReduceOp.SUM: torch.tensor([10, 3])}

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        ops.append(op)
        other = peer[op]
        t.copy_(torch.maximum(t, other) if op == dist.ReduceOp.MAX else t + other)

    monkeypatch.setattr(batching.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(batching.dist, "get_world_size", lambda group=None: world["size"])
    monkeypatch.setattr(batching.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(batching.dist, "all_reduce", all_reduce)
    masks = [torch.tensor([[1., 1., 0.], [0., 0., 0.]]), torch.tensor([[0., 2., 1.]])]
    # A world of one needs no collective (vLLM makes such a group; a forked worker must not reduce in it)
    assert agree_num_micro_batches(5) == 5 and global_denominators(masks) == (4, 2) and ops == []
    world["size"] = 2  # the collective path: the peer runs 9 micro-batches and holds 10 tokens in 3 rows
    assert agree_num_micro_batches(5) == 9 and agree_num_micro_batches(12) == 12
    assert global_denominators(masks) == (14, 5)
    assert ops == [dist.ReduceOp.MAX, dist.ReduceOp.MAX, dist.ReduceOp.SUM]


# ----------------------------------------------------------------------------- loss normalisation

def test_global_denominators_make_micro_batching_invisible():
    """Σ over micro-batches of aggregate(..., global denominators) == aggregate over the whole batch."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[2] = 0  # a row with no valid token counts in no denominator
    loss[mask == 0] = float("nan")  # masked NaN must not leak
    parts = [[0, 4], [1, 2, 3], [5]]
    n_tok, n_seq = global_denominators([mask[p] for p in parts])
    assert (n_tok, n_seq) == (int((mask > 0).sum()), 5)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate(loss, mask, mode)
        split = sum(aggregate(loss[p], mask[p], mode, num_tokens=n_tok, num_seqs=n_seq, norm_len=5)
                    for p in parts)
        torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- padding share

def test_padding_share_on_lognormal_lengths():
    """Wasted compute on 512 lognormal samples (prompt ~ 60-200, response lognormal median 300, cap
    4096): fixed count-8 micro-batches padded to their longest vs token-capped buckets padded vs packed."""
    rng = random.Random(0)
    lengths = [rng.randint(60, 200) + min(int(rng.lognormvariate(math.log(300), 1.0)), 3500)
               for _ in range(512)]
    fixed = padding_share(lengths, split_fixed(len(lengths), 8), packed=False)
    whole = padding_share(lengths, [list(range(len(lengths)))], packed=False)
    bins = make_micro_batches(lengths, 4096)
    bucketed = padding_share(lengths, bins, packed=False)
    packed = padding_share(lengths, bins, packed=True)
    packed64 = padding_share(lengths, bins, packed=True, pad_to_multiple=64)
    print(f"padding share: whole batch {whole:.1%}, fixed 8/mb {fixed:.1%}, bucketed {bucketed:.1%}, "
          f"packed {packed:.1%}, packed rows rounded to 64 {packed64:.2%} ({len(bins)} micro-batches)")
    assert packed == 0.0 and packed64 <= 0.05 < bucketed < whole
    assert padding_share([3, 1], [[0, 1]], packed=False) == pytest.approx(2 / 6)  # 2 rows × 3 = 6, 4 real


# ----------------------------------------------------------------------------- packed forward

def tiny_qwen2(attn="sdpa", **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, **overrides)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


def tiny_batch():
    rng = random.Random(1)
    shapes = [(3, 4), (1, 6), (5, 1), (2, 3), (4, 5)]  # (prompt, response) lengths
    samples = [Sample([rng.randrange(1, 32) for _ in range(p)], [rng.randrange(1, 32) for _ in range(r)],
                      loss_mask=[int(rng.random() > 0.2) for _ in range(r)]) for p, r in shapes]
    return collate(samples, pad_id=0)


def padded_reference(model, batch, temperature):
    """Plain Hugging Face forward on the padded batch, log-softmax, gather: the ground truth."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits.float()               # [B, P+T, V]
    P, T = batch.prompt_width, batch.response_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:P - 1 + T] / temperature, -1)         # [B, T, V]
    lp = lp.gather(-1, batch.response_ids[..., None])[..., 0]                    # [B, T]
    real = batch.attention_mask[:, P:].bool()
    return torch.where(real, lp, torch.zeros_like(lp))


def test_block_causal_mask_by_hand():
    m = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), torch.float32)[0, 0] == 0
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                           [0, 0, 1, 1, 1]])
    assert torch.equal(m, expect.bool())
    w = block_causal_mask(torch.tensor([0, 4], dtype=torch.int32), torch.float32, window=2)[0, 0] == 0
    assert w[3].tolist() == [False, False, True, True]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_grads_equal_padded(attn):
    batch = tiny_batch()
    model = tiny_qwen2(attn)
    ref = padded_reference(model, batch, 0.7)
    (ref * batch.response_mask).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for impl in ("naive", "fused"):
        lp, ent = packed_response_logprobs(model, batch, 0.7, impl=impl)
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
        assert torch.all(lp[~batch.attention_mask[:, batch.prompt_width:].bool()] == 0)
        padded_lp, padded_ent = response_logprobs(model, batch, 0.7, impl=impl)  # the trainer's padded path
        torch.testing.assert_close(lp, padded_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent, padded_ent, rtol=0, atol=1e-5)
        (lp * batch.response_mask).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)
        model.zero_grad()


def test_packing_without_the_block_mask_would_leak_across_samples():
    """Sanity of the test above: a plain causal mask over the packed row lets sample 2 see sample 1."""
    batch, model = tiny_batch(), tiny_qwen2("sdpa")
    packed = pack(batch)
    good = batching.packed_forward_logits(model, packed)
    n = packed.input_ids.shape[1]
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    leaky = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=causal).logits
    first = int(packed.cu_seqlens[1])
    torch.testing.assert_close(leaky[:, :first], good[:, :first])  # sample 0 has nothing before it
    assert (leaky[:, first:] - good[:, first:]).abs().max() > 1e-3


def test_sliding_window_model_packed_equals_padded():
    model = tiny_qwen2("sdpa", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    assert "sliding_attention" in model.config.layer_types
    batch = tiny_batch()
    lp, _ = packed_response_logprobs(model, batch, 1.0, entropy=False, impl="naive")
    torch.testing.assert_close(lp, padded_reference(model, batch, 1.0), rtol=0, atol=1e-5)


def test_moe_replay_packed_equals_padded():
    """Recorded expert ids travel through pack(): replayed packed logprobs equal replayed padded ones,
    after the router drifted enough that natural routing would differ."""
    from nanorl import moe_replay
    model = moe_replay.patch(moe_replay.tiny_moe("qwen3_moe"))
    batch = tiny_batch()
    with moe_replay.record(model) as rec:
        model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids)
    batch.routed_experts, batch.routed_mask = rec.experts.long(), batch.attention_mask.bool()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.add_(0.5 * torch.randn_like(layer.mlp.gate.weight))
    with moe_replay.replay(model, batch.routed_experts, batch.routed_mask):
        padded, _ = response_logprobs(model, batch, 1.0, entropy=False, impl="naive")
    packed, _ = packed_response_logprobs(model, batch, 1.0, entropy=False, impl="naive", replay=True)
    natural, _ = packed_response_logprobs(model, batch, 1.0, entropy=False, impl="naive")
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert (natural - packed).abs().max() > 1e-3  # replay mattered


def test_padded_micro_batches_cap_the_padded_size():
    """Without a varlen kernel a micro-batch costs rows × (longest prompt + longest response): that
    padded size stays within the budget (a sample over it runs alone), every sample is used once, and
    an imposed (rank-agreed) count is reached without emptying a micro-batch."""
    import random

    from nanorl.batching import make_padded_micro_batches
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        p = [rng.randint(1, 300) for _ in range(n)]
        r = [rng.randint(1, 500) for _ in range(n)]
        budget = rng.randint(50, 3000)
        plain = make_padded_micro_batches(p, r, budget)
        for want in (None, n, rng.randint(len(plain), n)):
            bins = make_padded_micro_batches(p, r, budget, want)
            assert sorted(i for b in bins for i in b) == list(range(n))
            assert all(b for b in bins)
            for b in bins:
                cost = len(b) * (max(p[i] for i in b) + max(r[i] for i in b))
                assert cost <= budget or len(b) == 1
            assert want is None or len(bins) == want
    assert make_padded_micro_batches([3, 3], [2, 2], 100, 3) == [[0], [1], []]  # beyond the samples: pads
    with pytest.raises(ValueError, match="is below"):  # fewer than the budget needs: never silently more
        make_padded_micro_batches([3, 3], [2, 2], 5, 1)
