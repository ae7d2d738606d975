"""The rules Config.__post_init__ enforces (nanorl/config.py): ranges, choices, and no flag that would
do nothing — each message names the field. One function per group of flags; `check` runs them all.
They read the config's fields and the concept modules' registries (advantage, losses), never user
code: a user estimator is checked by `check_estimator` when nanorl/plugins.py `apply` loads it.
Test: python -m pytest tests/test_config.py -q
"""
from __future__ import annotations

import math
import sys
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


def _is_float(text: str) -> bool:
    """A finite number (a NaN or inf weight would make every reward it touches non-finite)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def check(cfg) -> None:
    """Every rule, on a built Config."""
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
    need(not cfg.judge or cfg.judge_model, "judge needs judge_model (the served or the local model)")
    need(not (cfg.judge_url or cfg.judge_model) or cfg.judge, "judge_url / judge_model need judge")
    need(not cfg.judge_url or cfg.judge_url.startswith(("http://", "https://")),
         f"judge_url must start with http:// or https://, got {cfg.judge_url!r}")
    need(cfg.judge_concurrency >= 1 and cfg.judge_timeout > 0 and cfg.judge_retries >= 0,
         "judge_concurrency must be >= 1, judge_timeout > 0, judge_retries >= 0 (got "
         f"{cfg.judge_concurrency}, {cfg.judge_timeout}, {cfg.judge_retries})")
    defaults = {f.name: f.default for f in fields(cfg)}
    endpoint = [n for n in ("judge_concurrency", "judge_timeout", "judge_retries")
                if getattr(cfg, n) != defaults[n]]
    need(cfg.judge_url or not endpoint, f"{', '.join(endpoint)}: settings of the calls to judge_url; the "
         "in-process judge (no judge_url) makes none")
    need(cfg.judge_parse == "yesno" or cfg.judge_parse.startswith("number:"),
         f"judge_parse must be number:LO:HI or yesno, got {cfg.judge_parse!r}")
    pairs = [x.split("=") for x in cfg.reward_weights.split(",")] if cfg.reward_weights else []
    need(all(len(p) == 2 and p[0].strip() and _is_float(p[1]) for p in pairs),
         f"reward_weights must be name=number pairs, comma-separated, got {cfg.reward_weights!r}")
    scorer = "reward_model" if cfg.reward_model else "judge" if cfg.judge else ""
    # without a scorer the reward is --reward's alone and the weights were never read (a dict reward's
    # components are summed unweighted): refused rather than silently ignored
    need(not cfg.reward_weights or scorer or cfg.plugin, "--reward-weights weighs --reward against the "
         "--reward-model / --judge components, and this run has neither: drop --reward-weights, or add one")
    need(not (scorer and cfg.env), f"{scorer} with --env is not supported: the environment scores")
    need(not (scorer and cfg.partial_rollout == "abort"), f"{scorer} with --partial-rollout abort is not "
         "supported: its resumed samples are scored by --reward alone")
    for name in ("reward_postprocess", "sample_filter"):
        need(not getattr(cfg, name) or ":" in getattr(cfg, name), f"{name} must be "
             f"module:function or file.py:function, got {getattr(cfg, name)!r}")
    # a reasoning-gym row's label is its task item, which only the task's checker (or user code) reads
    rg_data = cfg.train_data.startswith("reasoning_gym:")
    need(not rg_data or cfg.reward == "reasoning_gym" or ":" in cfg.reward or cfg.plugin or cfg.env,
         f"train_data {cfg.train_data.split('?')[0]} needs --reward reasoning_gym (the task's own checker)")
    need(cfg.reward != "reasoning_gym" or rg_data, "reward reasoning_gym scores reasoning-gym items: "
         "needs --train-data reasoning_gym:NAME")
    need(all(x.strip() for x in cfg.log_metadata.split(",")) or not cfg.log_metadata,
         f"log_metadata: an empty name in {cfg.log_metadata!r}")
    for name, known in (("advantage", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
        value = getattr(cfg, name)
        need(value in known or ":" in value,
             f"unknown {name} {value!r}; valid: {', '.join(known)} or file.py:fn")
    need(cfg.loss_agg in AGG_MODES, f"unknown loss_agg {cfg.loss_agg!r}; valid: {', '.join(AGG_MODES)}")
    for name, choices in CHOICES.items():
        need(getattr(cfg, name) in choices,
             f"{name} must be one of {', '.join(map(str, choices))}, got {getattr(cfg, name)!r}")
    need(0 < cfg.gpu_memory_utilization < 1, "gpu_memory_utilization must be in (0, 1)")
    need(cfg.kv_cache_gb >= 0, f"kv_cache_gb must be >= 0, got {cfg.kv_cache_gb}")
    need(cfg.max_model_len == 0 or cfg.max_model_len > cfg.max_new_tokens,
         f"max_model_len {cfg.max_model_len} leaves no room for a prompt plus max_new_tokens "
         f"{cfg.max_new_tokens} (0 = sized from the data)")
    for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "steps", "ppo_epochs",
                 "mini_batches", "max_prompt_len", "pass_k", "keep_checkpoints"):
        need(getattr(cfg, name) >= 1, f"{name} must be >= 1, got {getattr(cfg, name)}")
    need(not cfg.prompt_template or "{prompt}" in cfg.prompt_template, "prompt_template must contain "
         f"{{prompt}} (where the user's text goes), got {cfg.prompt_template!r}")
    need(not cfg.chat_template_kwargs or isinstance(cfg.chat_template_dict, dict),
         f"chat_template_kwargs must be a JSON object, got {cfg.chat_template_kwargs!r}")
    for name in ("micro_batch_size", "max_tokens_per_micro_batch", "warmup_steps", "eval_every",
                 "save_every", "threads", "sync_check_every", "eval_limit", "kl_coef", "entropy_coef",
                 "vf_coef", "tis_cap", "tis_low", "mis_low", "mis_high", "opsm_delta", "kl_target",
                 "reward_timeout", "weight_decay", "top_k", "grad_clip", "eval_temperature",
                 "eval_max_new_tokens", "dump_rollouts"):
        need(getattr(cfg, name) >= 0, f"{name} must be >= 0, got {getattr(cfg, name)}")
    need(0 < cfg.top_p <= 1, f"top_p must be in (0, 1], got {cfg.top_p}")
    for name in ("adam_beta1", "adam_beta2"):
        need(0 <= getattr(cfg, name) < 1, f"{name} must be in [0, 1), got {getattr(cfg, name)}")
    need(cfg.adam_eps > 0, f"adam_eps must be > 0, got {cfg.adam_eps}")
    need(cfg.dump_rollouts_mb > 0, f"dump_rollouts_mb must be > 0, got {cfg.dump_rollouts_mb}")
    # the rollout worker would wait for new weights forever
    need(not (cfg.debug_rollout_only and cfg.async_steps),
         "debug_rollout_only makes no update, so --async-steps has no new weights to wait for: drop one")
    need(cfg.temperature > 0, f"temperature must be > 0 for RL sampling, got {cfg.temperature}")
    need(cfg.lr > 0, f"lr must be > 0, got {cfg.lr}")
    need(cfg.dual_clip == 0 or cfg.dual_clip > 1,
         f"dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    need(0 <= cfg.gamma <= 1 and 0 <= cfg.lam <= 1, "gamma and lam must be in [0, 1]")
    check_advantage_and_loss(cfg)
    check_env(cfg)
    check_agent(cfg)
    check_async(cfg)
    check_lora(cfg)
    # routing replay's own forward computes π_old under the replayed routing (nanorl/stages.py), which
    # would silently replace the engine's logprobs that --old-logprobs rollout asks for
    need(not (cfg.routing_replay and cfg.old_logprobs == "rollout"), "--routing-replay computes π_old "
         "in its own forward (the routing it replays), so --old-logprobs rollout would be ignored: drop "
         "--old-logprobs rollout (auto or recompute), or --routing-replay")
    need(not (cfg.overwrite and cfg.resume), "--overwrite deletes the earlier run in --out-dir that "
         "--resume continues: drop one")
    need(not (cfg.fsdp and cfg.routing_replay), "--fsdp with --routing-replay is not supported: routing"
         " replay records and replays in forwards of the HF model itself, outside FSDP's root forward")
    need(cfg.prompts_per_step * cfg.samples_per_prompt >= cfg.mini_batches,
         "mini_batches cannot exceed the number of samples per step")


def check_advantage_and_loss(cfg) -> None:
    """The advantage / loss / KL / off-policy / DAPO group: ranges, and no flag that does nothing."""
    from nanorl.advantage import ADVANTAGE_ESTIMATORS
    from nanorl.losses import COV_LOSSES
    defaults = {f.name: f.default for f in fields(cfg)}
    moved = lambda name: getattr(cfg, name) != defaults[name]  # noqa: E731
    if ":" not in cfg.advantage:  # a user estimator is checked when it is loaded (plugins.apply)
        check_estimator(cfg, ADVANTAGE_ESTIMATORS[cfg.advantage])
    need(cfg.gdpo_weights == "" or all(_is_float(x) for x in cfg.gdpo_weights.split(",")),
         f"gdpo_weights must be comma-separated numbers, got {cfg.gdpo_weights!r}")
    need(cfg.distill_coef >= 0, f"distill_coef must be >= 0, got {cfg.distill_coef}")
    need(not cfg.distill_coef or cfg.teacher, "distill_coef needs --teacher (the model whose log-probs "
         "it distils)")
    need(not cfg.kl_in_reward or cfg.kl_coef > 0, "kl_in_reward needs kl_coef > 0")
    need(not cfg.unbiased_kl or (cfg.kl_coef > 0 and not cfg.kl_in_reward),
         "unbiased_kl weights the KL loss term: needs kl_coef > 0 without kl_in_reward")
    need(not cfg.kl_target or cfg.kl_coef > 0, "kl_target adapts β: needs kl_coef > 0")
    need(not (cfg.log_kl and cfg.kl_coef > 0), "log_kl is for kl_coef 0: with a KL term the KL is "
         "logged already")
    for name, loss in (("sapo_tau_pos", "sapo"), ("sapo_tau_neg", "sapo"), ("dro_beta", "dro")):
        need(getattr(cfg, name) > 0, f"{name} must be > 0")
        need(not moved(name) or cfg.policy_loss == loss, f"{name} needs policy_loss {loss}")
    for name in ("cov_ratio", "cov_kl_coef"):
        need(not moved(name) or cfg.policy_loss in COV_LOSSES,
             f"{name} needs a policy loss with a token selection: {' or '.join(COV_LOSSES)}")
    need(0 < cfg.cov_ratio <= 1, f"cov_ratio must be in (0, 1], got {cfg.cov_ratio}")
    need(0 <= cfg.top_entropy_quantile <= 1, "top_entropy_quantile must be in [0, 1]")
    need(not cfg.tis_cap or cfg.tis_cap > 1 > cfg.tis_low, "TIS needs tis_low < 1 < tis_cap")
    need(not cfg.tis_low or cfg.tis_cap, "tis_low needs tis_cap")
    need(not (cfg.mis_low or cfg.mis_high) or 0 <= cfg.mis_low < 1 < cfg.mis_high,
         "masked IS needs 0 <= mis_low < 1 < mis_high")
    need(cfg.is_level in ("token", "sequence"),
         f"is_level must be token or sequence, got {cfg.is_level!r}")
    need(cfg.is_level == "token" or cfg.tis_cap or cfg.mis_high, "is_level needs tis_cap or mis_high")
    need(cfg.max_gen_batches >= 1, f"max_gen_batches must be >= 1, got {cfg.max_gen_batches}")
    need(not moved("max_gen_batches") or cfg.filter_groups, "max_gen_batches needs filter_groups")
    need(cfg.over_sample >= 1, f"over_sample must be >= 1, got {cfg.over_sample}")
    abort = cfg.partial_rollout == "abort"
    need(cfg.over_sample == 1 or cfg.filter_groups or abort, "over_sample needs filter_groups (it aborts "
         "once the step has enough groups with reward variance) or --partial-rollout abort")
    need(not abort or cfg.over_sample >= 2, "--partial-rollout abort needs --over-sample >= 2: with only "
         "the batch's groups in flight none is ever left unfinished to abort")
    need(cfg.over_sample == 1 or not (cfg.env or cfg.routing_replay) or abort,
         "over_sample with --env or --routing-replay is not supported (an episode is several engine "
         "calls; an aborted request's routing is still open)")
    need(0 <= cfg.overlong_buffer < 1, f"overlong_buffer is a share of max_new_tokens in [0, 1), got "
         f"{cfg.overlong_buffer}")
    need(cfg.overlong_penalty > 0, "overlong_penalty must be > 0")
    need(not moved("overlong_penalty") or cfg.overlong_buffer, "overlong_penalty needs overlong_buffer")


def check_env(cfg) -> None:
    """The --env group: ranges, and no flag that does nothing."""
    defaults = {f.name: f.default for f in fields(cfg)}
    moved = [k for k in ("env_max_turns", "env_max_tokens", "tool_timeout")
             if getattr(cfg, k) != defaults[k]]
    need(cfg.env or not moved, f"{', '.join(moved)} only shape --env episodes: set --env")
    need(not cfg.env or cfg.env in BUILTIN_ENV_NAMES or ":" in cfg.env, f"--env {cfg.env!r}: "
         f"expected one of {sorted(BUILTIN_ENV_NAMES)}, 'module:Class' or 'file.py:Class'")
    need(cfg.env_max_turns >= 1 and cfg.env_max_tokens >= 0,
         "env_max_turns must be >= 1 and env_max_tokens >= 0")
    need(cfg.tool_timeout >= 0 or cfg.tool_timeout == -1,
         f"tool_timeout must be >= 0 or -1, got {cfg.tool_timeout}")
    if not cfg.env:
        return
    # the environment scores its episodes: --reward is unused (a resolved reward_timeout of 0 is fine)
    for k in ("reward", "reward_timeout"):
        need(getattr(cfg, k) == defaults[k] or (k == "reward_timeout" and cfg.reward_timeout == 0),
             f"--{k.replace('_', '-')} does nothing with --env: the environment scores its episodes")
    need(not cfg.overlong_buffer, "--overlong-buffer measures one response against max_new_tokens; an "
         "episode's length is bounded by env_max_tokens instead: not supported with --env")
    need(cfg.env != "calc" or cfg.max_new_tokens >= 12, "--env calc needs --max-new-tokens >= 12 "
         f"(a call is up to 12 tokens: calc(9+9+9)<eos>), got {cfg.max_new_tokens}")


def check_agent(cfg) -> None:
    """--agent: what cannot combine with a user's agent behind the endpoint (nanorl/agent.py)."""
    if not cfg.agent:
        return
    need(":" in cfg.agent, f"--agent {cfg.agent!r}: expected 'file.py:fn' or 'module:fn'")
    need(not cfg.env, "--agent with --env: one of them runs the episodes; pick one")
    defaults = {f.name: f.default for f in fields(cfg)}
    for k in ("reward", "reward_timeout"):
        need(getattr(cfg, k) == defaults[k] or (k == "reward_timeout" and cfg.reward_timeout == 0),
             f"--{k.replace('_', '-')} does nothing with --agent: the agent returns its episodes' rewards")
    for flag, on in (("--async-steps", cfg.async_steps), ("--over-sample", cfg.over_sample > 1),
                     ("--filter-groups", cfg.filter_groups), ("--overlong-buffer", cfg.overlong_buffer),
                     ("--routing-replay", cfg.routing_replay),
                     ("--advantage remax", cfg.advantage == "remax")):
        need(not on, f"--agent with {flag} is not supported: an agent's episode is several engine calls "
             "served while its function runs, here, in this step")


def check_async(cfg) -> None:
    """The --async-steps group: ranges, and no flag that does nothing or cannot work."""
    on = cfg.async_steps > 0
    need(not (cfg.partial_rollout and cfg.env), "--partial-rollout with --env is not supported: the "
         "buffer resumes single responses, not an episode's turns")
    need(cfg.async_steps >= 0, f"async_steps must be >= 0, got {cfg.async_steps}")
    need(not cfg.partial_rollout or on, "partial_rollout needs async_steps >= 1")
    need(not cfg.mask_offpolicy_in_partial_rollout or cfg.partial_rollout,
         "mask_offpolicy_in_partial_rollout needs partial_rollout")
    need(not cfg.rollout_device or on, "rollout_device needs async_steps >= 1")
    if cfg.rollout_device:
        import torch
        try:
            torch.device(cfg.rollout_device)
        except RuntimeError:
            need(False, f"rollout_device {cfg.rollout_device!r} is not a device "
                 "(cpu, cuda, cuda:1, ...)")
    # what generates inside the step, or needs the engine to be the trainer's own module
    for bad, what in ((cfg.filter_groups and cfg.partial_rollout == "abort", "--filter-groups and "
                       "--partial-rollout abort (not built: both choose the batch's groups, in two ways)"),
                      (cfg.routing_replay, "--routing-replay (not built: the worker records no "
                       "routing)"),
                      (cfg.fsdp, "--fsdp (not built: one full copy per rank for the worker)")):
        need(not (on and bad), f"--async-steps with {what} is not supported")

def check_estimator(cfg, fn) -> None:
    """The checks that read what the advantage estimator `fn` declares by its keyword parameters
    (nanorl/plan.py): a flag it cannot use, an input the run cannot give it. Built-ins are checked
    while the config is built; a user estimator when plugins.apply loads it."""
    from nanorl.advantage import estimator_inputs
    from nanorl.plan import explicit_inputs

    uses, named = estimator_inputs(fn), explicit_inputs(fn)
    # on-policy distillation (nanorl/teacher.py): the teacher, its estimator, and --distill-coef
    reads_teacher = "teacher_logprobs" in named
    need(not reads_teacher or cfg.teacher, f"advantage {cfg.advantage} reads teacher_logprobs: set "
         "--teacher PATH_OR_NAME (a model with the policy's tokenizer)")
    need(not (reads_teacher and cfg.distill_coef), f"distill_coef adds the distillation advantage to a "
         f"task-reward estimator's; advantage {cfg.advantage} is that advantage alone: drop one")
    need(not cfg.teacher or reads_teacher or cfg.distill_coef > 0, f"--teacher does nothing with "
         f"advantage {cfg.advantage} and distill_coef 0: use --algo distill, or --distill-coef > 0")
    # stale samples: π_old (the trainer's newer weights) is not the policy that sampled, and the
    # reverse-KL reward must be that one's (measured: docs/tour.md section 20)
    need(not ((reads_teacher or cfg.distill_coef) and cfg.async_steps and cfg.old_logprobs != "rollout"),
         "--async-steps with a teacher needs --old-logprobs rollout: the distillation reward "
         "log π_teacher − log π_student must score the policy that sampled, not the trainer's newer one")
    need(not (cfg.kl_in_reward and reads_teacher and "token_rewards" not in uses), f"kl_in_reward: "
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
    need(not cfg.kl_in_reward or not getattr(fn, "raw_scores", False),
         f"kl_in_reward: {cfg.advantage} reads the raw scores (0/1 pass/fail or reward components), "
         "a KL penalty cannot enter them; put KL in the loss")
    need(not (cfg.reward_weights and "components" in named),
         f"reward_weights does nothing with advantage {cfg.advantage}: it reads the components one "
         "by one (gdpo_weights weighs them)")
    # an estimator reading greedy baselines (ReMax) generates inside the step, per prompt group
    need(not (cfg.filter_groups and "baselines" in named),
         f"filter_groups with {cfg.advantage} is not supported: it reads greedy baselines, and a "
         "refilled group has none")
    need(not (cfg.reward_postprocess and "baselines" in named),
         f"reward_postprocess with advantage {cfg.advantage} is not supported: the greedy baseline "
         "response is scored by --reward alone, outside any group")
    need(not (cfg.partial_rollout and "baselines" in named),
         f"--partial-rollout with --advantage {cfg.advantage} is not supported: the worker's greedy "
         "baseline would be sampled from a newer version than the samples it is the baseline of")


def check_lora(cfg) -> None:
    """The LoRA group: ranges, no knob without --lora-rank, and what LoRA is not built for."""
    on = cfg.lora_rank > 0
    need(cfg.lora_rank >= 0, f"lora_rank must be >= 0, got {cfg.lora_rank}")
    need(cfg.lora_alpha > 0, f"lora_alpha must be > 0, got {cfg.lora_alpha}")
    need(0 <= cfg.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    need(all(t.strip() for t in cfg.lora_target_modules.split(",")),
         f"lora_target_modules: an empty name in {cfg.lora_target_modules!r}")
    need(cfg.lora_sync == "merged" or (on and cfg.engine != "hf"), "lora_sync adapter needs lora_rank > 0 "
         "and the vLLM engine (the HF engine samples from the adapted module itself)")
    need(cfg.lora_sync != "adapter" or cfg.lora_rank <= VLLM_LORA_RANKS[-1], f"--lora-sync adapter: "
         f"vLLM 0.32 serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got --lora-rank {cfg.lora_rank}; "
         "use --lora-sync merged")
    # vLLM's level-2 sleep discards the base weights and the adapter sync never resends them: on a GPU
    # the engine would refuse at step 1's sleep, after the model and the engine loaded. Resolved here
    # (a Config cannot tell a typed --sleep-level 2 from the default), with a note.
    if cfg.lora_sync == "adapter" and cfg.sleep_level == 2:
        cfg.sleep_level = 1
        print("config: --lora-sync adapter runs with --sleep-level 1 (level 2 discards the base weights, "
              "which the adapter sync never resends; 0 keeps the engine resident)", file=sys.stderr)
    for name, default in (("lora_alpha", 32.0), ("lora_dropout", 0.0), ("lora_target_modules", "all-linear")):
        need(on or getattr(cfg, name) == default, f"{name} needs lora_rank > 0 (it does nothing without)")
    for bad, what in ((cfg.fsdp, "--fsdp (not built: the merged-weight stream and the adapters-off "
                       "reference run on the full module; DDP works, and LoRA's trainer state is small "
                       "enough to replicate)"),
                      (cfg.async_steps, "--async-steps (not built: the worker's copy takes the full "
                       "state dict, not merged LoRA weights)")):
        need(not (on and bad), f"--lora-rank with {what} is not supported")
