"""Scoring: the forwards of the policy, the reference and the critic over a collated batch, and the
no-gradient recompute (link 3 of the chain: logprob recompute) over the micro-batches training will use.

Start at `score_batch(run, module, batch, support)`: it splits the batch as the update will
(`micro_batches`: a sample count or a balanced token budget, the same count on every rank) and runs
`module` (the policy + critic behind `run.trained`, or the reference) on each piece. `forward` is one
policy forward: response logprobs and entropy [B, T], packed under a token budget (nanorl/batching.py),
MoE routing replayed (nanorl/moe_replay.py); `routing_forward` is the old-logprob pass of a
--routing-replay run. What these read of `run` is `Forwards` (the step's update.Learner, or the async
rollout worker's `Scoring`). The update (loss, backward, optimizer step) is
nanorl/update.py, whose forwards run through the same `micro_batches` (and `forward`, via run.trained).
"""
from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from nanorl import batching, moe_replay, precision
from nanorl.policy import record_sum_sq_probs, response_logprobs
from nanorl.trajectory import PaddedBatch, Sample, collate, pack


class Forwards(Protocol):
    """What this module reads of `run` (update.Learner, the step's training side, holds it all)."""
    cfg: Any  # nanorl/config.py Config: temperature, logprob_impl, token budget, micro-batch size, replay
    model: torch.nn.Module  # the policy (its device; whether it packs varlen micro-batches)
    tokenizer: Any  # its pad_token_id pads the lockstep rows
    world: int  # ranks that agree on the micro-batch count (1: one process, the async worker)


@dataclasses.dataclass
class Scoring:
    """The `Forwards` of a process that scores without training (the async rollout worker's reference
    logprobs): its config, the model whose device and packing the micro-batches follow, its tokenizer."""
    cfg: Any
    model: torch.nn.Module
    tokenizer: Any
    world: int = 1


def forward(cfg, model, batch, support):
    """Logprobs and entropy [B, T] of the response tokens, replaying MoE routing when asked.

    With a token budget (--max-tokens-per-micro-batch) the rows are packed into one sequence, so the
    budget bounds the real tokens of a forward and no compute goes to padding (nanorl/batching.py)."""
    replay_on = cfg.memory.routing_replay and batch.routed_experts is not None
    if cfg.memory.max_tokens_per_micro_batch and batching.packs_varlen(model):
        return batching.packed_response_logprobs(model, batch, cfg.sampling.temperature, support=support,
                                                 impl=cfg.memory.logprob_impl, replay=replay_on)
    replay = None
    if replay_on:
        replay = moe_replay.replay(model, batch.routed_experts, batch.routed_mask)
    return response_logprobs(model, batch, cfg.sampling.temperature, support=support,
                             impl=cfg.memory.logprob_impl, replay=replay)


@torch.no_grad()
def routing_forward(run: Forwards, batch, support, metrics: dict) -> torch.Tensor:
    """The old-logprob forward of an MoE run with --routing-replay; returns logprobs [B, T].

    R3 (the engine recorded routing at rollout, as the HF engine does): replay it, and measure how
    often the trainer's own router would have chosen differently — the mismatch replay removes.
    R2 (the engine could not record, e.g. vLLM on CPU): record the routing in this forward, and
    replay that in every later forward of the step (policy and reference).
    Run as training runs its forwards: micro-batch by micro-batch (`micro_batches`, the plan
    score_batch and the first epoch use), packed where training packs, under the run's autocast — so
    π_old is the very forward π_θ repeats on the first epoch (ratio 1), and no forward holds more
    than one micro-batch of activations. Routing is recorded / replayed per micro-batch and written
    back into the batch's [B, P+T, L, k] layout. Called on run.model (--fsdp with --routing-replay is
    refused: no collective runs here), so a lockstep pad (`[]`) has nothing to run."""
    cfg, model = run.cfg, run.model
    r3 = batch.routed_experts is not None
    device, dtype = batch.input_ids.device, precision.compute_dtype(cfg.memory.dtype)
    packed = bool(cfg.memory.max_tokens_per_micro_batch) and batching.packs_varlen(model)
    (B, T), P = batch.response_ids.shape, batch.prompt_width
    logp = torch.zeros(B, T, device=device)  # [B, T]
    experts = None  # [B, P+T, L, k]: R3 the trainer's own (natural) choice, R2 the recording
    groups = micro_batches(run, batch)
    for rows in groups:
        if not rows:
            continue
        mb = batch if len(groups) == 1 else batch.select(rows)
        sup = mb.sampling_support if support is not None else None
        src = pack(mb) if packed else mb  # replay ids in the layout the forward runs
        ctx = (moe_replay.replay(model, src.routed_experts, src.routed_mask) if r3
               else moe_replay.record(model))
        with ctx as rr, precision.autocast(device, dtype):
            if packed:
                lp = batching.packed_response_logprobs(model, mb, cfg.sampling.temperature, support=sup,
                                                       impl=cfg.memory.logprob_impl)[0]
            else:
                lp = response_logprobs(model, mb, cfg.sampling.temperature, support=sup,
                                       impl=cfg.memory.logprob_impl)[0]
        ids = rr.natural_experts if r3 else rr.experts  # [b, p+t, L, k], or [1, N, L, k] packed
        if packed:  # a packed row holds each sample's real tokens in row-major order (trajectory.pack)
            keep = mb.attention_mask.bool().cpu()  # [b, p+t]
            ids = ids.new_zeros(*keep.shape, *ids.shape[2:]).masked_scatter(keep[..., None, None], ids[0])
        if experts is None:
            experts = ids.new_zeros(B, batch.input_ids.shape[1], *ids.shape[2:])  # [B, P+T, L, k]
        t, p = lp.shape[1], mb.prompt_width  # select trims: prompt columns P-p.., response 0..t-1
        idx = torch.as_tensor(rows)
        logp[idx.to(device), :t] = lp
        experts[idx, P - p:P + t] = ids
    mask = batch.attention_mask.bool()  # [B, P+T]
    if r3:  # the trainer's choice was gathered on the CPU, the recorded ids sit on the batch's device
        recorded, seen = batch.routed_experts, batch.routed_mask  # [B, P+T, L, k], [B, P+T]
        natural = experts.to(recorded.device)  # [B, P+T, L, k]
        metrics["routing/disagreement"] = moe_replay.routing_disagreement(recorded, natural, seen)
        per_layer = moe_replay.routing_disagreement_by_layer(recorded, natural, seen)
        metrics.update({f"routing/disagreement/layer_{i}": v for i, v in enumerate(per_layer)})
        metrics["routing/replay_mode"] = 3.0
        return logp
    batch.routed_experts, batch.routed_mask = experts.to(device), mask  # [B, P+T, L, k], [B, P+T]
    metrics["routing/disagreement"] = 0.0  # recorded by the trainer itself: nothing to compare
    metrics.update({f"routing/disagreement/layer_{i}": 0.0 for i in range(experts.shape[2])})
    metrics["routing/replay_mode"] = 2.0
    return logp


def micro_batches(run: Forwards, batch: PaddedBatch | None) -> list[list[int]]:
    """Row groups of one batch (None: this rank holds no row of this optimizer step): by token budget
    (packed: real tokens, balanced; padded: padded size), by sample count, or all at once.

    The lockstep rule, for every mode: the count is agreed over ranks (all-reduce MAX) and a rank with
    fewer gets EMPTY groups `[]` at the end, each run as a zero-weight forward (and backward, in
    training: `pad_batch`, `pad_loss`). Padding rather than moving samples between ranks: moving would
    ship variable-length rows and every per-token tensor attached to them each step, and cannot help
    when the whole step holds fewer samples than ranks × micro-batches; a pad costs one 2-token pass,
    on a rank that would otherwise wait for the busiest, and leaves every real row where it was. One
    rank agrees with itself: no pad, the 1-rank result is unchanged. [] when no rank has a row."""
    cfg, n = run.cfg, 0 if batch is None else batch.input_ids.shape[0]
    if cfg.memory.max_tokens_per_micro_batch:  # the planners emit the empty groups themselves
        budget, P = cfg.memory.max_tokens_per_micro_batch, 0 if batch is None else batch.prompt_width
        am = batch.attention_mask.tolist() if batch is not None else []  # [B, P+T]
        if batching.packs_varlen(run.model):
            plan = functools.partial(batching.make_micro_batches, [sum(r) for r in am], budget)
        else:
            plan = functools.partial(batching.make_padded_micro_batches, [sum(r[:P]) for r in am],
                                     [sum(r[P:]) for r in am], budget)
    else:
        whole = [list(range(n))] if n else []
        own = batching.split_fixed(n, cfg.memory.micro_batch_size) if cfg.memory.micro_batch_size else whole

        def plan(count=None):
            return own + [[] for _ in range((count or 0) - len(own))]
    bins = plan()
    # every rank runs the same count; run.world, not the default group, says who trains: the async
    # worker (world 1) inherits the trainer's group through fork and must not enter its collectives
    agreed = batching.agree_num_micro_batches(len(bins)) if run.world > 1 else len(bins)
    return bins if agreed == len(bins) else plan(agreed)


def zero_weight_samples(pad_id: int, n: int) -> list[Sample]:
    """n samples that train nothing (1 prompt + 1 response token, loss mask 0, reward 0, one group):
    the batch of a rank that DAPO's filter left empty while other ranks train (train.py), so that it
    still runs the step's passes; a whole group, so group-wise estimators see their usual group size."""
    return [Sample(prompt_ids=[pad_id], response_ids=[pad_id], loss_mask=[0], reward=0.0, group_id=-1)
            for _ in range(n)]


def pad_batch(run: Forwards) -> PaddedBatch:
    """What an empty group runs forward: one zero-weight row."""
    pad = run.tokenizer.pad_token_id
    return collate(zero_weight_samples(pad, 1), pad).to(next(run.model.parameters()).device)


@torch.no_grad()
def score_batch(run: Forwards, module, batch, support, sum_sq: bool = False):
    """The recompute forwards (old policy + critic through `run.trained`, or the reference model),
    micro-batch by micro-batch as training will run them: (logprobs [B, T], values [B, T] or None,
    entropy [B, T], Σπ² [B, T] or None). sum_sq: also Σ_v π_v² per token, a by-product of the same
    fused pass (nanorl/policy.py record_sum_sq_probs; the optimal token baseline reads it)."""
    groups = micro_batches(run, batch)
    if batch is None:  # no row here (score_rows): the lockstep pads only
        for _ in groups:
            module(pad_batch(run), None)
        return None, None, None, None
    B, T = batch.response_ids.shape
    out = [torch.zeros(B, T, device=batch.input_ids.device) for _ in range(4)]  # logp, values, ent, Σπ²
    has_values = False
    for rows in groups:
        if not rows:  # a lockstep pad (micro_batches): the same collectives, its outputs dropped
            module(pad_batch(run), None)
            continue
        mb = batch if len(groups) == 1 else batch.select(rows)
        t = mb.response_ids.shape[1]  # select trims right padding: columns 0..t-1 of these rows
        with record_sum_sq_probs() if sum_sq else nullcontext() as rec:
            lp, ent, v = module(mb, mb.sampling_support if support is not None else None)
        idx = torch.as_tensor(rows, device=out[0].device)
        out[0][idx, :t], out[2][idx, :t] = lp, ent
        if v is not None:
            out[1][idx, :t], has_values = v, True
        if sum_sq:  # one LM-head call per forward, its tokens in row-major order of the real ones
            real = mb.attention_mask[:, mb.prompt_width:].bool()                # [b, t]
            out[3][idx, :t] = torch.zeros(real.shape, device=real.device).masked_scatter(real, torch.cat(rec))
    return out[0], out[1] if has_values else None, out[2], out[3] if sum_sq else None


def score_rows(run: Forwards, module, batch, support, rows: torch.Tensor) -> torch.Tensor:
    """score_batch's logprobs [B, T] for the rows marked in `rows` [B] only, 0 in the others (which no
    loss reads: --skip-zero-advantage skips them in training too)."""
    keep = rows.nonzero().flatten().tolist()
    if len(keep) == len(rows):
        return score_batch(run, module, batch, support)[0]
    sub = batch.select(keep) if keep else None
    out = torch.zeros(batch.response_ids.shape, device=batch.input_ids.device)  # [B, T]
    lp = score_batch(run, module, sub, support)[0]
    if sub is not None:
        out[keep, :lp.shape[1]] = lp
    return out
