"""Trajectories: from sampled tokens to the tensors a policy-gradient loss reads (right after link 1).

A *trajectory* is one episode of the policy: a prompt (the state), the tokens sampled in reply (the
actions), each sampled token's log-probability under the sampling policy, and a reward. The engine
returns `Sample`s, `collate` turns them into one `PaddedBatch`, and every later stage reads its [B, T]
tensors over RESPONSE tokens only (prompt tokens are not actions); what the trainer computes per token
during a step lives in its named `StepTensors`. Start at `Sample`, `collate`, `PaddedBatch` (whose
docstring explains the four masks and the padded / packed layouts). Key choices: an empty response is
allowed (its row is padding), an empty prompt is not; the end-of-turn token after an assistant message
is trained (the model must learn to stop). Imports: torch + stdlib only.
Test: python -m pytest tests/test_trajectory.py -q
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from numbers import Real

import torch
from torch import Tensor

# How a sample ended. Only the first two train (TRAINS): an aborted request, an environment that
# raised, a tool call past its limit and a reward that failed carry no reward worth learning from, so
# the step drops them after scoring and counts them (nanorl/stages.py). Truncated samples train unless
# --drop-truncated takes them out of the loss (DAPO's overlong filter).
STATUSES = ("completed", "truncated", "aborted", "env_error", "tool_timeout", "reward_fault")
TRAINS = ("completed", "truncated")


# ------------------------------------------------------------------------------------ the sample
@dataclass
class Sample:
    """One trajectory as the rollout engine returns it; R = len(response_ids)."""
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None = None  # per response token, under the (temperature-scaled,
                                                 # support-renormalised) distribution the trainer scores
    loss_mask: list[int] | None = None            # per response token, None = all ones
    reward: float | dict[str, float] | None = None
    status: str = "completed"                     # one of STATUSES; only TRAINS train
    weight_version: int = 0                       # version of the policy weights that sampled it
    group_id: int = 0                             # samples of the same prompt share a group id
    routed_experts: Tensor | None = None          # [n, L, k] expert ids of input positions 0..n-1
    routing_version: int | None = None            # the weight version whose forward recorded routed_experts
    sampling_support: Tensor | None = None        # [R, K] kept token ids per response token, -1 pad
    metadata: dict = field(default_factory=dict)  # the user's: reward functions, plug-ins, --log-metadata
    # the weight of each reward component in total_reward (--reward-weights); None or a missing name: 1
    reward_weights: dict[str, float] | None = None
    # What nanorl itself records with a sample (never in `metadata`, which is the user's):
    token_versions: list[int] | None = None  # per response token, the weight version that sampled it
    ref_logprobs: list[float] | None = None   # per response token, log π_ref (scored by the async worker)
    greedy_baseline: float | None = None      # ReMax: its prompt's greedy reward (the async worker's)
    episode: dict | None = None               # --env / --agent: how the episode went (end, turns, spans...)
    support_overflow: int | None = None       # --keep-sampling-mask on vLLM: tokens past --support-cap
    # the metadata fields a reward returned as log-only ("_" keys, nanorl/rewards.py): logged, never trained
    log_only: list[str] | None = None
    # a reward's credited spans ((first token, end token), value): nanorl/spans.py SpanReward
    span_credits: list[tuple[tuple[int, int], float]] | None = None

    def __post_init__(self):
        P, R = len(self.prompt_ids), len(self.response_ids)

        def check(ok, msg):
            if not ok:
                raise ValueError(f"Sample: {msg}")
        check(P > 0, "prompt_ids is empty: the first response token is predicted from the last prompt "
                     "token, so a prompt needs at least one token (e.g. BOS)")
        for name in ("rollout_logprobs", "loss_mask", "token_versions", "ref_logprobs"):
            v = getattr(self, name)
            check(v is None or len(v) == R, f"{name} has {0 if v is None else len(v)} entries, not R={R}")
        check(self.loss_mask is None or set(self.loss_mask) <= {0, 1}, "loss_mask must hold only 0 and 1")
        check(self.status in STATUSES, f"status must be one of {STATUSES}, got {self.status!r}")
        vals = self.reward.values() if isinstance(self.reward, dict) else [self.reward or 0]
        check(all(isinstance(v, Real) for v in vals),
              f"reward must be a number, a dict of numbers or None, got {self.reward!r}")
        s, e = self.sampling_support, self.routed_experts
        check(s is None or (s.dim() == 2 and s.shape[0] == R),
              f"sampling_support must be [R={R}, K], got {tuple(getattr(s, 'shape', ()))}")
        check(e is None or (e.dim() == 3 and e.shape[0] <= P + R),
              f"routed_experts must be [n <= P+R = {P + R}, L, k], got {tuple(getattr(e, 'shape', ()))}")
        check(self.routing_version is None or e is not None, "routing_version without routed_experts")

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def total_reward(self) -> float:
        """The reward the advantage reads: a dict reward's components summed, each times its weight."""
        if isinstance(self.reward, dict) and self.reward_weights:
            return float(sum(self.reward_weights.get(k, 1.0) * v for k, v in self.reward.items()))
        if isinstance(self.reward, dict):
            return float(sum(self.reward.values()))
        return float(self.reward or 0.0)


# ------------------------------------------------------------------------------------- the masks
def padding_mask(lengths: Tensor, T: int) -> Tensor:
    """lengths [B] → [B, T] float32, 1 on positions t < lengths[b]."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or (lengths < 0).any() or (lengths > T).any():
        raise ValueError(f"padding_mask needs 1-D lengths in [0, T={T}], got {lengths.tolist()}")
    return (torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]).float()  # [B, T]


def response_mask_from_eos(response_ids: Tensor, eos_id, lengths: Tensor | None = None) -> Tensor:
    """response_ids [B, T], eos_id an int or a list of stop ids, lengths [B] optional → [B, T] float32.

    1 up to and including the first EOS, 0 after; no EOS → all ones (a truncated response).
    With `lengths`, positions past each length are padding (0) and an EOS there is ignored — the pad
    id is often the EOS id.
    """
    if response_ids.dim() != 2:
        raise ValueError(f"response_ids must be [B, T], got {tuple(response_ids.shape)}")
    dev, T = response_ids.device, response_ids.shape[1]
    stop = torch.as_tensor(eos_id, device=dev).reshape(-1)          # [n_stop]
    is_eos = torch.isin(response_ids, stop)                          # [B, T]
    real = torch.ones_like(is_eos)
    if lengths is not None:
        real = padding_mask(torch.as_tensor(lengths, device=dev), T).bool()  # [B, T]
        is_eos = is_eos & real
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # [B, T] EOS strictly before t
    return ((eos_before == 0) & real).float()                        # [B, T]


def valid_mask(response_mask: Tensor, truncated: Tensor | None = None, exclude_truncated: bool = False,
               step_mask: Tensor | None = None) -> Tensor:
    """response_mask [B, T], truncated [B] bool, step_mask [B] or [B, T] → [B, T] float32 loss mask.

    valid = response ∩ (not truncated, when exclude_truncated: DAPO's overlong filtering)
            ∩ step_mask (per sample [B] or per token [B, T]; 0 drops a step / turn).
    Computed with booleans, so a NaN anywhere in the inputs cannot leak into the result.
    """
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got {tuple(response_mask.shape)}")
    B, T = response_mask.shape
    keep = response_mask > 0                                         # [B, T]
    if exclude_truncated:
        if truncated is None:
            raise ValueError("exclude_truncated=True needs the truncated [B] flags")
        truncated = torch.as_tensor(truncated, device=keep.device).bool()
        if truncated.shape != (B,):
            raise ValueError(f"truncated must be [B={B}], got {tuple(truncated.shape)}")
        keep = keep & ~truncated[:, None]
    if step_mask is not None:
        step = torch.as_tensor(step_mask, device=keep.device)
        step = step[:, None] if step.dim() == 1 else step
        if step.shape not in ((B, 1), (B, T)):
            raise ValueError(f"step_mask must be [B={B}] or [B, T={T}], got {tuple(step_mask.shape)}")
        keep = keep & (step > 0)
    return keep.float()                                               # [B, T]


# ------------------------------------------------------------------------------ the step's tensors
@dataclass
class StepTensors:
    """What the trainer computes per response token during one step, each [B, T] float32 aligned with
    PaddedBatch.response_ids. None until the stage that computes it runs — and always None when the
    step's plan does not need it (nanorl/plan.py): nothing here is computed "just in case"."""
    old_logprobs: Tensor | None = None  # [B, T] log π_old: the policy before the update (recompute)
    ref_logprobs: Tensor | None = None  # [B, T] log π_ref: the reference model, for a KL term
    teacher_logprobs: Tensor | None = None  # [B, T] log π_teacher of the sampled tokens (--teacher)
    old_values: Tensor | None = None  # [B, T] V_old: the critic before the update (GAE)
    old_entropy: Tensor | None = None  # [B, T] entropy of π_old (the 80/20 rule's token selection)
    sum_sq_probs: Tensor | None = None  # [B, T] Σ_v π_old(v)² over the vocabulary (OTB)
    is_weights: Tensor | None = None  # [B, T] π_old/π_rollout, truncated or masked (TIS / MIS)
    turn_rewards: Tensor | None = None  # [B, T] an environment's reward on each turn's last token
    advantages: Tensor | None = None  # [B, T] the estimator's advantages
    returns: Tensor | None = None  # [B, T] the estimator's returns (the critic's targets)
    cov_selected: Tensor | None = None  # [B, T] the tokens KL-Cov / Clip-Cov act on (a loss's selection)
    trainer_logprobs: Tensor | None = None  # [B, T] π before the update as the recompute scored it (dumps)
    trainer_entropy: Tensor | None = None  # [B, T] its entropy (dumps)
    first_pass_logprobs: Tensor | None = None  # [B, T] each row's first forward of the update
    first_pass_entropy: Tensor | None = None  # [B, T] its entropy
    first_pass_mask: Tensor | None = None  # [B, T] 1 on the rows a first forward covered

    def items(self):
        """(name, tensor) of every field that is set."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def update(self, **tensors: Tensor) -> None:
        for name, value in tensors.items():
            if name not in self.__dataclass_fields__:
                raise AttributeError(f"StepTensors has no field {name!r}")
            setattr(self, name, value)


# ------------------------------------------------------------------------------ the padded batch
@dataclass
class PaddedBatch:
    """A batch of ragged samples in one padded layout.

    Units. The *token* is the unit the loss is defined over: per-token tensors are [B, T] over RESPONSE
    tokens only (prompt tokens are not actions). A *step* is one model call in an agent loop (one
    assistant message of a tool-using episode), a *turn* one user → assistant exchange. Rewards usually
    arrive per trajectory and the advantage estimator spreads them over tokens; step-level switches
    (`step_mask`, a message's `step_loss_mask`) turn off every token of one step.

    Masks, not to be confused:
      * response mask — positions holding a token the policy produced: 1 up to and including the first
        EOS (stopping is an action the model must learn), 0 after.
      * padding mask — positions that exist at all once ragged samples share one width.
      * valid (loss) mask — response ∩ non-padding ∩ per-token loss mask ∩ optional filters (drop
        truncated samples, DAPO's overlong filtering; drop a step). Only it enters losses and metrics.
      * attention mask — which INPUT tokens the model may attend to: prompt, user turns, tool outputs.
        Context the model must SEE is not what it is trained to PRODUCE: in a multi-turn chat, training
        on user or tool tokens would teach the policy to imitate the environment, so the loss mask keeps
        assistant content only (plus its end-of-turn token) while attention covers everything.

    Layouts. Padded: prompts LEFT-padded to width P, responses RIGHT-padded to width T, so response
    token t of every row sits at column P + t and is predicted by the logits at column P - 1 + t — one
    slice `logits[:, P-1:P+T-1]` serves the whole batch (verl's layout). Packed (varlen): the real tokens
    of all rows in one row of N tokens, position ids restarting at 0 per sample, `cu_seqlens` marking
    the boundaries (what flash-attention's varlen kernels take); no compute is spent on padding.
    `pack` / `unpack` convert between the two without losing anything.

    Choices:
      * A response of length 0 is ALLOWED (an aborted request may return nothing): its row is padding
        and contributes no token. An empty prompt is rejected: response token 0 is predicted from the
        last prompt token, so there must be one (use BOS).
      * `chat_tokens_and_mask` includes the end-of-turn token the template writes right after an
        assistant content (<|im_end|>, <|eot_id|>, …), as slime's multi-turn masks do: the model must
        learn to stop. A token straddling a span boundary is in the span if its character offsets
        intersect it; for the excluded <think> span too, so exclusion wins for a token straddling
        "</think>" and the answer.
    """
    input_ids: Tensor          # [B, P+T] long, prompt left-padded to P, response right-padded to T
    attention_mask: Tensor     # [B, P+T] long, 1 on real tokens
    position_ids: Tensor       # [B, P+T] long, (cumsum(attention_mask) - 1).clamp(min=0)
    prompt_width: int          # P: response token t is input_ids[:, P+t], predicted at column P-1+t
    response_ids: Tensor       # [B, T] long
    response_mask: Tensor      # [B, T] float32, real response tokens ∩ Sample.loss_mask
    rollout_logprobs: Tensor   # [B, T] float32, 0 where absent or padded
    rewards: Tensor            # [B] float32 total reward
    reward_components: dict[str, Tensor]  # name -> [B] float32
    truncated: Tensor          # [B] bool
    group_ids: Tensor          # [B] long
    weight_versions: Tensor    # [B] long
    routed_experts: Tensor | None = None    # [B, P+T, L, k] long aligned with input_ids columns
    routed_mask: Tensor | None = None       # [B, P+T] bool, True where routed_experts was recorded
    sampling_support: Tensor | None = None  # [B, T, K] long, -1 pad
    tensors: StepTensors = field(default_factory=StepTensors)  # what the trainer computes per token
    metadata: list[dict] = field(default_factory=list)  # Sample.metadata per row (user advantages / losses)

    @property
    def num_tokens(self) -> Tensor:
        return self.response_mask.sum()

    @property
    def prompt_lens(self) -> Tensor:  # [B] long
        return self.attention_mask[:, :self.prompt_width].sum(1)

    @property
    def response_lens(self) -> Tensor:  # [B] long
        return self.attention_mask[:, self.prompt_width:].sum(1)

    def select(self, rows) -> "PaddedBatch":
        """Rows (indices or a [B] bool mask) → a new batch, columns that are padding in every selected
        row trimmed (from the left on the prompt side, from the right on the response side)."""
        idx = torch.as_tensor(rows, device=self.input_ids.device)
        idx = idx.nonzero().squeeze(1) if idx.dtype == torch.bool else idx.long().reshape(-1)
        if idx.numel() == 0:
            raise ValueError("PaddedBatch.select got no rows")
        B, P, T = self.response_ids.shape[0], self.prompt_width, self.response_ids.shape[1]
        for k, v in self.tensors.items():
            if v.shape[:2] != (B, T):
                raise ValueError(f"tensors.{k} must be [B={B}, T={T}, ...], got {tuple(v.shape)}")
        am = self.attention_mask[idx]                                 # [b, P+T]
        new_p, new_t = int(am[:, :P].sum(1).max()), int(am[:, P:].sum(1).max())
        inp, resp = slice(P - new_p, P + new_t), slice(0, new_t)
        cut = dict(input_ids=inp, attention_mask=inp, position_ids=inp, routed_experts=inp, routed_mask=inp,
                   response_ids=resp, response_mask=resp, rollout_logprobs=resp, sampling_support=resp)
        out = {"prompt_width": new_p}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "metadata":  # per-row dicts, selected like rows (shared, not copied)
                v = [v[i] for i in idx.tolist()] if v else []
            elif isinstance(v, StepTensors):  # [B, T, ...]: rows, then the response columns kept
                v = StepTensors(**{k: x[idx][:, resp] for k, x in v.items()})
            elif isinstance(v, dict):  # reward_components: [B]
                v = {k: x[idx] for k, x in v.items()}
            elif isinstance(v, Tensor):
                v = v[idx][:, cut[f.name]] if f.name in cut else v[idx]
            out.setdefault(f.name, v)
        return PaddedBatch(**out)

    def to(self, device) -> "PaddedBatch":
        def move(v):
            if isinstance(v, StepTensors):
                return StepTensors(**{k: x.to(device) for k, x in v.items()})
            if isinstance(v, dict):
                return {k: x.to(device) for k, x in v.items()}
            return v.to(device) if isinstance(v, Tensor) else v
        return PaddedBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


def collate(samples: list[Sample], pad_id: int) -> PaddedBatch:
    """Ragged samples → one PaddedBatch (prompts left-padded to P, responses right-padded to T).

    rewards[b] = total reward; dict rewards also fill reward_components (a missing name counts 0).
    Every status is collated alike: drop aborted samples before collating if they must not train.
    """
    if not samples:
        raise ValueError("collate() got an empty list of samples")
    B, P = len(samples), max(len(s.prompt_ids) for s in samples)
    T = max(s.response_length for s in samples)
    experts = [s.routed_experts for s in samples if s.routed_experts is not None]
    if len({tuple(e.shape[1:]) for e in experts}) > 1:
        raise ValueError(f"routed_experts [n, L, k] disagree on (L, k): "
                         f"{sorted({tuple(e.shape[1:]) for e in experts})}")
    supports = [s.sampling_support for s in samples if s.sampling_support is not None]
    # Build plain lists and convert once: one torch.tensor call per field, not one per sample.
    ids, attn, resp_mask, logps = [], [], [], []
    for s in samples:
        p, r = len(s.prompt_ids), s.response_length
        ids.append([pad_id] * (P - p) + list(s.prompt_ids) + list(s.response_ids) + [pad_id] * (T - r))
        attn.append([0] * (P - p) + [1] * (p + r) + [0] * (T - r))
        resp_mask.append((list(s.loss_mask) if s.loss_mask is not None else [1.0] * r) + [0.0] * (T - r))
        lp = list(s.rollout_logprobs) if s.rollout_logprobs is not None else [0.0] * r
        logps.append(lp + [0.0] * (T - r))
    input_ids = torch.tensor(ids, dtype=torch.long)                   # [B, P+T]
    attention_mask = torch.tensor(attn, dtype=torch.long)             # [B, P+T]
    response_mask = torch.tensor(resp_mask, dtype=torch.float32).reshape(B, T)   # [B, T]
    rollout_logprobs = torch.tensor(logps, dtype=torch.float32).reshape(B, T)    # [B, T]
    routed = torch.zeros(B, P + T, *experts[0].shape[1:], dtype=torch.long) if experts else None
    routed_mask = torch.zeros(B, P + T, dtype=torch.bool) if experts else None
    K = max((x.shape[1] for x in supports), default=0)
    support = torch.full((B, T, K), -1, dtype=torch.long) if supports else None  # all -1: no restriction
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), s.response_length
        if s.routed_experts is not None:  # sample position i (prompt, then response) is column P - p + i
            n = s.routed_experts.shape[0]
            routed[b, P - p:P - p + n] = s.routed_experts.long()
            routed_mask[b, P - p:P - p + n] = True
        if s.sampling_support is not None:
            support[b, :r, :s.sampling_support.shape[1]] = s.sampling_support.long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)       # [B, P+T]

    # Rewards: a scalar, or named components (GDPO normalises each separately) summed into the total.
    is_dict = [isinstance(s.reward, dict) for s in samples]
    if any(is_dict) and any(not d and s.reward is not None for d, s in zip(is_dict, samples)):
        raise ValueError("collate: some rewards are dicts and some are scalars; use one kind per batch")
    names = list(dict.fromkeys(k for s in samples if isinstance(s.reward, dict) for k in s.reward))
    components = {n: torch.tensor([float(s.reward.get(n, 0.0)) if isinstance(s.reward, dict) else 0.0
                                   for s in samples]) for n in names}  # missing component -> 0

    return PaddedBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, prompt_width=P,
        response_ids=input_ids[:, P:].clone(), response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        rewards=torch.tensor([s.total_reward for s in samples], dtype=torch.float32),
        reward_components=components,
        truncated=torch.tensor([s.status == "truncated" for s in samples], dtype=torch.bool),
        group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
        weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
        routed_experts=routed, routed_mask=routed_mask, sampling_support=support,
        metadata=[s.metadata for s in samples])


# ------------------------------------------------------------------------------ the packed batch
@dataclass
class PackedBatch:
    input_ids: Tensor       # [1, N] real tokens of all rows, concatenated
    position_ids: Tensor    # [1, N] restart at 0 for every sample
    cu_seqlens: Tensor      # [B+1] int32, sample b is positions cu_seqlens[b] .. cu_seqlens[b+1]-1
    max_seqlen: int
    prompt_lens: Tensor     # [B] long
    response_lens: Tensor   # [B] long
    routed_experts: Tensor | None = None  # [1, N, L, k] long
    routed_mask: Tensor | None = None     # [1, N] bool


def pack(batch: PaddedBatch) -> PackedBatch:
    """PaddedBatch → one varlen row without padding. Each row's real tokens are contiguous (left pad,
    prompt, response, right pad), so boolean indexing in row-major order concatenates them."""
    keep = batch.attention_mask.bool()                               # [B, P+T]
    lens = keep.sum(1)                                               # [B]
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = lens.cumsum(0)
    moe = batch.routed_experts is not None
    return PackedBatch(
        input_ids=batch.input_ids[keep][None], position_ids=batch.position_ids[keep][None],
        cu_seqlens=cu, max_seqlen=int(lens.max()),
        prompt_lens=batch.prompt_lens, response_lens=batch.response_lens,
        routed_experts=batch.routed_experts[keep][None] if moe else None,
        routed_mask=batch.routed_mask[keep][None] if moe else None)


def packed_response_index(packed: PackedBatch, T: int | None = None) -> tuple[Tensor, Tensor]:
    """→ (index [B, T] long, valid [B, T] bool): index[b, t] is the packed position whose output
    predicts response token t of sample b (its previous token), valid marks t < response length.
    Use it to gather per-response-token inputs (e.g. sampling_support) into the packed layout."""
    R = packed.response_lens                                          # [B]
    t_max = int(R.max())
    T = t_max if T is None else T
    if T < t_max:
        raise ValueError(f"T={T} is shorter than the longest response ({t_max})")
    t = torch.arange(T, device=R.device)
    start = packed.cu_seqlens[:-1].long() + packed.prompt_lens - 1    # [B] predicts response token 0
    valid = t[None, :] < R[:, None]                                   # [B, T]
    return torch.where(valid, start[:, None] + t[None, :], 0), valid


def unpack(values: Tensor, packed: PackedBatch, T: int | None = None) -> Tensor:
    """values [N] or [1, N] — position j holds the value for predicting token j+1 (log-probs,
    entropies, values) → [B, T] aligned with response_ids, exactly 0 on padding (even if the
    packed values there are NaN). Differentiable."""
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]
    N = packed.input_ids.shape[1]
    if values.shape != (N,):
        raise ValueError(f"unpack needs values [N={N}] or [1, N], got {tuple(values.shape)}")
    index, valid = packed_response_index(packed, T)
    return torch.where(valid, values[index], torch.zeros((), dtype=values.dtype, device=values.device))


# ----------------------------------------------------------------- multi-turn chat loss masks

_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use characters: never in real text


def _content_spans(messages: list[dict], tokenizer, text: str) -> list[tuple[int, int, int]]:
    """(message index, start, end) character span of each assistant content in the rendered text.

    Exact path: render again with every assistant content replaced by a unique marker; the text
    between markers is the template's scaffolding (role headers, end tokens, other messages), and
    walking it through the real text delimits each content even when the content is a substring of
    a header ("a" in "assistant"). A template whose scaffolding depends on the content (e.g. one
    that reformats a <think> block) falls back to finding each content, in order, in the text.
    """
    asst = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if any(not isinstance(messages[i].get("content"), str) for i in asst):
        raise ValueError("chat_tokens_and_mask: every assistant message needs a string content")
    if not asst:
        return []
    marks = {i: f"\ue000{n}\ue001" for n, i in enumerate(asst)}
    probe = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
    probe_text = tokenizer.apply_chat_template(probe, tokenize=False)
    pieces = _MARK.split(probe_text)[0::2]
    found = [int(n) for n in _MARK.findall(probe_text)]
    if found == list(range(len(asst))) and all(pieces[1:-1]) and text.startswith(pieces[0]):
        pos, spans = len(pieces[0]), []
        for k, piece in enumerate(pieces[1:], 1):
            last = k == len(pieces) - 1
            end = len(text) - len(piece) if last else text.find(piece, pos)
            if end < pos or (last and not text.endswith(piece)):
                break
            spans.append((asst[k - 1], pos, end))
            pos = end + len(piece)
        else:
            return spans
    pos, spans = 0, []  # fallback: each content in order, stripped if the template trims it
    for i, m in enumerate(messages):
        c = m.get("content")
        if not isinstance(c, str) or not c.strip():
            continue
        c = c if text.find(c, pos) >= 0 else c.strip()
        at = text.find(c, pos)
        if at < 0 and i in asst:
            raise ValueError(f"message {i}: the assistant content does not occur in the rendered chat "
                             f"template (the template rewrites it), so it cannot be masked")
        if at >= 0:
            spans += [(i, at, at + len(c))] if i in asst else []
            pos = at + len(c)
    return spans


def chat_tokens_and_mask(messages: list[dict], tokenizer, exclude_think: bool = False
                         ) -> tuple[list[int], list[int]]:
    """messages [{role, content, optional step_loss_mask: 0|1}] → (ids, mask), mask 1 on assistant tokens.

    The template is rendered to text, tokenized once with character offsets, and a token is in the
    mask when its offsets intersect an assistant content span (+ the special end-of-turn token the
    template writes right after it). Messages with step_loss_mask 0 are left out, and with
    exclude_think a leading <think>…</think> of an assistant content is left out too. Works with any
    tokenizer offering `apply_chat_template(messages, tokenize=False)` and
    `tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)`.
    Note: re-tokenizing rendered text may split differently from the tokens the model generated;
    for on-policy RL keep the generated ids, use this for data that only exists as text.
    """
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"message {i} must be a dict with a 'role'")
        if m.get("step_loss_mask", 1) not in (0, 1):
            raise ValueError(f"message {i}: step_loss_mask must be 0 or 1, got {m['step_loss_mask']!r}")
    clean = [{k: v for k, v in m.items() if k != "step_loss_mask"} for m in messages]
    text = tokenizer.apply_chat_template(clean, tokenize=False)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    if callable(getattr(tokenizer, "get_added_vocab", None)):
        special |= set(tokenizer.get_added_vocab())  # chat end tokens are added tokens

    keep, drop = [], []
    for i, s, e in _content_spans(clean, tokenizer, text):
        if messages[i].get("step_loss_mask", 1) == 0:
            continue
        end = e
        nxt = next((o for o in offsets if o[0] >= e and o[1] > o[0]), None)  # first token after content
        if nxt is not None and nxt[0] == e and text[nxt[0]:nxt[1]] in special:
            end = nxt[1]
        keep.append((s, end))
        body = text[s:e]
        if exclude_think and body.lstrip().startswith("<think>"):
            a = s + len(body) - len(body.lstrip())
            close = text.find("</think>", a, e)
            drop.append((a, e if close < 0 else close + len("</think>")))  # unclosed: all thought

    def hits(o, spans):  # a token intersects a span: overlapping character ranges, both non-empty
        return any(o[0] < b and o[1] > a for a, b in spans)
    mask = [int(hits(o, keep) and not hits(o, drop)) for o in offsets]
    return ids, mask
