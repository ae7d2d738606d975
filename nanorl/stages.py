"""The stages of one RL step, in chain order: train.py's `rl_step` calls them and reads on one screen.

Start at `rollout` (links 1-2: sample, score, filter), then `recompute` (link 3: exactly what the
step's plan needs, no gradient), `advantages` (link 4), and `sync` (link 8); links 5-7, the update,
are nanorl/update.py's `train_on`. Each stage takes the records it reads — the sampling side
(rounds.Sampler: source, engine, prompts, rewards), the training side (update.Learner: the policy, its
optimizer, the reference), the step's plan (nanorl/plan.py) — and the step's batch, and writes named
StepTensors fields (nanorl/trajectory.py), never string keys. Key choice: no stage names an algorithm;
an estimator's and a loss's declared needs decide what runs (nanorl/plan.py), and how samples are
drawn (one round, DAPO's rounds) was chosen at set-up (nanorl/rounds.py).
"""
from __future__ import annotations

import math

import torch

from nanorl import dapo, distributed, dump, precision, spans
from nanorl.advantage import compute_advantages, reverse_kl_advantage
from nanorl.env import turn_reward_tensor
from nanorl.kl import kl_estimator, kl_penalized_rewards, masked_mean
from nanorl.metrics import memory_metrics, namespaced, reward_metrics, with_metadata
from nanorl.offpolicy import is_metrics, mismatch_metrics
from nanorl.rollout import SamplingConfig
from nanorl.rounds import Sampler, generate, score
from nanorl.scoring import routing_forward, score_batch, score_rows, zero_weight_samples
from nanorl.teacher import teacher_logprobs
from nanorl.trajectory import collate
from nanorl.update import Learner, old_policy_view, step_is_weights, trains


def support_of(cfg, batch):
    """The kept sampling support [B, T, K] the trainer's forwards restrict to (--keep-sampling-mask)."""
    return batch.sampling_support if cfg.sampling.keep_sampling_mask else None


def rollout(sampler: Sampler, plan, sampling: SamplingConfig, prompts, timer,
            metrics: dict) -> tuple[list, torch.Tensor | None]:
    """Links 1-2: (samples with their rewards, greedy baselines [B] when the plan needs them), the
    rollout metrics, the filters (failed samples, --sample-filter, DAPO, overlong, post-processing).
    How the samples are drawn — one round, or DAPO's rounds here or in the async worker — was chosen
    at set-up: sampler.rounds (nanorl/rounds.py)."""
    cfg, rounds = sampler.cfg, sampler.rounds
    samples = rounds.round(sampler, prompts, sampling, timer, metrics)  # generated and scored
    metrics.update(sampler.source.metrics(samples))  # async staleness, --env's turns and faults
    samples = rounds.keep(sampler, samples, metrics)  # failed samples and --sample-filter's leave
    if samples:  # what trains was sampled and scored like this (a rank may have none left)
        metrics.update(reward_metrics(samples))
    baselines = None
    if plan.greedy_baselines:  # ReMax: the reward of a greedy response is its prompt's baseline
        baselines = greedy_baselines(sampler, prompts, samples, sampling, timer)
    if cfg.sampling.keep_sampling_mask:  # what keeping the sampling support costs (bounded by --support-cap)
        stored = sum(4 * s.sampling_support.numel() for s in samples if s.sampling_support is not None)
        metrics["ksm/support_bytes_per_token"] = stored / max(1, sum(s.response_length for s in samples))
    metrics.update({f"reward_faults/{k}": v for k, v in sampler.rewards.faults.items()})  # run totals
    for name, scorer in sampler.scorers.items():  # a judge's failed calls, by kind, run totals
        metrics.update({f"reward_faults/{name}/{k}": v for k, v in scorer.faults.items()})
    samples = rounds.refill(sampler, prompts, samples, sampling, timer, metrics)  # DAPO's refill rounds
    for name, finish in sampler.finishers:  # overlong punishment, --mask-think (rounds.finishers)
        metrics[name] = finish(samples)
    return samples, baselines


def greedy_baselines(sampler: Sampler, prompts, samples, sampling: SamplingConfig, timer) -> torch.Tensor:
    """The reward of one greedy response per prompt, the baseline of that prompt's samples [B] (ReMax)."""
    if not sampler.source.local:  # --async-steps: the worker sampled them with the batch, from its weights
        return torch.tensor([s.greedy_baseline for s in samples])
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens,
                            stop_token_ids=sampling.stop_token_ids)
    with timer("generate"):
        responses = generate(sampler, prompts, 1, greedy)
    with timer("reward"):
        for g, r in zip(responses, score(sampler, prompts, responses)):
            g.reward = r
    return torch.tensor([responses[s.group_id].total_reward for s in samples])


def to_batch(learner: Learner, engine, samples) -> tuple[list, object]:
    """Samples → (samples, the padded batch on the training device), the engine's memory freed first."""
    pad = learner.tokenizer.pad_token_id
    if not samples:  # none left here, some elsewhere: join the step with rows that weigh nothing
        samples = zero_weight_samples(pad, learner.cfg.samples_per_prompt)
    # vLLM: free its GPU memory until the sync (the HF engine: nothing to free)
    if learner.cfg.vllm.sleep_level:
        engine.sleep(learner.cfg.vllm.sleep_level)
    device = next(learner.model.parameters()).device
    precision.free_cached_memory(device)  # the rollout's KV cache goes back before training allocates
    batch = collate(samples, pad).to(device)
    turns = turn_reward_tensor(samples, batch.response_ids.shape[1])
    if turns is None:  # a reward credited spans (nanorl/spans.py SpanReward); never with --env's episodes
        turns = spans.span_reward_tensor(samples, batch.response_ids.shape[1])
    if turns is not None:  # an environment rewarded turns before the last, or spans (advantage_inputs)
        batch.tensors.turn_rewards = turns.to(device)
    return samples, batch


def recompute(learner: Learner, plan, source, samples, batch, metrics: dict) -> None:
    """Link 3: π_old, the critic's values, Σπ², π_old's entropy, the reference logprobs and the
    teacher's — each only when the plan needs it — in one no-gradient pass of the policy (FSDP gathers
    its weights inside `trained`; micro-batched as training), one of the reference, one of the teacher.
    `source` brings the reference logprobs when the async worker scored them."""
    cfg, t, support = learner.cfg, batch.tensors, support_of(learner.cfg, batch)
    if cfg.memory.routing_replay:  # MoE: this forward also fixes (R2) or checks (R3) the routing to replay
        t.old_logprobs = routing_forward(learner, batch, support, metrics)
    elif cfg.offpolicy.old_logprobs == "rollout":
        t.old_logprobs = batch.rollout_logprobs
    again = plan.old_logprobs and t.old_logprobs is None
    # a dump step scores every row too: the dumps show π before the update (nanorl/dump.py)
    if again or plan.values or plan.sum_sq_probs or plan.old_entropy or dump_due(learner):
        old, values, ent, sum_sq = score_batch(learner, learner.trained, batch, support,
                                               sum_sq=plan.sum_sq_probs)
        t.update(trainer_logprobs=old, trainer_entropy=ent, old_values=values,
                 old_logprobs=old if again else t.old_logprobs,
                 old_entropy=ent if plan.old_entropy else None, sum_sq_probs=sum_sq)
    if plan.teacher:  # on-policy distillation: the teacher scores the student's own tokens
        t.teacher_logprobs = teacher_logprobs(learner, batch, support)
    if plan.reference == "from the worker":  # --async-steps: the rollout worker scored them
        t.ref_logprobs = source.ref_logprobs(samples, batch)
    elif plan.reference == "every row":
        t.ref_logprobs = score_batch(learner, learner.ref, batch, support)[0]


def reference_of_trained_rows(learner: Learner, plan, batch) -> None:
    """KL as a loss with --skip-zero-advantage: reference logprobs only for the rows that train, after
    the advantage has said which (a row with advantage 0 everywhere never reaches the loss)."""
    if plan.reference == "trained rows":
        batch.tensors.ref_logprobs = score_rows(learner, learner.ref, batch, support_of(learner.cfg, batch),
                                                trains(batch))


def advantages(learner: Learner, plan, batch, baselines, metrics: dict) -> None:
    """Link 4: the off-policy weights of the step (known before the update; an estimator may read
    them), the KL in the reward if it goes there, then the chosen estimator's advantages and returns,
    plus --distill-coef × the distillation advantage, added after the estimator's own normalisation
    (slime's --opd-kl-coef: A_t − λ·(log π_old − log π_teacher), on any estimator)."""
    cfg, t, mask = learner.cfg, batch.tensors, batch.response_mask  # mask: [B, T] valid response tokens
    if plan.is_weights == "recompute":  # TIS / MIS: π_old/π_rollout (nanorl/offpolicy.py)
        w, changed, rho = step_is_weights(cfg, t.old_logprobs, batch.rollout_logprobs, mask)
        t.is_weights = w
        metrics.update(is_metrics(w, changed, rho, mask))
    kl = None
    if plan.kl_in_reward:  # KL as a per-token penalty in the reward (InstructGPT, REINFORCE++)
        kl = kl_estimator(t.old_logprobs, t.ref_logprobs, cfg.kl.kl_estimator, mask=mask)  # [B, T]
        metrics["kl_ref"] = float(masked_mean(kl, mask))  # logged, and what --kl-target steers by
    t.advantages, t.returns = compute_advantages(plan.estimator,
                                                 **advantage_inputs(learner, plan, batch, kl, baselines))
    if plan.teacher:  # KL(π_old ‖ π_teacher) per token, k1 on the sampled tokens: distillation lowers it
        metrics["teacher_kl"] = float(masked_mean(t.old_logprobs - t.teacher_logprobs, mask))
    # a task reward + distillation: A_t + λ·(log π_teacher − log π_old) (slime's OPD)
    if cfg.distill.distill_coef:
        t.advantages = t.advantages + cfg.distill.distill_coef * reverse_kl_advantage(
            t.old_logprobs, t.teacher_logprobs, mask)  # [B, T]
    if cfg.dapo.drop_truncated:  # DAPO overlong filtering: truncated rows leave the loss, not the baselines
        batch.response_mask = dapo.truncated_loss_mask(batch.response_mask, batch.truncated)


def sync(learner: Learner, engine, source, metrics: dict) -> None:
    """Link 8: the new weights into the engine (and the async worker, through the sample source),
    checked every --sync-check-every steps."""
    cfg, version = learner.cfg, learner.step + 1
    try:  # vLLM asleep: it wakes its weights, streams them in, then wakes its KV cache
        engine.update_weights(learner.model, version=version)
    except Exception as e:  # going on would sample from stale weights: silent divergence
        raise RuntimeError(f"step {version}: the {cfg.engine} engine failed to load the new weights "
                           f"({type(e).__name__}: {e}); resume from the last checkpoint with "
                           "--resume latest") from e
    source.publish(learner.model, version)  # async: the worker samples batch step + 1 + K from it
    due = cfg.vllm.sync_check_every and version % cfg.vllm.sync_check_every == 0
    if due and engine.holds_own_weights:
        # Never trust a sync silently: score a probe with both and fail loudly on a mismatch.
        with distributed.root_gathered(learner.trained):
            metrics.update({f"sync/{k}": v for k, v in engine.check_sync(learner.model).items()})


def rollout_metrics(hooks, samples, timer, metrics: dict) -> dict:
    """The metrics of a step that made no update (--debug-rollout-only, or no rank kept a sample),
    namespaced, with the --log-metadata fields (`hooks`)."""
    timed = {f"time/{k}": v for k, v in timer.seconds.items()}
    return with_metadata(namespaced({**metrics, **timed}), samples, hooks.log_metadata)


def step_metrics(learner: Learner, plan, hooks, samples, batch, mask, timer, metrics: dict) -> dict:
    """The step's metrics, namespaced (rollout/, train/, perf/: nanorl/metrics.py), with the
    trainer-vs-engine mismatch, the adaptive β's update (one β for every rank) and the --log-metadata
    fields (`hooks`). mask [B, T]: the batch's response tokens."""
    trainer_logp, _, scored = old_policy_view(batch)  # [B, T] the trainer's π_old, where it scored
    metrics.update(mismatch_metrics(trainer_logp, batch.rollout_logprobs, mask * scored))
    if plan.is_weights == "first forward":  # the update weighed each token with these (micro_step)
        metrics.update(is_metrics(*step_is_weights(learner.cfg, trainer_logp, batch.rollout_logprobs,
                                                   mask * scored), mask * scored))
    if learner.cfg.kl.kl_target:  # the per-token KL to the reference, in either placement
        n_tok = float(mask.sum()) if "kl_ref" in metrics else 0.0  # a rank of pads only has none
        kl_sum, n = distributed.all_reduce(torch.tensor([metrics.get("kl_ref", 0.0) * n_tok, n_tok])).tolist()
        if n > 0 and math.isfinite(kl_sum / n):
            learner.kl_ctl.update(kl_sum / n, n_steps=len(samples))
    step_time = sum(timer.seconds.values())
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()}, **{"time/step": step_time})
    metrics["tokens_per_s"] = float(mask.sum()) * learner.world / max(step_time, 1e-9)
    metrics["kl_beta"] = learner.kl_ctl.beta
    adv = batch.tensors.advantages  # [B, T]
    metrics["advantage_abs_mean"] = float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))
    metrics = namespaced({**metrics, **memory_metrics(mask.device)})
    return with_metadata(metrics, samples, hooks.log_metadata)  # --log-metadata's, own names


def dump_due(learner: Learner) -> bool:
    return dump.due(learner.cfg.saving.dump_rollouts, learner.step + 1)


def dump_step(learner: Learner, samples, batch) -> None:
    """Every --dump-rollouts steps: this step's samples and per-token tensors (nanorl/dump.py)."""
    cfg = learner.cfg
    dump.rollouts(samples, batch, learner.tokenizer, learner.step + 1, cfg.saving.dump_rollouts, cfg.out_dir,
                  cfg.saving.dump_rollouts_mb, rank=learner.rank, log=learner.logger.print)


def enough_to_train(world: int, n: int) -> bool:
    """Whether this step updates: when any rank holds a sample (all ranks agree: an all-reduce). A
    rank with none, or with fewer than mini-batches, still takes every pass of the step (zero-weight
    rows and pads, nanorl/update.py), so the others' samples train as one process would train them."""
    if world == 1:
        return n > 0
    return int(distributed.all_reduce(torch.tensor([n]))) > 0


def advantage_inputs(learner: Learner, plan, batch, kl, baselines) -> dict:
    """The chosen estimator's inputs. What every step has is passed where the estimator reads it; what a
    flag asks for (KL in the reward, no whitening, GDPO weights, ReMax baselines) is passed as such, so an
    estimator that cannot use it raises (nanorl/advantage.py compute_advantages)."""
    cfg, t, mask = learner.cfg, batch.tensors, batch.response_mask
    uses = plan.estimator_inputs
    comps = torch.stack(list(batch.reward_components.values()), -1) if batch.reward_components else None
    have = dict(mask=mask, index=batch.group_ids, values=t.old_values, components=comps,
                old_logprobs=t.old_logprobs, sum_sq_probs=t.sum_sq_probs, teacher_logprobs=t.teacher_logprobs,
                rollout_is_weights=t.is_weights, gamma=cfg.gamma, lam=cfg.lam, pass_k=cfg.evaluation.pass_k,
                metadata=batch.metadata)  # per-row Sample.metadata: for a user estimator
    inputs = {k: v for k, v in have.items() if k in uses and v is not None}
    # an environment rewarded turns (nanorl/env.py):
    if t.turn_rewards is not None and "token_rewards" in uses:
        beta = learner.kl_ctl.beta
        kl_part = 0 if kl is None else kl_penalized_rewards(torch.zeros_like(batch.rewards), kl, mask, beta)
        # each on its turn's last token, −β·KL on every token
        inputs["token_rewards"] = t.turn_rewards + kl_part
    elif kl is None:  # (pure distillation, opd, reads no score: the rewards are only logged)
        if "scores" in uses or "teacher_logprobs" not in uses:
            inputs["scores"] = batch.rewards
    elif "kl_penalty" in uses:  # slime's REINFORCE++-baseline: the KL stays per token
        inputs.update(scores=batch.rewards, kl_penalty=learner.kl_ctl.beta * kl)
    else:  # −β·KL per token + the score on the last one; outcome estimators score Σ_t of it (verl)
        inputs["token_rewards"] = kl_penalized_rewards(batch.rewards, kl, mask, learner.kl_ctl.beta)
    if "whiten" in uses:  # the estimator's own batch whitening (GAE: off unless asked): the flag decides
        inputs["whiten"] = cfg.whiten_advantages
    if cfg.gdpo_weights:
        inputs["component_weights"] = [float(x) for x in cfg.gdpo_weights.split(",")]
    if baselines is not None:
        inputs["baselines"] = baselines.to(mask.device)
    return inputs
