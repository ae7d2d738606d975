"""The rules Config.__post_init__ enforces on its top-level fields (nanorl/config.py): ranges, choices, and
no flag that would do nothing — each message names the field. A feature group's own rules are its
`check` (nanorl/config_groups.py), run only when the group is in use; `check` here runs on every config.
They read the config's fields and the concept modules' registries (advantage, losses), never user
code: a user estimator is checked by `check_estimator` when nanorl/plugins.py `apply` loads it.
Test: python -m pytest tests/test_config.py -q
"""
from __future__ import annotations

import math
from dataclasses import fields

from nanorl.presets import PRESETS

# The built-in environments' names (their classes: nanorl/tool_envs.py BUILTIN_ENVS)
BUILTIN_ENV_NAMES = ("calc", "python_tool")
# Fields with a fixed set of values: argparse offers them as choices, `check` checks them
CHOICES = {"engine": ("auto", "hf", "vllm"), "sleep_level": (0, 1, 2),
           "old_logprobs": ("auto", "recompute", "rollout"), "logprob_impl": ("fused", "naive"),
           "schedule": ("constant", "cosine"), "dtype": ("float32", "bfloat16", "float16"),
           "lora_sync": ("merged", "adapter"),
           "partial_rollout": ("", "abort")}

# vLLM 0.32's accepted max_lora_rank values (vllm/config/lora.py MaxLoRARanks; pydantic refuses others)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The max_lora_rank --lora-sync adapter starts vLLM with: the smallest accepted value that holds
    adapters of `rank` (vLLM pads smaller ranks with zeros: the same adapted weights)."""
    return min(r for r in VLLM_LORA_RANKS if r >= rank)


class ConfigError(ValueError):
    """A user's mistake in the flags, not a bug: train.py's command line prints the message alone, on one
    line, and exits 2 (argparse's convention; config.user_error_line); programmatic callers (tests,
    notebooks) get the exception. A ValueError, so `except ValueError` callers still catch it."""


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config: {msg}")


def is_float(text: str) -> bool:
    """A finite number (a NaN or inf weight would make every reward it touches non-finite)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def check(cfg) -> None:
    """The top-level fields' rules, on a built Config (the groups': Config.__post_init__)."""
    from nanorl.advantage import ADVANTAGE_ESTIMATORS
    from nanorl.losses import AGG_MODES, POLICY_LOSSES

    need(cfg.algo in PRESETS, f"unknown --algo {cfg.algo!r}; valid: {', '.join(PRESETS)}")
    # first: a NaN passes every range rule below (each comparison is False either way round), and a
    # NaN --clip-low or an inf --lr trains on a NaN loss or NaN logits from step 1
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        need(not isinstance(f.default, float) or math.isfinite(value),
             f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
    # the plug-in flags' forms (their code is loaded and checked at set-up: nanorl/plugins.py apply)
    for name in ("reward_postprocess", "sample_filter"):
        spec = getattr(cfg, name)
        need(not spec or ":" in spec, f"{name} must be module:function or file.py:function, got {spec!r}")
    # a reasoning-gym row's label is its task item, which only the task's checker (or user code: a reward
    # file, a plug-in, an environment, an agent) reads
    rg_data = cfg.train_data.startswith("reasoning_gym:")
    if rg_data:
        need(cfg.reward == "reasoning_gym" or ":" in cfg.reward or cfg.plugin or cfg.env or cfg.agent,
             f"train_data {cfg.train_data.split('?')[0]} needs --reward reasoning_gym "
             "(the task's own checker)")
    need(cfg.reward != "reasoning_gym" or rg_data, "reward reasoning_gym scores reasoning-gym items: "
         "needs --train-data reasoning_gym:NAME")
    need(all(x.strip() for x in cfg.log_metadata.split(",")) or not cfg.log_metadata,
         f"log_metadata: an empty name in {cfg.log_metadata!r}")
    for name, known in (("advantage", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
        value = getattr(cfg, name)
        need(value in known or ":" in value,
             f"unknown {name} {value!r}; valid: {', '.join(known)} or file.py:fn")
    need(cfg.loss_agg in AGG_MODES, f"unknown loss_agg {cfg.loss_agg!r}; valid: {', '.join(AGG_MODES)}")
    need(cfg.engine in CHOICES["engine"], f"engine must be one of {', '.join(CHOICES['engine'])}, "
         f"got {cfg.engine!r}")
    for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "steps"):
        need(getattr(cfg, name) >= 1, f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("kl_coef", "entropy_coef", "vf_coef", "reward_timeout"):
        need(getattr(cfg, name) >= 0, f"{name} must be >= 0, got {getattr(cfg, name)}")
    need(cfg.lr > 0, f"lr must be > 0, got {cfg.lr}")
    need(cfg.dual_clip == 0 or cfg.dual_clip > 1,
         f"dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    need(0 <= cfg.gamma <= 1 and 0 <= cfg.lam <= 1, "gamma and lam must be in [0, 1]")
    need(0 <= cfg.top_entropy_quantile <= 1, "top_entropy_quantile must be in [0, 1]")
    need(cfg.gdpo_weights == "" or all(is_float(x) for x in cfg.gdpo_weights.split(",")),
         f"gdpo_weights must be comma-separated numbers, got {cfg.gdpo_weights!r}")
    if ":" not in cfg.advantage:  # a user estimator is checked when it is loaded (plugins.apply)
        check_estimator(cfg, ADVANTAGE_ESTIMATORS[cfg.advantage])


def _scores_its_episodes(cfg, flag: str, who: str) -> None:
    """--env and --agent score their own episodes: --reward and --reward-timeout would do nothing."""
    defaults = {f.name: f.default for f in fields(cfg)}
    # a resolved reward_timeout of 0 is fine
    for k in ("reward", "reward_timeout"):
        need(getattr(cfg, k) == defaults[k] or (k == "reward_timeout" and cfg.reward_timeout == 0),
             f"--{k.replace('_', '-')} does nothing with {flag}: {who}")


def check_env(cfg) -> None:
    """--env: its name, and the flags an environment's episodes make useless (its knobs' ranges:
    nanorl/config_groups.py Episodes)."""
    need(cfg.env in BUILTIN_ENV_NAMES or ":" in cfg.env, f"--env {cfg.env!r}: "
         f"expected one of {sorted(BUILTIN_ENV_NAMES)}, 'module:Class' or 'file.py:Class'")
    _scores_its_episodes(cfg, "--env", "the environment scores its episodes")
    need(not cfg.dapo.overlong_buffer, "--overlong-buffer measures one response against max_new_tokens; "
         "an episode's length is bounded by env_max_tokens instead: not supported with --env")
    need(cfg.env != "calc" or cfg.max_new_tokens >= 12, "--env calc needs --max-new-tokens >= 12 "
         f"(a call is up to 12 tokens: calc(9+9+9)<eos>), got {cfg.max_new_tokens}")


def check_agent(cfg) -> None:
    """--agent: what cannot combine with a user's agent behind the endpoint (nanorl/agent.py)."""
    need(":" in cfg.agent, f"--agent {cfg.agent!r}: expected 'file.py:fn' or 'module:fn'")
    need(not cfg.env, "--agent with --env: one of them runs the episodes; pick one")
    _scores_its_episodes(cfg, "--agent", "the agent returns its episodes' rewards")
    for flag, on in (("--over-sample", cfg.dapo.over_sample > 1),
                     ("--filter-groups", cfg.dapo.filter_groups),
                     ("--overlong-buffer", cfg.dapo.overlong_buffer),
                     ("--routing-replay", cfg.memory.routing_replay),
                     ("--advantage remax", cfg.advantage == "remax")):
        need(not on, f"--agent with {flag} is not supported: an agent's episode is several engine calls "
             "served while its function runs, in one rollout")


def check_estimator(cfg, fn) -> None:
    """The checks that read what the advantage estimator `fn` declares by its keyword parameters
    (nanorl/plan.py): a flag it cannot use, an input the run cannot give it. Built-ins are checked
    while the config is built; a user estimator when plugins.apply loads it."""
    from nanorl.advantage import estimator_inputs
    from nanorl.plan import explicit_inputs

    uses, named = estimator_inputs(fn), explicit_inputs(fn)
    # on-policy distillation (nanorl/teacher.py): the teacher, its estimator, and --distill-coef
    reads_teacher = "teacher_logprobs" in named
    teacher, coef = cfg.distill.teacher, cfg.distill.distill_coef
    if reads_teacher or teacher or coef:
        need(not reads_teacher or teacher, f"advantage {cfg.advantage} reads teacher_logprobs: set "
             "--teacher PATH_OR_NAME (a model with the policy's tokenizer)")
        need(not (reads_teacher and coef), f"distill_coef adds the distillation advantage to a "
             f"task-reward estimator's; advantage {cfg.advantage} is that advantage alone: drop one")
        need(not teacher or reads_teacher or coef > 0, f"--teacher does nothing with "
             f"advantage {cfg.advantage} and distill_coef 0: use --algo distill, or --distill-coef > 0")
        # stale samples: π_old (the trainer's newer weights) is not the policy that sampled, and the
        # reverse-KL reward must be that one's (measured: docs/tour.md section 20)
        stale = cfg.pipeline.async_steps and cfg.offpolicy.old_logprobs != "rollout"
        need(not ((reads_teacher or coef) and stale),
             "--async-steps with a teacher needs --old-logprobs rollout: the distillation reward "
             "log π_teacher − log π_student must score the policy that sampled, not the trainer's newer one")
    need(not (cfg.kl.kl_in_reward and reads_teacher and "token_rewards" not in uses), f"kl_in_reward: "
         f"advantage {cfg.advantage} reads no reward to put the KL into; put KL in the loss (the default)")
    need("scores" in uses or "token_rewards" in uses or reads_teacher, f"advantage {cfg.advantage} "
         "reads no reward (scores, token_rewards) and no teacher_logprobs: it has no signal to learn from")
    need("values" not in named or cfg.vf_coef > 0,
         f"advantage {cfg.advantage} needs a critic: set vf_coef > 0")
    need(cfg.gamma == 1 or "gamma" in uses, f"gamma does nothing with advantage {cfg.advantage}")
    need(cfg.lam == 1 or "lam" in uses, f"lam does nothing with advantage {cfg.advantage}")
    need(cfg.whiten_advantages or "whiten" in uses,
         f"--no-whiten-advantages does nothing with advantage {cfg.advantage} (it never whitens)")
    need(not cfg.gdpo_weights or "component_weights" in named,
         f"gdpo_weights does nothing with advantage {cfg.advantage} (it takes no component_weights)")
    need(not cfg.kl.kl_in_reward or not getattr(fn, "raw_scores", False),
         f"kl_in_reward: {cfg.advantage} reads the raw scores (0/1 pass/fail or reward components), "
         "a KL penalty cannot enter them; put KL in the loss")
    need(not (cfg.scorers.reward_weights and "components" in named),
         f"reward_weights does nothing with advantage {cfg.advantage}: it reads the components one "
         "by one (gdpo_weights weighs them)")
    # an estimator reading greedy baselines (ReMax) generates inside the step, per prompt group
    if "baselines" in named:
        need(not cfg.dapo.filter_groups,
             f"filter_groups with {cfg.advantage} is not supported: it reads greedy baselines, and a "
             "refilled group has none")
        need(not cfg.reward_postprocess,
             f"reward_postprocess with advantage {cfg.advantage} is not supported: the greedy baseline "
             "response is scored by --reward alone, outside any group")
        need(not cfg.pipeline.partial_rollout,
             f"--partial-rollout with --advantage {cfg.advantage} is not supported: the greedy baseline "
             "would be sampled from a newer version than the resumed samples it is the baseline of")
