"""The update: from a scored batch with advantages to new weights (loss → backward → optimizer step).

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
                                                       ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

`train_on` runs `ppo_epochs` passes over a rollout batch, each split into `mini_batches` optimizer
steps, each of those split into micro-batches that fit in memory (`micro_batches`: a sample count or
a balanced token budget). The loss of every micro-batch is aggregated with the denominators of the
WHOLE optimizer step (valid tokens and sequences, summed over micro-batches and ranks), so the
accumulated gradient does not depend on how the step was split (TRL #3021). Gradients are
summed over ranks by DDP (nanorl/distributed.py), clipped, and applied — unless the loss or a
gradient is not finite, in which case the update is skipped and counted.

`forward` scores the response tokens (nanorl/policy.py; packed when a token budget is set and
flash-attention can run the packed row, nanorl/batching.py) and replays MoE routing when asked
(nanorl/moe_replay.py). `score_batch` runs the no-gradient recompute forwards (old policy, critic,
reference) over the same micro-batches, so no forward of the step ever sees more than one budget.
"""
from __future__ import annotations

import functools
import math

import torch

from nanorl import batching, moe_replay
from nanorl.distributed import loss_scale, sync_gradients_after
from nanorl.kl import kl_estimator
from nanorl.losses import LossConfig, total_loss
from nanorl.policy import response_logprobs


def forward(cfg, model, batch, support):
    """Logprobs and entropy [B, T] of the response tokens, replaying MoE routing when asked.

    With a token budget (--max-tokens-per-micro-batch) the rows are packed into one sequence, so the
    budget bounds the real tokens of a forward and no compute goes to padding (nanorl/batching.py)."""
    replay_on = cfg.routing_replay and batch.routed_experts is not None
    if cfg.max_tokens_per_micro_batch and batching.packs_varlen(model):
        return batching.packed_response_logprobs(model, batch, cfg.temperature, support=support,
                                                 impl=cfg.logprob_impl, replay=replay_on)
    replay = None
    if replay_on:
        replay = moe_replay.replay(model, batch.routed_experts, batch.routed_mask)
    return response_logprobs(model, batch, cfg.temperature, support=support,
                             impl=cfg.logprob_impl, replay=replay)


def routing_forward(run, batch, support, metrics: dict) -> torch.Tensor:
    """The old-logprob forward of an MoE run with --routing-replay; returns logprobs [B, T].

    R3 (the engine recorded routing at rollout, as the HF engine does): replay it, and measure how
    often the trainer's own router would have chosen differently — the mismatch replay removes.
    R2 (the engine could not record, e.g. vLLM on CPU): record the routing in this forward, and
    replay that in every later forward of the step (policy and reference)."""
    cfg = run.cfg
    if batch.routed_experts is not None:
        with moe_replay.replay(run.model, batch.routed_experts, batch.routed_mask) as rep:
            lp = response_logprobs(run.model, batch, cfg.temperature, support=support, impl=cfg.logprob_impl)[0]
        metrics["routing/disagreement"] = moe_replay.routing_disagreement(
            batch.routed_experts, rep.natural_experts, batch.routed_mask.cpu())
        metrics["routing/replay_mode"] = 3.0
        return lp
    with moe_replay.record(run.model) as rec:
        lp = response_logprobs(run.model, batch, cfg.temperature, support=support, impl=cfg.logprob_impl)[0]
    batch.routed_experts = rec.experts.to(batch.input_ids.device)  # [B, P+T, L, k]
    batch.routed_mask = batch.attention_mask.bool()  # [B, P+T]
    metrics["routing/disagreement"] = 0.0  # recorded by the trainer itself: nothing to compare
    metrics["routing/replay_mode"] = 2.0
    return lp


def micro_batches(run, batch) -> list[list[int]]:
    """Row groups of one batch: by token budget (packed: real tokens, balanced; padded: padded size),
    by sample count, or all at once."""
    cfg, n = run.cfg, batch.input_ids.shape[0]
    if cfg.max_tokens_per_micro_batch:
        budget, P = cfg.max_tokens_per_micro_batch, batch.prompt_width
        if batching.packs_varlen(run.model):
            lengths = batch.attention_mask.sum(-1).tolist()
            plan = functools.partial(batching.make_micro_batches, lengths, budget)
        else:
            prompts, responses = batch.attention_mask[:, :P].sum(-1).tolist(), batch.attention_mask[:, P:].sum(-1).tolist()
            plan = functools.partial(batching.make_padded_micro_batches, prompts, responses, budget)
        bins = plan()
        agreed = batching.agree_num_micro_batches(len(bins))  # every rank runs the same count
        return bins if agreed == len(bins) else plan(agreed)
    if cfg.micro_batch_size:
        return batching.split_fixed(n, cfg.micro_batch_size)
    return [list(range(n))]


@torch.no_grad()
def score_batch(run, module, batch, support):
    """The recompute forwards (old policy + critic through `run.trained`, or the reference model),
    micro-batch by micro-batch as training will run them: (logprobs [B, T], values [B, T] or None)."""
    groups = micro_batches(run, batch)
    if len(groups) == 1:  # the whole batch in one forward: nothing to split or scatter back
        logp, _, values = module(batch, support)
        return logp, values
    B, T = batch.response_ids.shape
    logp = torch.zeros(B, T, device=batch.input_ids.device)  # [B, T] padding stays 0
    values = None
    for rows in groups:
        mb = batch.select(rows)
        t = mb.response_ids.shape[1]  # select trims right padding: columns 0..t-1 of these rows
        lp, _, v = module(mb, mb.sampling_support if support is not None else None)
        idx = torch.as_tensor(rows, device=logp.device)
        logp[idx, :t] = lp
        if v is not None:
            values = torch.zeros(B, T, device=logp.device) if values is None else values  # [B, T]
            values[idx, :t] = v
    return logp, values


def loss_config(run) -> LossConfig:
    c = run.cfg
    return LossConfig(policy=c.policy_loss, clip_low=c.clip_low, clip_high=c.clip_high,
                      dual_clip=c.dual_clip or None, agg_mode=c.loss_agg, norm_len=c.max_new_tokens,
                      entropy_coef=c.entropy_coef, kl_coef=0.0 if c.kl_in_reward else run.kl_ctl.beta,
                      vf_coef=c.vf_coef, tis_cap=c.tis_cap or None, opsm_delta=c.opsm_delta or None,
                      icepop=(c.icepop_low, c.icepop_high) if c.icepop_high else None)


def train_on(run, batch) -> dict:
    """ppo_epochs × mini_batches optimizer steps on one rollout batch; returns averaged metrics."""
    cfg, B = run.cfg, batch.input_ids.shape[0]
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    lcfg, sums, steps = loss_config(run), {}, 0
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + run.step)
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(B, generator=gen) if cfg.mini_batches > 1 else torch.arange(B)
        for rows in order.tensor_split(cfg.mini_batches):  # exactly mini_batches optimizer steps
            if len(rows) == 0:  # fewer samples than mini-batches (one process; train.py guards ranks)
                continue
            mini = batch.select(rows.tolist())
            # Denominators of the whole optimizer step, over every micro-batch and rank (TRL #3021).
            n_tok, n_seq = batching.global_denominators([mini.response_mask])
            stats, groups = {}, micro_batches(run, mini)
            for i, mrows in enumerate(groups):
                with sync_gradients_after(run.trained, last=i == len(groups) - 1):  # DDP: one all-reduce
                    loss, m = micro_step(run, mini.select(mrows), lcfg, n_tok, n_seq)
                    loss = loss * loss_scale(run.world)  # DDP's mean over ranks → the global sum
                    (run.scaler.scale(loss) if run.scaler else loss).backward()  # fp16: scaled
                accumulate(stats, m)
            grad_norm = sync_and_step(run, params)
            stats = finish(stats)
            stats["grad_norm"] = grad_norm
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            steps += 1
    out = {k: v / steps for k, v in sums.items()}
    out.update(lr=run.scheduler.get_last_lr()[0], skipped_updates=run.counters["skipped_updates"])
    return out


def micro_step(run, mb, lcfg: LossConfig, n_tok: float, n_seq: float):
    cfg = run.cfg
    support = mb.sampling_support if cfg.keep_sampling_mask else None
    logp, ent, values = run.trained(mb, support)  # DDP-wrapped with several ranks (nanorl/distributed.py)
    td = mb.token_data
    old = td.get("old_logprobs", logp.detach())  # on-policy: π_old is the current policy, detached
    kl = None
    if run.ref is not None and not cfg.kl_in_reward:
        kl = kl_estimator(logp, td["ref_logprobs"], cfg.kl_estimator, mask=mb.response_mask)
    loss, m = total_loss(lcfg, logp, old, td["advantages"], mb.response_mask, entropy=ent, kl=kl,
                         rollout_logp=mb.rollout_logprobs, values=values, old_values=td.get("old_values"),
                         returns=td.get("returns") if values is not None else None,
                         num_tokens=n_tok, num_seqs=n_seq)
    # Train/rollout mismatch: share of tokens whose logprob differs by > 0.5 between the trainer and
    # the engine that sampled them (0 for the HF engine; a rise with vLLM means a broken sync).
    valid = mb.response_mask > 0  # [b, T]
    far = ((logp.detach() - mb.rollout_logprobs).abs() > 0.5) & valid  # [b, T]
    m["logprob_diff_gt_0.5_frac"] = far.sum() / valid.sum().clamp(min=1)
    return loss, m


# Metrics of total_loss: loss contributions are summed over micro-batches, *_max are maxed, the rest
# are token means weighted by each micro-batch's token count (opsm_maskfrac by sequence count).
SUMMED = ("loss", "pg_loss", "kl_loss", "vf_loss")


def accumulate(stats: dict, m: dict) -> None:
    w_tok, w_seq = float(m["num_tokens"]), float(m["num_seqs"])
    for k, v in m.items():
        v = float(v)
        if k in SUMMED or k in ("num_tokens", "num_seqs"):
            stats[k] = stats.get(k, 0.0) + v
        elif k.endswith("_max"):
            stats[k] = max(stats.get(k, -math.inf), v)
        else:
            w = w_seq if k == "opsm_maskfrac" else w_tok
            stats[k] = stats.get(k, 0.0) + v * w


def finish(stats: dict) -> dict:
    out = {}
    for k, v in stats.items():
        if k in SUMMED or k.endswith("_max") or k in ("num_tokens", "num_seqs"):
            out[k] = v
        else:
            out[k] = v / max(stats["num_seqs" if k == "opsm_maskfrac" else "num_tokens"], 1.0)
    return out


def sync_and_step(run, params) -> float:
    """Clip and step — unless the loss or a gradient is not finite. Gradients arrive summed over
    ranks (DDP, in the last backward), so every rank clips the same norm and takes the same step.
    fp16: the gradients are unscaled first; an overflow skips the step and lowers the loss scale."""
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.grad_clip if run.cfg.grad_clip else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards
    if torch.isfinite(norm) and run.scaler:
        run.scaler.step(run.optimizer)
    elif torch.isfinite(norm):
        run.optimizer.step()
    else:  # one bad batch must not poison the weights: skip, count, go on
        run.counters["skipped_updates"] += 1
        run.logger.print(f"step {run.step}: non-finite gradient norm ({float(norm)}); update skipped")
    if run.scaler:
        run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return float(norm)
