"""Rollout token sampling (temperature, top-k, top-p) and Keep Sampling Mask (KSM).

Part of link 1 of the chain (rollout): the HF engine (nanorl/rollout.py) calls `sample_next` once per
decode step. With `record_support=True` it also returns, per token, the ids the sampler could have
drawn (its support); the trainer hands them to nanorl/entropy.py (`support=[N, K]`) so the current,
old and reference policies are all scored on that same support (KSM, DeepSeek-V3.2 §3.1).

Start at `sample_next` (the sampler's steps, which logprob it reports, the overflow policy); `keep_mask`
is the filter, `support_to_mask` / `apply_support` the trainer's side, `support_from_topk_logprobs` the
vLLM side. Key choices: the order of HF `generate` and vLLM, fp32 math, tie-inclusive filters (the kept
set depends only on the distribution), and a support larger than `support_cap` stored as unrestricted,
never truncated. Why KSM matters, and what vLLM exposes: docs/from-slime-verl.md, "nanorl/sampling.py".

Run the tests: python -m pytest tests/test_sampling.py -q
"""
from __future__ import annotations

import math
import threading

import torch


def _check_args(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, cap: int):
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1] (1 disables it), got {top_p}")
    if cap < 1:
        raise ValueError(f"support_cap must be >= 1, got {cap}")


def keep_mask(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Kept-token mask of top-k then top-p on temperature-scaled logits z [B, V] -> bool [B, V].

    Both filters are tie-inclusive (sample_next's steps 2-3), so the kept set is always
    {i : z_i >= threshold_b} for a per-row threshold: the kept ids are the |S| largest logits.
    """
    # None: every id kept so far (no [B, V] mask to build and apply)
    keep, V = None, z.shape[-1]
    if 0 < top_k < V:
        kth = z.topk(top_k, dim=-1).values[:, -1:]  # [B, 1] k-th largest logit
        keep = z >= kth  # [B, V] ties with the k-th value stay
    if top_p < 1.0:
        # [B, V] top-k-renormalised
        q = torch.softmax(z if keep is None else z.masked_fill(~keep, float("-inf")), dim=-1)
        # q sorted descending (the first W columns, all the nucleus needs) and its running mass
        q_sorted, cum = _sorted_head(q, top_p)  # [B, W], [B, W]
        # Mass strictly before each sorted position; fp32 cumsum of non-negatives is monotone, so
        # `mass_before < p` holds on a prefix, which starts at position 0 (mass 0 < p): >= 1 kept.
        mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # [B, W]
        n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True)  # [B, 1], >= 1
        threshold = q_sorted.gather(-1, n_keep - 1)  # [B, 1] prob of the last kept sorted token
        # every token tied with the boundary is kept too
        keep = (q >= threshold) if keep is None else keep & (q >= threshold)  # [B, V]
    return torch.ones_like(z, dtype=torch.bool) if keep is None else keep


def _sorted_head(q: torch.Tensor, top_p: float, width: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [B, V] sorted descending, its cumsum), both cut to the first W columns, W wide enough that
    every row's mass-before at the last column is >= top_p (no later column can be kept).

    A top-W partial sort instead of sorting all of V: 32 rows of a 152k vocabulary take ~0.4 s to sort
    on one CPU thread, as long as the step's head GEMM. topk's values are the sorted row's first W in
    the same order and the CPU cumsum runs left to right, so these are the full sort's first W columns
    bit for bit and keep_mask keeps the same ids. W grows ×8 while some row's nucleus is wider (a flat
    distribution); at W >= V it is the full sort. Other devices sort in full (fast there; a GPU cumsum
    is a parallel scan, whose first W sums need not be the full row's bit for bit).
    """
    V = q.shape[-1]
    while width < V and q.device.type == "cpu":
        head = q.topk(width, dim=-1).values  # [B, W] descending
        cum = torch.cumsum(head, dim=-1)  # [B, W]
        if bool((cum[:, -2] >= top_p).all()):
            return head, cum
        width *= 8
    head = q.sort(dim=-1, descending=True).values  # [B, V]
    return head, torch.cumsum(head, dim=-1)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    record_support: bool = False,
    support_cap: int = 64,
    *,
    stats: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draw one token per row with temperature / top-k / top-p.

    The sampler, in order (the order of HF `generate` and vLLM):
      1. temperature T: z = logits · (1/T) in fp32 (the op of nanorl/entropy.py's kernels). T == 0
         means greedy: argmax, no randomness.
      2. top-k: keep the tokens whose z is >= the k-th largest z; ties at the k-th value are all kept,
         so more than k tokens can survive.
      3. top-p (nucleus): on the top-k-renormalised distribution q, keep token i iff the mass of the
         tokens strictly MORE probable than i is < p:  keep_i <=> sum_{j : q_j > q_i} q_j < p.
         Tokens of equal probability get the same decision (all kept). The most probable token has
         mass-above 0 < p, so at least one token is always kept (p must lie in (0, 1]).
      4. draw a ~ q_S(a) = softmax(z masked to −inf outside the kept set S): torch.multinomial's draw,
         run directly (`draw`; a `generator` makes it reproducible). Logits holding NaN / inf raise.

    The token's logprob it returns (what `Sample.rollout_logprobs` stores):
      * record_support=True  → log q_S(a) (temperature-scaled, renormalised on S): what the trainer
        recomputes with the recorded support;
      * record_support=False → log p_T(a) under the FULL temperature-scaled distribution: what a
        full-vocab trainer recomputes;
      * T == 0 (greedy) → log softmax(logits)[argmax], i.e. under temperature 1 and the full vocabulary
        (a trainer cannot divide by T = 0; it should score greedy rollouts at T = 1), support row −1.

    A support row is the kept ids, most probable first, right-padded with −1 to the width K of the
    batch (K = the largest kept set in this step, capped); a row of all −1 means "unrestricted": the
    trainer uses the full vocabulary for that token. Overflow (top-p can keep thousands of ids when the
    distribution is flat): a row that keeps more than `support_cap` ids is NOT stored truncated (the
    trainer would then score a token on a support that misses part of where it was drawn, or even miss
    the token itself); it is stored as all −1 and its logprob reported under the full temperature-scaled
    distribution, so rollout logprob and trainer recompute still agree token by token; that token falls
    back to the non-KSM approximation (its truncated mass is at most 1 − p). The count goes into
    `stats["overflow_tokens"]`, which the engine logs next to bytes/token; `support_cap` bounds the
    storage (≤ 4·support_cap bytes per token).

    Args:
        logits: [B, V] raw next-token logits (any float dtype; the math runs in fp32).
        temperature: >= 0; 0 = greedy.  top_k: 0 = off.  top_p: in (0, 1], 1 = off.
        generator: optional torch.Generator on logits' device, for reproducible draws.
        record_support: return the kept ids per row and report logprobs renormalised on them.
        support_cap: most ids stored per row; a larger kept set is stored as an unrestricted row.
        stats: optional dict; counts are added to keys "sampled_tokens", "restricted_tokens",
            "overflow_tokens", "support_ids" (ids stored in restricted rows).
    Returns:
        tokens [B] long, logprobs [B] fp32 (under which distribution: above),
        support [B, K] long with −1 padding (all −1 = unrestricted) or None.
    """
    _check_args(logits, temperature, top_k, top_p, support_cap)
    B, V = logits.shape
    # RL math in fp32 whatever the model dtype
    logits = logits.float()

    # the support reported where nothing restricts the draw: one −1 per row ("unrestricted")
    unrestricted = torch.full((B, 1), -1, dtype=torch.long, device=logits.device) if record_support else None

    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)  # [B]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # [B]
        _count(stats, B, 0, 0, 0)
        return tokens, logprobs, unrestricted

    # The trainer kernels' op (step 1 above): multiply by 1/T, never divide by T (x · 1.0 is x: no copy).
    z = logits if temperature == 1.0 else logits * (1.0 / temperature)  # [B, V]
    logp_all = torch.log_softmax(z, dim=-1)  # [B, V] log p_T
    filtering = (0 < top_k < V) or top_p < 1.0
    if filtering:
        keep = keep_mask(z, top_k, top_p)  # [B, V]
        masked = z.masked_fill(~keep, float("-inf"))  # [B, V]
        logp_kept = torch.log_softmax(masked, dim=-1)  # [B, V] log q_S, −inf outside S
    else:
        # nothing filtered: q_S is p_T, the same numbers (one log_softmax over V, not two)
        logp_kept = logp_all
    tokens = draw(logp_kept, generator)  # [B]
    logp_full = logp_all.gather(-1, tokens[:, None]).squeeze(-1)  # [B] log p_T
    # NaN / inf logits make the whole row's log_softmax NaN: say so rather than return its argmax
    if not bool(torch.isfinite(logp_full).all()):
        raise ValueError("sample_next: logits hold NaN or inf in rows "
                         f"{torch.nonzero(~torch.isfinite(logp_full)).flatten().tolist()}")

    if not record_support or not filtering:
        _count(stats, B, 0, 0, 0)
        return tokens, logp_full, unrestricted

    n_kept = keep.sum(dim=-1)  # [B]
    fits = n_kept <= support_cap  # [B] rows we can store exactly
    # width of this step's support, 1 <= K <= cap
    K = int(torch.where(fits, n_kept, 1).max())
    # The kept set is the |S| largest logits (keep_mask is threshold-shaped), so the top-K ids of
    # the masked logits, cut at |S|, are exactly S, most probable first.
    ids = masked.topk(K, dim=-1).indices  # [B, K]
    col = torch.arange(K, device=logits.device)  # [K]
    valid = (col[None, :] < n_kept[:, None]) & fits[:, None]  # [B, K]
    support = torch.where(valid, ids, torch.full_like(ids, -1))  # [B, K]
    logp_kept_tok = logp_kept.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    # Overflowed rows are scored full-vocab by the trainer, so report the full-vocab logprob.
    logprobs = torch.where(fits, logp_kept_tok, logp_full)  # [B]
    n_fit = int(fits.sum())
    _count(stats, B, n_fit, B - n_fit, int(valid.sum()))
    return tokens, logprobs, support


def draw(logp: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One id per row of exp(logp) [B, V] -> [B]: what torch.multinomial(exp(logp), 1) draws, bit for bit.

    multinomial draws one sample as an exponential race: argmax_i p_i / E_i, E_i ~ Exp(1), the first
    index on ties (the winner is distributed as p). On the CPU its E_i are float64 uniforms U_i from
    the generator mapped through E_i = fp32(-log1p(-U_i)) by libm, one element at a time: over a 152k
    vocabulary the log1p is ~40% of the race and multinomial's input checks and copies another ~25%.
    Here the same U_i are drawn (the generator ends in the same state), and since -log1p(-u) >= u,
    p_i / U_i bounds p_i / E_i from above: only the ids whose bound reaches the row's best exact ratio
    so far can win (about one per row), and only theirs get the exact E_i (Python's math.log1p is the
    same libm function). Other devices keep torch.multinomial, whose noise stream there is its own, and
    so does a vocabulary under _RACE_MIN_V ids whose rows multinomial accepts: the race's fixed cost
    is then the larger one. The two [B, V] buffers are reused across calls of the same shape (`_scratch`).
    """
    probs = logp.exp()  # [B, V]
    if probs.device.type != "cpu" or (probs.shape[-1] < _RACE_MIN_V and _multinomial_accepts(probs)):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    u, bound = _scratch(probs.shape)  # [B, V] float64, [B, V] fp32
    u.uniform_(generator=generator)  # [B, V] U_i, multinomial's numbers in its order
    # [B, V] >= p_i / E_i up to fp32 rounding (< 1e-6 relative)
    torch.div(probs, bound.copy_(u), out=bound)
    # max's index, not argmax's: any id's exact ratio is a lower bound (max(dim) is ~3× faster here)
    best = bound.max(dim=-1, keepdim=True).indices  # [B, 1]
    # an exact-enough ratio at each row's best bound: a lower bound on the row's winning ratio
    floor = probs.gather(-1, best) / (-torch.log1p(-u.gather(-1, best))).float()  # [B, 1]
    # the rest may only win if their bound reaches it (1e-5: margin over the rounding; NaN stays in)
    maybe = torch.lt(bound, floor * (1 - 1e-5)).logical_not_()  # [B, V]
    rows, cols = torch.nonzero(maybe, as_tuple=True)  # [C], [C] row-major
    exp_noise = torch.tensor([-math.log1p(-x) for x in u[rows, cols].tolist()]).float()  # [C] E_i
    ratio = (probs[rows, cols] / exp_noise).double()  # [C] p_i / E_i, exact as in multinomial
    # argmax's order on the candidates: NaN (0/0) above inf (p/0) above every finite ratio
    ratio = torch.where(ratio.isnan(), 2e300, torch.where(ratio.isinf(), 1e300, ratio))  # [C]
    B, V = probs.shape
    top = torch.full((B,), -1.0, dtype=torch.float64).scatter_reduce(0, rows, ratio, "amax")  # [B]
    # the first id on ties, as argmax
    hit = ratio == top[rows]  # [C]
    return torch.full((B,), V).scatter_reduce(0, rows[hit], cols[hit], "amin")  # [B]


# Below this many ids torch.multinomial is the faster of the two (CPU, one thread, B = 64: V = 20
# 0.05 vs 0.11 ms a draw, V = 64 0.11 vs 0.14, V = 128 0.20 vs 0.17, V = 256 0.82 vs 0.48).
_RACE_MIN_V = 128


def _multinomial_accepts(probs: torch.Tensor) -> bool:
    """Whether torch.multinomial takes every row of probs [B, V] (it raises on a NaN or inf entry and on
    an all-zero row, where the race still returns an id: sample_next then reports the row)."""
    total = probs.sum(dim=-1)  # [B] NaN / inf when an entry is
    return bool(((total > 0) & total.isfinite()).all())


_SCRATCH = threading.local()  # per thread: (shape, float64 buffer, fp32 buffer)


def _scratch(shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """draw's two [B, V] buffers, kept between calls of one shape (one decode loop's every step).
    A fresh one each step cost ~12 ms of the ~70 ms draw at B=32, V=151936: glibc maps a block over
    32 MB (the float64 one is 39 MB) from the kernel anew each time, page faults included. Only the
    latest shape is kept, so memory stays at one step's worth (12 bytes per logit)."""
    held = getattr(_SCRATCH, "held", None)
    if held is None or held[0] != shape:
        held = (shape, torch.empty(shape, dtype=torch.float64), torch.empty(shape, dtype=torch.float32))
        _SCRATCH.held = held
    return held[1], held[2]


def _count(stats: dict | None, sampled: int, restricted: int, overflow: int, ids: int) -> None:
    if stats is None:
        return
    for key, val in (("sampled_tokens", sampled), ("restricted_tokens", restricted),
                     ("overflow_tokens", overflow), ("support_ids", ids)):
        stats[key] = stats.get(key, 0) + val


def support_to_mask(support: torch.Tensor, V: int) -> torch.Tensor:
    """Kept-token mask from support ids.

    Args:
        support: [..., K] integer ids, −1 = padding; a row of all −1 = no restriction.
        V: vocabulary size.
    Returns:
        bool [..., V], True on kept tokens (all True on unrestricted rows).
    """
    if support.is_floating_point():
        raise ValueError(f"support must hold integer ids, got {support.dtype}")
    if support.numel() and (support.max() >= V or support.min() < -1):
        raise ValueError(f"support ids must lie in [-1, {V - 1}] (V={V}), got "
                         f"[{int(support.min())}, {int(support.max())}]")
    support = support.long()
    lead = support.shape[:-1]
    # Scatter padding into an extra column V that is dropped afterwards.
    idx = torch.where(support < 0, torch.full_like(support, V), support)  # [..., K]
    mask = torch.zeros(*lead, V + 1, dtype=torch.bool, device=support.device)  # [..., V+1]
    mask.scatter_(-1, idx, True)
    mask = mask[..., :V]  # [..., V]
    unrestricted = (support < 0).all(dim=-1, keepdim=True)  # [..., 1]
    return mask | unrestricted


def apply_support(logits: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """Logits with −inf outside the recorded support: [..., V] logits, [..., K] support -> [..., V].

    Reference semantics of the trainer's support hook (nanorl/entropy.py does the same, fused):
    log_softmax(apply_support(logits / T, support)) is log q_S. None returns logits unchanged.
    """
    if support is None:
        return logits
    if support.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"support {tuple(support.shape)} and logits {tuple(logits.shape)} must "
                         "agree on all but the last dim")
    mask = support_to_mask(support, logits.shape[-1])  # [..., V]
    return logits.masked_fill(~mask, float("-inf"))


def support_bytes_per_token(support: torch.Tensor, mask: torch.Tensor | None = None,
                            layout: str = "dense") -> float:
    """Storage cost of a support in bytes per token, ids stored as int32.

    Args:
        support: [..., K] ids, −1 pad.  mask: optional [...] weights of real tokens (csr only).
        layout: "dense" = the [R, K] int32 rows Sample stores: 4·K per token;
            "csr" = only the kept ids plus one int32 offset: 4·|S| + 4, averaged over tokens.
    """
    if layout == "dense":
        return 4.0 * support.shape[-1]
    if layout != "csr":
        raise ValueError(f"layout must be 'dense' or 'csr', got {layout!r}")
    per_token = 4.0 * (support >= 0).sum(dim=-1).float() + 4.0  # [...]
    if mask is None:
        return float(per_token.mean()) if per_token.numel() else 0.0
    mask = mask.float()
    total = mask.sum()
    return float(torch.where(mask > 0, per_token * mask, 0.0).sum() / total) if total > 0 else 0.0


def stack_steps(steps: list[torch.Tensor]) -> torch.Tensor:
    """Per-step supports [B, K_t] (one per decode step) -> [B, T, K] with K = max K_t, −1 pad.

    Padding columns keep every row's meaning: a restricted row stays restricted (its ids are
    unchanged), an all −1 row stays unrestricted.
    """
    if not steps:
        raise ValueError("stack_steps needs at least one step")
    K = max(s.shape[-1] for s in steps)
    padded = [torch.nn.functional.pad(s.long(), (0, K - s.shape[-1]), value=-1) for s in steps]
    return torch.stack(padded, dim=1)  # [B, T, K]


def support_from_topk_logprobs(positions: list[dict], support_cap: int = 64
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Support rows from vLLM per-position logprob dicts (logprobs_mode="processed_logprobs").

    Args:
        positions: one dict per generated token, {token_id: logprob float or object with a
            `.logprob` attribute} as in `CompletionOutput.logprobs`; request `logprobs = k + 1`
            for top-k sampling so that a −inf entry proves the kept set is complete.
        support_cap: rows with more kept ids than this are overflow.
    Returns:
        support [R, K] long (−1 pad; all −1 = unrestricted), overflow [R] bool: True where the
        kept set could not be proven complete (no −inf entry) or exceeds the cap. Overflowed rows
        carry vLLM's renormalised logprob while the trainer scores them full-vocab: the engine
        must mask them out of the loss, or refuse (what vLLM exposes: docs/from-slime-verl.md).
    """
    rows, overflow = [], []
    for pos in positions:
        kept, complete = [], False
        for tok, lp in pos.items():
            val = float(getattr(lp, "logprob", lp))
            # the OpenAI server floors −inf at −9999.0
            if math.isfinite(val) and val > -9999.0:
                kept.append((val, int(tok)))
            else:
                # a top-n entry outside S: every member of S ranked above it
                complete = True
        kept.sort(key=lambda t: -t[0])
        ok = complete and 0 < len(kept) <= support_cap
        rows.append([tok for _, tok in kept] if ok else [])
        overflow.append(not ok)
    K = max([len(r) for r in rows] + [1])
    support = torch.full((len(rows), K), -1, dtype=torch.long)  # [R, K]
    for i, r in enumerate(rows):
        support[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return support, torch.tensor(overflow, dtype=torch.bool)
