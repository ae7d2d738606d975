"""The update, links 5-7 of the chain (loss → backward → optimizer step): a scored batch with
advantages becomes new weights.

`train_on` runs `ppo_epochs` passes over a rollout batch, each split into `mini_batches` optimizer
steps, each of those into micro-batches that fit in memory (`micro_batches`: a sample count or a
balanced token budget). Start there, then `micro_step` (one micro-batch's loss) and `sync_and_step`;
what they read is `Learner`, the training side's record (train.py builds it from its Run).
Key choices: every micro-batch's loss takes the denominators of the WHOLE optimizer step (summed over
micro-batches and ranks), so the gradient does not depend on how the step was split (TRL #3021), and
the token selections some losses make are made once per optimizer step (`select_tokens`); a
non-finite loss or gradient skips the update and counts it; every rank runs the same number of
forwards and backwards (FSDP all-gathers in each), `micro_batches` alone decides the count.
The forwards it runs and the no-gradient scoring over the same micro-batches (`micro_batches`,
`forward`, `score_batch`) are nanorl/scoring.py's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from nanorl import batching, precision
from nanorl.distributed import loss_scale, sync_gradients_after
from nanorl.kl import kl_loss_term
from nanorl.losses import POLICY_LOSSES, LossConfig, top_entropy_mask, total_loss
from nanorl.offpolicy import is_weights, opsm_mask
from nanorl.scoring import micro_batches, pad_batch


@dataclasses.dataclass
class Learner:
    """The training side of one step, what the update and the stages after the rollout read (train.py
    builds it from its Run each step; tests/test_module_inputs.py runs the update on one built by hand).
    train_on changes optimizer, scheduler, scaler and counters, nothing else."""
    cfg: Any  # nanorl/config.py Config: the update's flags (epochs, mini-batches, the loss's knobs)
    model: torch.nn.Module  # the policy, fp32 master weights
    trained: torch.nn.Module  # policy (+ critic) behind one forward, DDP/FSDP-wrapped (nanorl/distributed.py)
    ref: torch.nn.Module | None  # the frozen reference (a KL term), else None
    teacher: torch.nn.Module | None  # --teacher, scored beside the policy (nanorl/teacher.py), else None
    tokenizer: Any  # its pad_token_id pads the lockstep rows
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None  # fp16 only
    kl_ctl: Any  # nanorl/kl.py controller: .beta, the KL loss's coefficient
    counters: dict  # "skipped_updates" is counted here
    logger: Any  # .print(str): a skipped update is reported; .optimizer_step(step, row): several per rollout
    step: int  # seeds the per-step selections and the mini-batch order
    world: int  # ranks (1: one process)
    rank: int = 0  # this process's (rank 0 writes the rollout dumps)


def pad_loss(outputs) -> torch.Tensor:
    """A zero-weight loss over a forward's outputs (logprobs, entropy, values): its backward reaches
    every parameter the forward used — so DDP and FSDP run their gradient collectives — and adds
    exactly 0 to each gradient: torch.where, not a product, so an inf/NaN output still sends back 0."""
    off = [torch.where(torch.zeros_like(t, dtype=torch.bool), t.float(), 0.0).sum()
           for t in outputs if t is not None]
    return torch.stack(off).sum()


def loss_config(learner: Learner) -> LossConfig:
    c = learner.cfg
    # LossConfig's fields named as flags (clip_low, clip_high, entropy_coef, vf_coef) are read by name;
    # the rest is what the run decides: the loss itself (a registry name, or the user function
    # --policy-loss names), its own settings (declared with it: nanorl/losses.py), dual-clip 0 = off,
    # the length of seq-mean-token-sum-norm, and β (the KL controller's; 0 when the KL is in the reward)
    flags = c.as_flags()
    named = {f.name: flags[f.name] for f in dataclasses.fields(LossConfig) if f.name in flags}
    decided = dict(policy=c.policy_loss_fn, params=c.loss_params.params_for(c.policy_loss),
                   dual_clip=c.dual_clip or None, agg_mode=c.loss_agg, norm_len=c.max_new_tokens,
                   kl_coef=0.0 if c.kl.kl_in_reward else learner.kl_ctl.beta)
    return LossConfig(**{**named, **decided})


def select_tokens(learner: Learner, mini, step_index: int, lcfg: LossConfig) -> None:
    """Token selections made once per optimizer step over the whole step (so micro-batching changes
    nothing), from the recompute pass (π_old: π_θ itself at the first pass): the 80/20 rule's top-q
    entropy tokens become the step's loss mask (denominators included, as the authors' fork does);
    kl_cov / clip_cov get their covariance-selected tokens (nanorl/losses.py)."""
    cfg, t = learner.cfg, mini.tensors
    if cfg.top_entropy_quantile:
        keep = top_entropy_mask(t.old_entropy, mini.response_mask, cfg.top_entropy_quantile)  # [b, T]
        mini.response_mask = mini.response_mask * keep
    loss = POLICY_LOSSES.get(cfg.policy_loss)  # None: a user loss (nanorl/plugins.py), no selection
    if loss is not None and loss.select is not None:
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + learner.step) * 1009 + step_index)
        t.cov_selected = loss.select(t.old_logprobs, t.advantages, mini.response_mask, lcfg, gen)


def train_on(learner: Learner, batch) -> dict:
    """ppo_epochs × mini_batches optimizer steps on one rollout batch; returns averaged metrics."""
    cfg, B = learner.cfg, batch.input_ids.shape[0]
    params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    lcfg, sums, counts, steps = loss_config(learner), {}, {}, 0
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + learner.step)
    first = {k: torch.zeros_like(batch.response_mask, dtype=torch.float) for k in FIRST_PASS}  # [B, T] each
    for epoch in range(cfg.optim.ppo_epochs):
        order = torch.randperm(B, generator=gen) if cfg.optim.mini_batches > 1 else torch.arange(B)
        for rows in order.tensor_split(cfg.optim.mini_batches):  # at most mini_batches optimizer steps
            mini = batch.select(rows.tolist()) if len(rows) else None  # None: no row of this step here
            groups = micro_batches(learner, mini)  # agreed over ranks: pads where this rank has fewer
            if not groups:  # no rank holds a row of this step (fewer samples than mini-batches): no step
                continue
            if mini is not None:
                select_tokens(learner, mini, steps, lcfg)
            # Denominators of the whole optimizer step, over every micro-batch and rank (TRL #3021).
            n_tok, n_seq = batching.global_denominators([mini.response_mask] if mini is not None else [])
            # after the denominators: skipped rows keep their share of them
            skip_stats = {}  # --skip-zero-advantage: the share of this step's rows it skipped
            if cfg.memory.skip_zero_advantage:
                mini, rows, skip_stats["rows_skipped_frac"] = skip_zero_advantage(mini, rows)
                groups = micro_batches(learner, mini)  # re-planned (and agreed again) over the training rows
            if not groups:  # every row skipped: the whole batch's gradient is exactly 0, and AdamW
                for p in params:  # still steps on it (its moments move the weights), as unskipped
                    p.grad = torch.zeros_like(p)
            stats = {}
            for i, mrows in enumerate(groups):
                # one gradient reduction per step, in the last micro-batch's backward
                with sync_gradients_after(learner.trained, last=i == len(groups) - 1):
                    if mrows:
                        mb = mini.select(mrows)
                        loss, m = micro_step(learner, mb, lcfg, n_tok, n_seq)
                        if epoch == 0:  # each row's first forward of the update (old_policy_view)
                            mb.tensors.first_pass_mask = torch.ones_like(mb.response_mask, dtype=torch.float)
                            for k in FIRST_PASS:
                                first[k][rows[mrows], :mb.response_ids.shape[1]] = getattr(mb.tensors, k)
                    else:  # a lockstep pad: the collectives of a micro-batch, zero gradient
                        loss, m = pad_loss(learner.trained(pad_batch(learner), None)), None
                    loss = loss * loss_scale(learner.world)  # DDP's mean over ranks → the global sum
                    # a non-finite loss can have finite gradients (a NaN outside the graph, a NaN clamp
                    # bound): NaN them, so that sync_and_step's norm check skips the step on every rank
                    # (gradients are reduced over ranks); x 1.0 leaves a finite loss's bits as they are
                    loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)
                    (learner.scaler.scale(loss) if learner.scaler else loss).backward()  # fp16: scaled
                if m is not None:
                    accumulate(stats, m)
            stats = finish(stats) if stats else {}  # a rank that ran only pads has no loss metrics
            stats.update(grad_norm=sync_and_step(learner, params), **skip_stats)
            for k, v in stats.items():
                sums[k], counts[k] = sums.get(k, 0.0) + v, counts.get(k, 0) + 1
            steps += 1
            if cfg.optim.ppo_epochs * cfg.optim.mini_batches > 1:  # several per rollout: each on its own axis
                learner.logger.optimizer_step(learner.step + 1, {"opt_step": learner.scheduler.last_epoch,
                                                                 "epoch": epoch, **stats})
    batch.tensors.update(**first)
    return {**{k: v / counts[k] for k, v in sums.items()}, "lr": learner.scheduler.get_last_lr()[0],
            "skipped_updates": learner.counters["skipped_updates"]}


FIRST_PASS = ("first_pass_logprobs", "first_pass_entropy", "first_pass_mask")  # mask: rows it covered


def trains(batch) -> torch.Tensor:
    """[B] bool: rows with a non-zero advantage on some valid token — the rows --skip-zero-advantage
    trains (a GRPO group whose rewards are all equal has advantage 0 on every token)."""
    return ((batch.tensors.advantages != 0) & (batch.response_mask > 0)).any(-1)  # [B]


def skip_zero_advantage(mini, rows):
    """(the rows of `mini` that train, their indices in the rollout batch, the share skipped).

    A row whose advantage is 0 at every token adds exactly 0 to the policy-gradient loss and its
    gradient (ratio · 0, clipped or not), so its forward and backward can go, provided the loss keeps
    the whole step's denominators (train_on computes them first). What the row would still add: its
    KL-to-reference and entropy-bonus gradients (and its value loss), which skipping drops — see
    Config.flag_default('skip_zero_advantage')."""
    if mini is None:
        return None, rows, 0.0
    keep = trains(mini).nonzero().flatten()  # [k]
    share = 1.0 - len(keep) / len(rows)
    if len(keep) == len(rows):
        return mini, rows, share
    return (mini.select(keep.tolist()) if len(keep) else None), rows[keep.cpu()], share


def old_policy_view(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """π_old as the TRAINER computed it, logprobs and entropy [B, T], for the mismatch metrics and the
    rollout dumps (never the engine's numbers), and where it was computed, covered [B, T] float: the
    recompute pass when it ran (`trainer_logprobs`, set in train.py; every row), else each row's first
    forward of the update (`first_pass_*`, train_on; not the rows --skip-zero-advantage skipped, which
    no forward scored: covered 0, their values are not π_old). The recompute is skipped only on-policy
    (one epoch, one mini-batch): that single pass runs before the only optimizer step, so it IS π_old.
    Caveat: --old-logprobs rollout with several mini-batches skips the recompute too, and rows of
    later mini-batches are then scored after earlier steps."""
    t = batch.tensors
    if t.trainer_logprobs is not None:
        return t.trainer_logprobs, t.trainer_entropy, torch.ones_like(t.trainer_logprobs)
    return t.first_pass_logprobs, t.first_pass_entropy, t.first_pass_mask


def step_is_weights(cfg, old_logp, rollout_logp, mask):
    """--tis-cap / --mis-high's weights ρ = π_old/π_rollout [B, T] (with `changed` and the raw `rho`,
    for is_metrics), at --is-level (nanorl/offpolicy.py is_weights)."""
    return is_weights(old_logp, rollout_logp, mask, level=cfg.offpolicy.is_level,
                      tis=(cfg.offpolicy.tis_low, cfg.offpolicy.tis_cap) if cfg.offpolicy.tis_cap else None,
                      mis=(cfg.offpolicy.mis_low, cfg.offpolicy.mis_high) if cfg.offpolicy.mis_high else None)


def micro_step(learner: Learner, mb, lcfg: LossConfig, n_tok: float, n_seq: float):
    cfg, t, mask = learner.cfg, mb.tensors, mb.response_mask
    support = mb.sampling_support if cfg.sampling.keep_sampling_mask else None
    logp, ent, values = learner.trained(mb, support)  # DDP-wrapped with several ranks (nanorl/distributed.py)
    # train_on keeps epoch 0's (old_policy_view)
    t.first_pass_logprobs, t.first_pass_entropy = logp.detach(), ent.detach()
    # on-policy: π_old is the current policy, detached
    old = t.old_logprobs if t.old_logprobs is not None else logp.detach()
    kl = None
    if learner.ref is not None and not cfg.kl.kl_in_reward:  # [b, T] KL as a loss (nanorl/kl.py)
        kl = kl_loss_term(logp, t.ref_logprobs, old, cfg.kl.kl_estimator, cfg.kl.unbiased_kl, mask=mask)
    weights, extra = t.is_weights, {}  # TIS / MIS weights of the step (nanorl/stages.py), detached
    if weights is None and (cfg.offpolicy.tis_cap or cfg.offpolicy.mis_high):
        # the plan left them to this forward: on-policy, its detached logprobs are π_old (nanorl/plan.py)
        weights = step_is_weights(cfg, old, mb.rollout_logprobs, mask)[0]
    if cfg.offpolicy.opsm_delta:  # OPSM needs π_θ, so it is computed here, per token (nanorl/offpolicy.py)
        keep, masked = opsm_mask(logp, mb.rollout_logprobs, t.advantages, mask, cfg.offpolicy.opsm_delta)
        weights = keep if weights is None else weights * keep
        extra["opsm_maskfrac"] = masked.sum() / (mask > 0).sum().clamp(min=1)
    loss, m = total_loss(lcfg, logp, old, t.advantages, mask, entropy=ent, kl=kl,
                         rollout_logp=mb.rollout_logprobs, values=values, old_values=t.old_values,
                         returns=t.returns if values is not None else None, weights=weights,
                         selected=t.cov_selected, num_tokens=n_tok, num_seqs=n_seq,
                         metadata=mb.metadata if callable(lcfg.policy) else None)  # a user loss reads them
    m.update(extra)
    # Train/rollout mismatch: share of tokens whose logprob differs by > 0.5 between the trainer and
    # the engine that sampled them (0 for the HF engine; a rise with vLLM means a broken sync).
    valid = mask > 0  # [b, T]
    far = ((logp.detach() - mb.rollout_logprobs).abs() > 0.5) & valid  # [b, T]
    m["logprob_diff_gt_0.5_frac"] = far.sum() / valid.sum().clamp(min=1)
    return loss, m


# Metrics of total_loss: loss contributions and counts are summed over micro-batches, *_max are maxed,
# the rest are token means weighted by each micro-batch's token count.
SUMMED = ("loss", "pg_loss", "kl_loss", "vf_loss", "num_tokens", "num_seqs")


def accumulate(stats: dict, m: dict) -> None:
    w_tok = float(m["num_tokens"])
    for k, v in m.items():
        if k.endswith("_max"):
            stats[k] = max(stats.get(k, -math.inf), float(v))
        else:
            stats[k] = stats.get(k, 0.0) + (float(v) if k in SUMMED else float(v) * w_tok)


def finish(stats: dict) -> dict:
    n_tok = max(stats["num_tokens"], 1.0)
    return {k: v if k in SUMMED or k.endswith("_max") else v / n_tok for k, v in stats.items()}


def sync_and_step(learner: Learner, params) -> float:
    """Clip and step — unless the loss or a gradient is not finite. Gradients arrive summed over
    ranks (DDP, in the last backward), so every rank clips the same norm and takes the same step.
    fp16: the gradients are unscaled first; an overflow skips the step and lowers the loss scale.
    The overflow flag is agreed over ranks first (precision.agree_found_inf): under FSDP each rank
    checks only its own gradient shards, and a rank that skipped alone, or lowered its loss scale
    alone, would leave the ranks with different weights or scales from then on."""
    overflow = False
    if learner.scaler:
        learner.scaler.unscale_(learner.optimizer)
        overflow = precision.agree_found_inf(learner.scaler, learner.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, learner.cfg.optim.grad_clip or float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards
    if overflow and torch.isfinite(norm):  # another rank's shard overflowed: the same skip here
        norm = torch.full_like(norm, float("inf"))
    if not torch.isfinite(norm):  # one bad batch must not poison the weights: skip, count, go on
        learner.counters["skipped_updates"] += 1
        learner.logger.print(f"step {learner.step}: non-finite gradient norm ({float(norm)}); "
                             "update skipped")
    elif learner.scaler:
        learner.scaler.step(learner.optimizer)
    else:
        learner.optimizer.step()
    if learner.scaler:
        learner.scaler.update()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.scheduler.step()
    return float(norm)
