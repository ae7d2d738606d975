"""The stages of one RL step, in chain order: train.py's `rl_step` calls them and reads on one screen.

Start at `rollout` (links 1-2: sample, score, filter), then `recompute` (link 3: exactly what the
step's plan needs, no gradient), `advantages` (link 4), and `sync` (link 8); links 5-7, the update,
are nanorl/update.py's `train_on`. Each stage takes train.py's Run and the step's batch and writes
named StepTensors fields (nanorl/trajectory.py), never string keys. Key choice: no stage names an
algorithm; an estimator's and a loss's declared needs decide what runs (nanorl/plan.py).
"""
from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from nanorl import dapo, distributed, dump, precision, spans
from nanorl.advantage import compute_advantages, reverse_kl_advantage
from nanorl.env import turn_reward_tensor
from nanorl.kl import kl_estimator, kl_penalized_rewards, masked_mean
from nanorl.metrics import memory_metrics, namespaced, reward_metrics
from nanorl.offpolicy import is_metrics, mismatch_metrics
from nanorl.rewards import score_samples
from nanorl.rollout import SamplingConfig, stop_token_ids
from nanorl.scoring import routing_forward, score_batch, score_rows, zero_weight_samples
from nanorl.teacher import teacher_logprobs
from nanorl.trajectory import TRAINS, collate
from nanorl.update import old_policy_view, step_is_weights, trains


class Sampler(Protocol):
    """What the sampling stages (`generate`, `score`, `keep_trainable`, `refill_groups`,
    `oversampled_round`) read of a run: train.py's Run, or the async worker's own for DAPO's refill
    rounds (rollout_worker.WorkerSampler)."""
    cfg: Any           # nanorl/config.py Config
    source: Any        # where samples come from (nanorl/sources.py)
    engine: Any        # the rollout engine (over-sampling aborts through it)
    loader: Any        # the prompt stream (refill rounds draw from it)
    rewards: Any       # --reward's runner
    scorers: dict      # reward model / judge components
    reward_weights: dict | None
    tokenizer: Any
    hooks: Any         # --reward-postprocess, --sample-filter
    world: int         # ranks that draw the same rounds
    counters: dict     # run totals (dapo_gave_up)
    step: int
    logger: Any        # its `print` says a step that ran out of rounds


def generate(run, prompts, n: int, sampling: SamplingConfig) -> list:
    """n samples per prompt, consecutive, from the run's sample source (nanorl/sources.py): the
    engine's responses, --env's episodes, or --async-steps' batch sampled ahead by the worker."""
    return run.source.generate(run.step, prompts, n, sampling)


def score(run, prompts, samples) -> list:
    """The reward of every sample (prompt i's n samples are consecutive): --reward's, and with a reward
    model or a judge their components beside it (`with_components`)."""
    if run.source.rewarded:  # the environment / the worker scored them
        return [s.reward for s in samples]
    rewards = score_samples(run.rewards, run.tokenizer, prompts, samples)
    if not run.scorers:
        return rewards
    n = len(samples) // len(prompts)
    texts = run.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    prompt_texts = [p.text for p in prompts for _ in range(n)]
    labels = [p.label for p in prompts for _ in range(n)]
    scored = {name: s.score(prompt_texts, texts, labels) for name, s in run.scorers.items()}
    return with_components(rewards, scored, samples, run.reward_weights)


def with_components(rewards, scored: dict, samples, weights: dict | None) -> list[dict]:
    """Each sample's reward as named components: --reward's own (a number is the component `correct`,
    which rollout/accuracy reads), then each scorer's (`rm`, `judge`), unweighted — the weights apply in
    Sample.total_reward, so each component is logged as it was scored (rollout/reward/<name>). A scorer
    that failed on a sample (None) makes it a reward_fault: it leaves the step (keep_trainable)."""
    out = []
    for i, (reward, s) in enumerate(zip(rewards, samples)):
        comps = dict(reward) if isinstance(reward, dict) else {"correct": float(reward)}
        for name, values in scored.items():
            if values[i] is None and s.status in TRAINS:
                s.status = "reward_fault"
            comps[name] = 0.0 if values[i] is None else float(values[i])
        unknown = sorted(set(weights or {}) - set(comps))
        if unknown:
            raise ValueError(f"--reward-weights names {unknown}, not components of the reward "
                             f"({sorted(comps)})")
        s.reward_weights = weights
        out.append(comps)
    return out


def stop_tokens(run) -> tuple[int, ...]:
    return stop_token_ids(run.model, run.tokenizer)


def support_of(run, batch):
    """The kept sampling support [B, T, K] the trainer's forwards restrict to (--keep-sampling-mask)."""
    return batch.sampling_support if run.cfg.sampling.keep_sampling_mask else None


def rollout(run, prompts, timer, metrics: dict) -> tuple[list, torch.Tensor | None]:
    """Links 1-2: (samples with their rewards, greedy baselines [B] when the plan needs them), the
    rollout metrics, the filters (failed samples, --sample-filter, DAPO, overlong, post-processing)."""
    cfg = run.cfg
    with timer("generate"):
        sampling = SamplingConfig(temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
                                  top_p=cfg.sampling.top_p,
                                  max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop_tokens(run),
                                  keep_support=cfg.sampling.keep_sampling_mask,
                                  support_cap=cfg.sampling.support_cap)
        # DAPO over-sampling: groups scored as they stop, the rest aborted (async: the worker's)
        oversampled = cfg.dapo.over_sample > 1 and run.source.local
        # DAPO with --async-steps: the worker ran the rounds, post-processed and filtered each
        refilled = cfg.dapo.filter_groups and not run.source.local
        if oversampled:
            samples = oversampled_round(run, prompts, sampling, metrics)
        else:
            samples = generate(run, prompts, cfg.samples_per_prompt, sampling)
    with timer("reward"):
        if not (oversampled or refilled):
            for s, r in zip(samples, score(run, prompts, samples)):
                s.reward = r
            # --reward-postprocess: the whole step's groups (with --async-steps too)
            run.hooks.postprocess(samples)
    metrics.update(run.source.metrics(samples))  # async staleness, --env's turns and faults
    if not refilled:
        samples = keep_trainable(run, samples, metrics)
    if samples:  # what trains was sampled and scored like this (a rank may have none left)
        metrics.update(reward_metrics(samples))
    baselines = greedy_baselines(run, prompts, samples, timer) if run.plan.greedy_baselines else None
    if cfg.sampling.keep_sampling_mask:  # what keeping the sampling support costs (bounded by --support-cap)
        stored = sum(4 * s.sampling_support.numel() for s in samples if s.sampling_support is not None)
        metrics["ksm/support_bytes_per_token"] = stored / max(1, sum(s.response_length for s in samples))
    metrics.update({f"reward_faults/{k}": v for k, v in run.rewards.faults.items()})  # run totals
    for name, scorer in run.scorers.items():  # a judge's failed calls, by kind, run totals
        metrics.update({f"reward_faults/{name}/{k}": v for k, v in scorer.faults.items()})
    if cfg.dapo.filter_groups and not refilled:  # DAPO: drop zero-variance groups, refill the step
        samples = refill_groups(run, prompts, samples, sampling, timer, metrics)
    # DAPO's soft overlong punishment, after the filter (which reads correctness)
    if cfg.dapo.overlong_buffer:
        metrics["overlong_penalty_mean"] = dapo.apply_overlong_penalty(
            samples, cfg.max_new_tokens, cfg.dapo.overlong_buffer, cfg.dapo.overlong_penalty)
    if cfg.prompts.mask_think:  # the reasoning conditions the answer and takes no loss (nanorl/spans.py)
        metrics["think_masked_frac"] = spans.mask_think(samples, run.tokenizer)
    return samples, baselines


def keep_trainable(run, samples, metrics: dict) -> list:
    """The samples that train: failed ones (a status outside trajectory.TRAINS: aborted, env_error,
    tool_timeout, reward_fault) and those --sample-filter rejects leave the step here, after the rewards
    and before the advantages. Counted as rollout/dropped_frac (this step's share, summed over refill
    rounds) and rollout/dropped/<why>. Ranks may keep unequal numbers: the update runs in lockstep anyway
    (nanorl/scoring.py micro_batches)."""
    keep = run.hooks.keeps(samples)
    why = [s.status if s.status not in TRAINS else "filtered" if not k else None
           for s, k in zip(samples, keep)]
    dropped = [w for w in why if w is not None]
    metrics["dropped_frac"] = metrics.get("dropped_frac", 0.0) + len(dropped) / max(1, len(samples))
    for w in dropped:
        metrics[f"dropped/{w}"] = metrics.get(f"dropped/{w}", 0) + 1
    return [s for s, w in zip(samples, why) if w is None]


def to_batch(run, samples) -> tuple[list, object]:
    """Samples → (samples, the padded batch on the training device), the engine's memory freed first."""
    if not samples:  # none left here, some elsewhere: join the step with rows that weigh nothing
        samples = zero_weight_samples(run.tokenizer.pad_token_id, run.cfg.samples_per_prompt)
    if run.cfg.vllm.sleep_level:  # vLLM: free its GPU memory until the sync (the HF engine: nothing to free)
        run.engine.sleep(run.cfg.vllm.sleep_level)
    device = next(run.model.parameters()).device
    precision.free_cached_memory(device)  # the rollout's KV cache goes back before training allocates
    batch = collate(samples, run.tokenizer.pad_token_id).to(device)
    turns = turn_reward_tensor(samples, batch.response_ids.shape[1])
    if turns is None:  # a reward credited spans (nanorl/spans.py SpanReward); never with --env's episodes
        turns = spans.span_reward_tensor(samples, batch.response_ids.shape[1])
    if turns is not None:  # an environment rewarded turns before the last, or spans (advantage_inputs)
        batch.tensors.turn_rewards = turns.to(device)
    return samples, batch


def recompute(run, samples, batch, metrics: dict) -> None:
    """Link 3: π_old, the critic's values, Σπ², π_old's entropy, the reference logprobs and the
    teacher's — each only when the plan needs it — in one no-gradient pass of the policy (FSDP gathers
    its weights inside `trained`; micro-batched as training), one of the reference, one of the teacher."""
    plan, t, support = run.plan, batch.tensors, support_of(run, batch)
    # MoE: this forward also fixes (R2) or checks (R3) the routing to replay
    if run.cfg.memory.routing_replay:
        t.old_logprobs = routing_forward(run, batch, support, metrics)
    elif run.cfg.offpolicy.old_logprobs == "rollout":
        t.old_logprobs = batch.rollout_logprobs
    again = plan.old_logprobs and t.old_logprobs is None
    # a dump step scores every row too: the dumps show π before the update (nanorl/dump.py)
    if again or plan.values or plan.sum_sq_probs or plan.old_entropy or dump_due(run):
        old, values, ent, sum_sq = score_batch(run, run.trained, batch, support, sum_sq=plan.sum_sq_probs)
        t.update(trainer_logprobs=old, trainer_entropy=ent, old_values=values,
                 old_logprobs=old if again else t.old_logprobs,
                 old_entropy=ent if plan.old_entropy else None, sum_sq_probs=sum_sq)
    if plan.teacher:  # on-policy distillation: the teacher scores the student's own tokens
        t.teacher_logprobs = teacher_logprobs(run, batch, support)
    if plan.reference == "from the worker":  # --async-steps: the rollout worker scored them
        t.ref_logprobs = run.source.ref_logprobs(samples, batch)
    elif plan.reference == "every row":
        t.ref_logprobs = score_batch(run, run.ref, batch, support)[0]


def reference_of_trained_rows(run, batch) -> None:
    """KL as a loss with --skip-zero-advantage: reference logprobs only for the rows that train, after
    the advantage has said which (a row with advantage 0 everywhere never reaches the loss)."""
    if run.plan.reference == "trained rows":
        batch.tensors.ref_logprobs = score_rows(run, run.ref, batch, support_of(run, batch), trains(batch))


def advantages(run, batch, baselines, metrics: dict) -> None:
    """Link 4: the off-policy weights of the step (known before the update; an estimator may read
    them), the KL in the reward if it goes there, then the chosen estimator's advantages and returns,
    plus --distill-coef × the distillation advantage, added after the estimator's own normalisation
    (slime's --opd-kl-coef: A_t − λ·(log π_old − log π_teacher), on any estimator)."""
    cfg, t, mask = run.cfg, batch.tensors, batch.response_mask  # mask: [B, T] valid response tokens
    if run.plan.is_weights == "recompute":  # TIS / MIS: π_old/π_rollout (nanorl/offpolicy.py)
        w, changed, rho = step_is_weights(cfg, t.old_logprobs, batch.rollout_logprobs, mask)
        t.is_weights = w
        metrics.update(is_metrics(w, changed, rho, mask))
    kl = None
    if run.plan.kl_in_reward:  # KL as a per-token penalty in the reward (InstructGPT, REINFORCE++)
        kl = kl_estimator(t.old_logprobs, t.ref_logprobs, cfg.kl.kl_estimator, mask=mask)  # [B, T]
        metrics["kl_ref"] = float(masked_mean(kl, mask))  # logged, and what --kl-target steers by
    t.advantages, t.returns = compute_advantages(run.plan.estimator,
                                                 **advantage_inputs(run, batch, kl, baselines))
    if run.plan.teacher:  # KL(π_old ‖ π_teacher) per token, k1 on the sampled tokens: distillation lowers it
        metrics["teacher_kl"] = float(masked_mean(t.old_logprobs - t.teacher_logprobs, mask))
    # a task reward + distillation: A_t + λ·(log π_teacher − log π_old) (slime's OPD)
    if cfg.distill.distill_coef:
        t.advantages = t.advantages + cfg.distill.distill_coef * reverse_kl_advantage(
            t.old_logprobs, t.teacher_logprobs, mask)  # [B, T]
    if cfg.dapo.drop_truncated:  # DAPO overlong filtering: truncated rows leave the loss, not the baselines
        batch.response_mask = dapo.truncated_loss_mask(batch.response_mask, batch.truncated)


def sync(run, metrics: dict) -> None:
    """Link 8: the new weights into the engine (and the async worker), checked every
    --sync-check-every steps; then the adaptive KL coefficient's update."""
    cfg = run.cfg
    try:  # vLLM asleep: it wakes its weights, streams them in, then wakes its KV cache
        run.engine.update_weights(run.model, version=run.step + 1)
    except Exception as e:  # going on would sample from stale weights: silent divergence
        raise RuntimeError(f"step {run.step + 1}: the {cfg.engine} engine failed to load the new weights "
                           f"({type(e).__name__}: {e}); resume from the last checkpoint with "
                           "--resume latest") from e
    run.source.publish(run.model, run.step + 1)  # async: the worker samples batch step + 1 + K from it
    due = cfg.vllm.sync_check_every and (run.step + 1) % cfg.vllm.sync_check_every == 0
    if due and run.engine.holds_own_weights:
        # Never trust a sync silently: score a probe with both and fail loudly on a mismatch.
        with distributed.root_gathered(run.trained):
            metrics.update({f"sync/{k}": v for k, v in run.engine.check_sync(run.model).items()})


def step_metrics(run, samples, batch, mask, timer, metrics: dict) -> dict:
    """The step's metrics, namespaced (rollout/, train/, perf/: nanorl/metrics.py), with the
    trainer-vs-engine mismatch, the adaptive β's update (one β for every rank) and the --log-metadata
    fields. mask [B, T]: the batch's response tokens. batch None: no update was made."""
    if batch is None:
        timed = {f"time/{k}": v for k, v in timer.seconds.items()}
        return run.hooks.with_metadata(namespaced({**metrics, **timed}), samples)
    trainer_logp, _, scored = old_policy_view(batch)  # [B, T] the trainer's π_old, where it scored
    metrics.update(mismatch_metrics(trainer_logp, batch.rollout_logprobs, mask * scored))
    if run.plan.is_weights == "first forward":  # the update weighed each token with these (micro_step)
        metrics.update(is_metrics(*step_is_weights(run.cfg, trainer_logp, batch.rollout_logprobs,
                                                   mask * scored), mask * scored))
    if run.cfg.kl.kl_target:  # the per-token KL to the reference, in either placement
        n_tok = float(mask.sum()) if "kl_ref" in metrics else 0.0  # a rank of pads only has none
        kl_sum, n = distributed.all_reduce(torch.tensor([metrics.get("kl_ref", 0.0) * n_tok, n_tok])).tolist()
        if n > 0 and math.isfinite(kl_sum / n):
            run.kl_ctl.update(kl_sum / n, n_steps=len(samples))
    step_time = sum(timer.seconds.values())
    metrics.update({f"time/{k}": v for k, v in timer.seconds.items()}, **{"time/step": step_time})
    metrics["tokens_per_s"] = float(mask.sum()) * run.world / max(step_time, 1e-9)
    metrics["kl_beta"] = run.kl_ctl.beta
    adv = batch.tensors.advantages  # [B, T]
    metrics["advantage_abs_mean"] = float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))
    metrics = namespaced({**metrics, **memory_metrics(mask.device)})
    return run.hooks.with_metadata(metrics, samples)  # --log-metadata fields, under their own names


def dump_due(run) -> bool:
    return dump.due(run.cfg.saving.dump_rollouts, run.step + 1)


def dump_step(run, samples, batch) -> None:
    """Every --dump-rollouts steps: this step's samples and per-token tensors (nanorl/dump.py)."""
    cfg = run.cfg
    dump.rollouts(samples, batch, run.tokenizer, run.step + 1, cfg.saving.dump_rollouts, cfg.out_dir,
                  cfg.saving.dump_rollouts_mb, rank=run.rank, log=run.logger.print)


def enough_to_train(run, n: int) -> bool:
    """Whether this step updates: when any rank holds a sample (all ranks agree: an all-reduce). A
    rank with none, or with fewer than mini-batches, still takes every pass of the step (zero-weight
    rows and pads, nanorl/update.py), so the others' samples train as one process would train them."""
    if run.world == 1:
        return n > 0
    return int(distributed.all_reduce(torch.tensor([n]))) > 0


def refill_groups(run, prompts, samples, sampling, timer, metrics) -> list:
    """DAPO dynamic sampling (nanorl/dapo.py): keep the groups whose rewards differ and generate rounds
    of fresh prompts until this rank holds len(prompts) of them, at most max_gen_batches rounds."""
    cfg, first, calls = run.cfg, [samples], [0]

    def draw(wanted: bool) -> list:
        if first:
            return first.pop()
        more = run.loader.next_batch()  # every rank advances its prompt stream alike
        if not wanted:
            return []
        calls[0] += 1  # a seeded batch (the async worker's): each round its own seed
        with timer("generate"):
            new = generate(run, more, cfg.samples_per_prompt, sampling.call(calls[0]))
        with timer("reward"):
            for s, r in zip(new, score(run, more, new)):
                s.reward = r
            run.hooks.postprocess(new)  # before the filter reads the rewards, as in the step
        return keep_trainable(run, new, metrics)

    def any_short(short: bool) -> bool:  # all ranks draw the same rounds
        return short if run.world == 1 else int(distributed.all_reduce(torch.tensor([int(short)]))) > 0

    kept, rounds, generated, gave_up = dapo.dynamic_sampling(draw, len(prompts), cfg.dapo.max_gen_batches,
                                                             any_short)
    found = len({s.group_id for s in kept})
    metrics.update({"groups_kept_frac": found / max(generated, 1), "dapo/gen_rounds": rounds})
    if gave_up:
        run.counters["dapo_gave_up"] = run.counters.get("dapo_gave_up", 0) + 1
        run.logger.print(f"step {run.step}: dynamic sampling found {found} of {len(prompts)} groups with "
                         f"reward variance in {rounds} generation rounds (--max-gen-batches "
                         f"{cfg.dapo.max_gen_batches}); training on those. Raise --max-gen-batches, or use "
                         "easier data / a stronger start.")
    return kept


def oversampled_round(run, prompts, sampling, metrics: dict) -> list:
    """--over-sample F: one generation round of F× the step's prompts (F − 1 more batches from the
    loader, as refill rounds draw them). Each group is scored (and --reward-postprocess'd) as soon as
    all its samples stop; once len(prompts) groups with reward variance are in, every request still
    running is aborted. Returns every sample, the aborted ones (and the rest of their groups: a group
    trains whole or not at all) with status "aborted", which keep_trainable drops. The HF engine
    aborts between its decode steps, vLLM through its request loop (VLLMEngine._until). Logged:
    dapo/aborted_tokens (sampled, then thrown away), dapo/aborted_groups, dapo/oversampled_groups."""
    n, wanted = run.cfg.samples_per_prompt, len(prompts)
    pool = list(prompts) + [p for _ in range(run.cfg.dapo.over_sample - 1) for p in run.loader.next_batch()]
    found = [0]

    def scored(groups: list) -> None:  # whole groups, consecutive: prompt i's n samples
        if not groups:
            return
        for s, r in zip(groups, score(run, [pool[s.group_id] for s in groups[::n]], groups)):
            s.reward = r
        run.hooks.postprocess(groups)

    def enough(done: list) -> bool:
        scored(done)
        found[0] += sum(dapo.has_signal([s.total_reward for s in done[i:i + n]])
                        for i in range(0, len(done), n))
        return found[0] >= wanted
    samples = run.engine.generate([p.ids for p in pool], n, sampling, until=enough)
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    cut = [g for g in groups if any(s.status == "aborted" for s in g)]
    for g in cut:
        for s in g:
            s.status = "aborted"
    scored([s for g in groups if g[0].status != "aborted" and g[0].reward is None for s in g])  # at the end
    metrics.update({"dapo/aborted_tokens": sum(s.response_length for g in cut for s in g),
                    "dapo/aborted_groups": len(cut), "dapo/oversampled_groups": len(pool)})
    return samples


def greedy_baselines(run, prompts, samples, timer) -> torch.Tensor:
    """The reward of one greedy response per prompt, the baseline of that prompt's samples [B] (ReMax)."""
    if not run.source.local:  # --async-steps: the worker sampled them with the batch, from its weights
        return torch.tensor([s.greedy_baseline for s in samples])
    cfg = run.cfg
    with timer("generate"):
        greedy = generate(run, prompts, 1, SamplingConfig(
            temperature=0.0, max_new_tokens=cfg.max_new_tokens, stop_token_ids=stop_tokens(run)))
    with timer("reward"):
        for g, r in zip(greedy, score(run, prompts, greedy)):
            g.reward = r
    return torch.tensor([greedy[s.group_id].total_reward for s in samples])


def advantage_inputs(run, batch, kl, baselines) -> dict:
    """The chosen estimator's inputs. What every step has is passed where the estimator reads it; what a
    flag asks for (KL in the reward, no whitening, GDPO weights, ReMax baselines) is passed as such, so an
    estimator that cannot use it raises (nanorl/advantage.py compute_advantages)."""
    cfg, t, mask = run.cfg, batch.tensors, batch.response_mask
    uses = run.plan.estimator_inputs
    comps = torch.stack(list(batch.reward_components.values()), -1) if batch.reward_components else None
    have = dict(mask=mask, index=batch.group_ids, values=t.old_values, components=comps,
                old_logprobs=t.old_logprobs, sum_sq_probs=t.sum_sq_probs, teacher_logprobs=t.teacher_logprobs,
                rollout_is_weights=t.is_weights, gamma=cfg.gamma, lam=cfg.lam, pass_k=cfg.evaluation.pass_k,
                metadata=batch.metadata)  # per-row Sample.metadata: for a user estimator
    inputs = {k: v for k, v in have.items() if k in uses and v is not None}
    # an environment rewarded turns (nanorl/env.py):
    if t.turn_rewards is not None and "token_rewards" in uses:
        beta = run.kl_ctl.beta
        kl_part = 0 if kl is None else kl_penalized_rewards(torch.zeros_like(batch.rewards), kl, mask, beta)
        # each on its turn's last token, −β·KL on every token
        inputs["token_rewards"] = t.turn_rewards + kl_part
    elif kl is None:  # (pure distillation, opd, reads no score: the rewards are only logged)
        if "scores" in uses or "teacher_logprobs" not in uses:
            inputs["scores"] = batch.rewards
    elif "kl_penalty" in uses:  # slime's REINFORCE++-baseline: the KL stays per token
        inputs.update(scores=batch.rewards, kl_penalty=run.kl_ctl.beta * kl)
    else:  # −β·KL per token + the score on the last one; outcome estimators score Σ_t of it (verl)
        inputs["token_rewards"] = kl_penalized_rewards(batch.rewards, kl, mask, run.kl_ctl.beta)
    if "whiten" in uses:  # the estimator's own batch whitening (GAE: off unless asked): the flag decides
        inputs["whiten"] = cfg.whiten_advantages
    if cfg.gdpo_weights:
        inputs["component_weights"] = [float(x) for x in cfg.gdpo_weights.split(",")]
    if baselines is not None:
        inputs["baselines"] = baselines.to(mask.device)
    return inputs
