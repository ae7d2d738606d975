"""Dynamic micro-batching and sequence packing: split an optimizer-step batch by a token budget.

Links 5-6 of the chain (loss forward/backward), micro-batch by micro-batch. RL batches mix 20- and
4000-token samples: micro-batches of a fixed sample count, each padded to its longest sample, waste most
of the compute and leave peak memory to luck. Instead we cap the *tokens* of a micro-batch and run its
samples *packed* (one row, no padding, attention confined to each sample). Start at
`make_micro_batches(lengths, max_tokens, num_micro_batches=None)` (fewest micro-batches under the cap,
then balanced totals; its docstring has the algorithm and its bound, nanorl/bin_packing.py the bin
packing itself), then `packed_response_logprobs`
(the packed forward, a drop-in for policy.response_logprobs) and `global_denominators` (a token-mean
built micro-batch by micro-batch divides by the whole step's count, all ranks). Key choices: an over-long
sample gets a micro-batch of its own (never dropped), a real micro-batch is never empty, a count imposed
by the busiest rank (`agree_num_micro_batches`) is met by splitting buckets. Bugs avoided in slime and
verl: docs/from-slime-verl.md, "nanorl/batching.py".

Run: `python -m pytest tests/test_batching.py -q`.
"""
from __future__ import annotations

import math
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanorl.bin_packing import Bins, balanced, first_fit_decreasing, local_search, quality, split_heaviest
from nanorl.distributed import comm_device

# best_attn_implementation lives in policy.py (load_model chooses the kernel); re-exported for callers
from nanorl.policy import best_attn_implementation as best_attn_implementation, head_logprobs
from nanorl.trajectory import PaddedBatch, pack, packed_response_index


def _beyond_samples(lengths: list[int], max_tokens: int, k: int | None) -> Bins | None:
    """The planners' shared checks. An imposed k above the number of samples: each sample alone
    (heaviest first), then k − n empty micro-batches; else None (the planner plans)."""
    if max_tokens < 1 or (k is not None and k < 1):
        raise ValueError(f"need max_tokens >= 1 and num_micro_batches >= 1, got {max_tokens} and {k}")
    if k is None or k <= len(lengths):
        return None
    if any(n > max_tokens for n in lengths):
        warnings.warn(f"sample(s) longer than max_tokens={max_tokens}: each gets a micro-batch of its own",
                      stacklevel=3)
    alone = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [[i] for i in alone] + [[] for _ in range(k - len(lengths))]


# ----------------------------------------------------------------------------- partitioning API

def make_micro_batches(lengths: list[int], max_tokens: int, num_micro_batches: int | None = None) -> Bins:
    """Split samples into token-capped, balanced, non-empty micro-batches.

    lengths: tokens per sample (prompt + response, real tokens only), each >= 1.
    max_tokens: cap on the token total of a micro-batch; a longer sample is alone in its micro-batch.
    num_micro_batches: impose exactly this many (e.g. from `agree_num_micro_batches`), at least the
        minimum this cap needs; above len(lengths), every sample is alone and the rest are empty.
    Returns lists of sample indices: every index exactly once, heaviest first; a list is empty only
    when num_micro_batches > len(lengths) (the last num_micro_batches − len(lengths) lists).

    Cost model: a sample costs its real tokens, prompt + response (packed rows pay no padding;
    `padding_share` prices padding). (a) Fewest micro-batches with totals <= max_tokens (bin packing,
    NP-hard): lower bound L = #over-long + max(⌈Σ/cap⌉, #samples > cap/2); first-fit-decreasing (FFD) is a
    feasible ceiling; we take the first k = L, L+1, ... where a balanced partition fits, so k <= FFD's
    count. (b) Balanced totals: the heaviest micro-batch sets peak memory (and, across data-parallel ranks,
    the step time). Candidates: LPT (longest sample into the lightest bucket) and FFD-into-k, each polished
    by moves/swaps that never raise the heaviest bucket; the best within the cap wins. Bound (brute-force
    tested): the heaviest bucket (over-long singletons aside) is within (4/3 − 1/(3k)) of the optimal capped
    k-partition: LPT is within it of the uncapped optimum (Graham 1969), and when LPT breaks the cap, ours
    <= cap < LPT. In practice both count and heaviest bucket were optimal in every one of ~850 brute-forced
    small cases.

    An over-long sample gets a micro-batch of its own with a warning (never dropped), no bucket is ever
    empty, and a count imposed from outside (`agree_num_micro_batches`: every rank runs as many passes as
    the busiest, an all-reduce MAX) is reached by splitting the heaviest splittable bucket. A count above
    the number of samples (a rank the DAPO filter left few samples) gives each sample its own micro-batch
    plus EMPTY ones at the end: an explicit `[]` the caller runs as a zero-weight forward
    (nanorl/update.py), never rows made up to fill it — so a real micro-batch is never empty, and an empty
    one is never data.
    """
    if any(int(n) != n or n < 1 for n in lengths):
        raise ValueError("every sample length must be a positive integer (prompt + response tokens)")
    lengths = [int(n) for n in lengths]
    n = len(lengths)
    if (bins := _beyond_samples(lengths, max_tokens, num_micro_batches)) is not None:
        # alone is the lightest a sample can be
        return bins
    over = [i for i in range(n) if lengths[i] > max_tokens]
    if over:
        warnings.warn(f"{len(over)} sample(s) longer than max_tokens={max_tokens} (longest "
                      f"{max(lengths[i] for i in over)}): each gets a micro-batch of its own", stacklevel=2)
    normal = [i for i in range(n) if lengths[i] <= max_tokens]
    bins: Bins = []
    if normal:
        ffd = first_fit_decreasing(normal, lengths, max_tokens, max_bins=None)
        lower = max(math.ceil(sum(lengths[i] for i in normal) / max_tokens),
                    sum(2 * lengths[i] > max_tokens for i in normal))
        # at k = len(ffd), FFD itself is a fitting candidate
        for k in range(max(lower, 1), len(ffd) + 1):
            bins = balanced(normal, lengths, k, max_tokens)
            if bins is not None:
                break
    if num_micro_batches is not None:
        want = num_micro_batches - len(over)
        if want < len(bins):
            raise ValueError(f"imposed num_micro_batches={num_micro_batches} is below the "
                             f"{len(bins) + len(over)} micro-batches that max_tokens={max_tokens} needs here")
        if want > len(bins):
            # always feasible
            split = local_search(split_heaviest(bins, lengths, want), lengths)
            direct = balanced(normal, lengths, want, max_tokens)
            bins = split if direct is None or quality(split, lengths) <= quality(direct,
                                                                                   lengths) else direct
    bins = [sorted(b) for b in bins] + [[i] for i in over]
    return sorted(bins, key=lambda b: (-sum(lengths[i] for i in b), b[0]))


def make_padded_micro_batches(prompt_lens: list[int], response_lens: list[int], max_tokens: int,
                              num_micro_batches: int | None = None) -> Bins:
    """Token-budgeted micro-batches for a PADDED forward (no varlen kernel to pack with): a micro-batch
    costs rows × (longest prompt + longest response) — the collated tensor attention and the MLP
    really run over (PaddedBatch.select trims the rest) — and that padded size is what the budget
    caps, so memory per micro-batch is bounded whatever the length mix. Samples sorted longest first
    fill micro-batches in turn (similar lengths share one: little padding); a sample over the budget
    runs alone. num_micro_batches (agreed across ranks) is reached by halving the fullest ones; above
    the number of samples, each sample runs alone and the rest are empty (as make_micro_batches)."""
    n = len(prompt_lens)
    if (bins := _beyond_samples([p + r for p, r in zip(prompt_lens, response_lens)], max_tokens,
                                num_micro_batches)) is not None:
        return bins
    order = sorted(range(n), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    bins: Bins = []
    width_p = width_r = 0
    for i in order:
        p, r = max(width_p, prompt_lens[i]), max(width_r, response_lens[i])
        if not bins or (len(bins[-1]) + 1) * (p + r) > max_tokens:
            bins.append([])
            p, r = prompt_lens[i], response_lens[i]
        bins[-1].append(i)
        width_p, width_r = p, r
    if num_micro_batches is not None and num_micro_batches < len(bins):
        raise ValueError(f"imposed num_micro_batches={num_micro_batches} is below the {len(bins)} padded "
                         f"micro-batches that max_tokens={max_tokens} needs here")
    while num_micro_batches is not None and len(bins) < num_micro_batches:
        # halving never raises a padded size
        j = max(range(len(bins)), key=lambda j: len(bins[j]))
        bins[j:j + 1] = [bins[j][: len(bins[j]) // 2], bins[j][len(bins[j]) // 2:]]
    return [sorted(b) for b in bins]


def split_fixed(n: int, micro_batch_size: int) -> Bins:
    """The classic split by sample count: [[0..m-1], [m..2m-1], ...], the last one possibly shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]


def agree_num_micro_batches(n: int, group=None) -> int:
    """All ranks must run the same number of micro-batches (collectives in backward): all-reduce MAX."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        # one rank agrees with itself (vLLM makes a world-1 group: no collective there)
        return int(n)
    t = torch.tensor([n], dtype=torch.long, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def padding_share(lengths: list[int], micro_batches: Bins, packed: bool, pad_to_multiple: int = 1) -> float:
    """Wasted share of the compute: (tokens computed − real tokens) / tokens computed.

    Padded: a micro-batch costs (#rows × its longest row). Packed: one row of Σ lengths, rounded up to
    pad_to_multiple (kernels that want aligned shapes; 1 = flash-attn varlen, no padding at all). Lengths
    are totals (prompt + response): the collated layout pads prompt and response separately, so its
    real waste is at least this. Attention's own quadratic cost is not modelled.
    """
    real = computed = 0
    for b in micro_batches:
        lens = [lengths[i] for i in b]
        real += sum(lens)
        computed += -(-sum(lens) // pad_to_multiple) * pad_to_multiple if packed else len(lens) * max(lens)
    return 0.0 if computed == 0 else (computed - real) / computed


# ----------------------------------------------------------------------------- packed forward

def packs_varlen(model) -> bool:
    """Whether training forwards run packed: only with a varlen attention kernel (flash-attention).
    Without one a packed row needs the dense [N, N] mask below — O(N²) memory (77 GB at N = 196k in
    bf16) — so training falls back to padded micro-batches (make_padded_micro_batches)."""
    return "flash" in (getattr(model.config, "_attn_implementation", None) or "")


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype,
                      window: int | None = None) -> torch.Tensor:
    """Additive mask [1, 1, N, N]: 0 where query q may see key k (same sample, k <= q, and within the
    sliding window if any), the dtype's most negative number elsewhere. Additive rather than boolean
    because eager attention adds the mask to the scores while sdpa accepts either."""
    lens = cu_seqlens.diff().long()                                            # [B]
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)  # [N]
    pos = torch.arange(seg.numel(), device=lens.device)                        # [N]
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # [N, N] (query, key)
    if window is not None:
        # transformers' sliding overlay: k > q − window
        allowed &= pos[None, :] > pos[:, None] - window
    zero = torch.zeros((), dtype=dtype, device=lens.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]      # [1, 1, N, N]


def _packed_inputs(model, packed) -> dict:
    """Keyword arguments that confine attention to each sample, for the model's attention kernel."""
    cfg = model.config
    impl = cfg._attn_implementation or "eager"
    base = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    # varlen kernel straight from cu_seqlens: no mask, no padding, no N×N memory
    if "flash" in impl:
        cu = packed.cu_seqlens.to(packed.input_ids.device, torch.int32)
        return dict(base, attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=packed.max_seqlen, max_length_k=packed.max_seqlen)
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"packed forward supports flash-attention, sdpa and eager, not {impl!r}")
    dtype = next(model.parameters()).dtype
    cu = packed.cu_seqlens.to(packed.input_ids.device)
    # a 4D mask is passed to attention as-is (masking_utils)
    mask = block_causal_mask(cu, dtype)
    # e.g. Qwen2 use_sliding_window
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        mask = {"full_attention": mask, "sliding_attention": block_causal_mask(cu, dtype, cfg.sliding_window)}
    return dict(base, attention_mask=mask)


def _replay_ctx(model, packed, replay: bool):
    if not replay:
        return nullcontext()
    if packed.routed_experts is None:
        raise ValueError("replay=True but the batch carries no routed_experts")
    # only MoE runs need it
    from nanorl.moe_replay import replay as moe_replay
    return moe_replay(model, packed.routed_experts, packed.routed_mask)


def packed_forward_hidden(model, packed, replay: bool = False) -> torch.Tensor:
    """Final hidden states [1, N, H] of the base transformer over a packed row."""
    with _replay_ctx(model, packed, replay):
        return model.base_model(**_packed_inputs(model, packed)).last_hidden_state


def packed_forward_logits(model, packed, replay: bool = False) -> torch.Tensor:
    """Logits [1, N, V] over a packed row (position j predicts token j+1 of the same sample)."""
    with _replay_ctx(model, packed, replay):
        return model(**_packed_inputs(model, packed)).logits


def packed_response_logprobs(model, batch: PaddedBatch, temperature: float = 1.0, *, entropy: bool = True,
                             support: torch.Tensor | None = None, impl: str = "fused", replay: bool = False):
    """Drop-in for policy.response_logprobs, run packed: (logprobs [B, T] fp32, entropy [B, T] or None).

    Packs the batch, runs one row, gathers the hidden states that predict response tokens (only real
    ones: the LM head never sees padding) and scores them as the padded path does. Padding → 0, no grad.
    support: [B, T, K] kept token ids or None; replay: route MoE layers to batch.routed_experts.

    Samples in one row [1, N], position ids restarting at 0 per sample. Flash-attention models get
    `cu_seq_lens_q/k` and `max_length_q/k`, which transformers 5.x passes to `flash_attn_varlen_func` (no
    mask, no padding); sdpa/eager get a 4D additive block-diagonal causal mask [1, 1, N, N], used by
    attention as-is. Rotary embeddings see only position ids and no token sees another sample, so logprobs
    equal the padded path (tested <= 1e-5 in fp32, gradients too).
    """
    packed = pack(batch)
    B, T = batch.response_ids.shape
    index, valid = packed_response_index(packed, T)                 # [B, T], [B, T]
    h = packed_forward_hidden(model, packed, replay)[0]               # [N, H]
    h_sel = h[index[valid]]                                           # [M, H], M = real response tokens
    targets = batch.response_ids[valid]                               # [M]
    sup = support[valid] if support is not None else None             # [M, K]
    lp, ent = head_logprobs(model, h_sel, targets, temperature, sup, impl)  # [M], [M]
    zeros = torch.zeros(B, T, dtype=torch.float32, device=h.device)
    lp_bt = zeros.masked_scatter(valid, lp.float())                   # [B, T]
    ent_bt = zeros.masked_scatter(valid, ent.float()) if entropy else None
    return lp_bt, ent_bt


# ----------------------------------------------------------------------------- loss denominators

def global_denominators(batch_masks: list[torch.Tensor], group=None) -> tuple[int, int]:
    """(num_tokens, num_seqs) of the whole optimizer-step batch, for losses.aggregate.

    batch_masks: the [b, T] loss masks of every micro-batch of the step (> 0 = valid, as aggregate
    counts). num_seqs counts rows with at least one valid token — the rows aggregate's
    seq-mean modes average over. Summed over micro-batches, then all-reduced (SUM) across ranks.

    A token-mean built micro-batch by micro-batch must divide by the token count of the whole
    optimizer-step batch (all micro-batches, all ranks), else the split reweights tokens (a mean of means is
    not the mean). Counts are summed, then all-reduced (SUM).
    """
    counts = [0, 0]
    for m in batch_masks:
        valid = m > 0                                                 # [b, T]
        counts[0] += int(valid.sum())
        counts[1] += int(valid.any(-1).sum())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor(counts, dtype=torch.long, device=comm_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        counts = t.tolist()
    return counts[0], counts[1]
