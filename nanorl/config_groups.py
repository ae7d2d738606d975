"""Config's feature groups (nanorl/config.py): one small dataclass per feature, a docstring per field,
and the rules its flags obey (`check`, run only when the group is in use: moved from its defaults).

Each group's field is the flag PREFIX + its name (`LoRA.rank` is --lora-rank; PREFIX "" keeps the flag's
name): `Config.from_flags` routes a flat flag-name value to its group by these declarations, and --help
shows one argument group per class, titled TITLE. A group's check may read the whole config (a rule
between two features lives with the one that, moved, makes it matter). A loss's own settings are
declared where the loss is registered (nanorl/losses.py): LossParams gathers them.
Test: python -m pytest tests/test_config.py -q
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields, make_dataclass
from typing import ClassVar

from nanorl.config_checks import CHOICES, VLLM_LORA_RANKS, is_float, need
from nanorl.losses import POLICY_LOSSES, params_owners


class Group:
    """A feature's settings. TITLE: its --help group; PREFIX: what its fields' flags start with."""
    TITLE: ClassVar[str] = ""
    PREFIX: ClassVar[str] = ""

    @classmethod
    def help_classes(cls) -> list[type]:
        """The classes whose documented fields --help lists, one argument group each (TITLE)."""
        return [cls]

    def flags(self) -> dict:
        """{flag name: value} of every field (the flat form presets, plug-ins and checkpoints use)."""
        return {self.PREFIX + f.name: getattr(self, f.name) for f in fields(self)}

    def moved(self) -> list[str]:
        """The flag names of the fields that differ from their defaults."""
        return [self.PREFIX + f.name for f in fields(self) if getattr(self, f.name) != f.default]

    def validate(self, cfg) -> None:
        """The group's rules: finite numbers, fixed choices (CHOICES), then its own `check`."""
        # a NaN passes every range rule (each comparison is False either way round)
        for name, value in self.flags().items():
            need(not isinstance(value, float) or math.isfinite(value),
                 f"--{name.replace('_', '-')} must be a finite number, got {value}")
            need(name not in CHOICES or value in CHOICES[name],
                 f"{name} must be one of {', '.join(map(str, CHOICES.get(name, ())))}, got {value!r}")
        self.check(cfg)

    def check(self, cfg) -> None:
        """The feature's own rules (ranges, a knob without its switch, what it cannot combine with)."""


def _at_least(group: Group, low: int, names: tuple[str, ...]) -> None:
    for name in names:
        need(getattr(group, name) >= low, f"{name} must be >= {low}, got {getattr(group, name)}")


@dataclass
class Prompts(Group):
    TITLE = 'data and prompt format (nanorl/data.py PromptFormat)'

    input_key: str = "prompt"
    """Column holding the prompt (a string or a list of chat messages); a.b reads a nested column,
    a,b takes the first a set has."""
    label_key: str = "answer"
    """Column holding the reference answer the reward checks (same a.b / a,b forms)."""
    max_prompt_len: int = 512
    """Prompts longer than this (in tokens) are skipped and counted."""
    system_prompt: str = ""
    """A system message put before every prompt (a row with its own system message is an error)."""
    prompt_template: str = ""
    """Wraps the user's text: "{prompt}" is replaced by it (e.g. "{prompt} Box the answer: \\boxed{}.")."""
    chat_template: bool = True
    """Use the tokenizer's chat template when it has one (--no-chat-template: raw text, for base models)."""
    chat_template_kwargs: str = ""
    """JSON object of extra chat-template options, e.g. '{"enable_thinking": false}' for Qwen3."""
    mask_think: bool = False
    """Keep each response's <think>…</think> tokens out of the loss (they still condition the answer
    and the reward reads them): train the answer, not the reasoning (nanorl/spans.py)."""

    def check(self, cfg) -> None:
        _at_least(self, 1, ("max_prompt_len",))
        need(not self.prompt_template or "{prompt}" in self.prompt_template, "prompt_template must "
             f"contain {{prompt}} (where the user's text goes), got {self.prompt_template!r}")
        need(not self.chat_template_kwargs or isinstance(cfg.chat_template_dict, dict),
             f"chat_template_kwargs must be a JSON object, got {self.chat_template_kwargs!r}")


@dataclass
class Scorers(Group):
    TITLE = 'reward model and LLM judge (nanorl/reward_models.py, nanorl/judges.py)'

    reward_model: str = ""
    """Hugging Face name or local path of a sequence-classification reward model (one label, e.g. a
    Bradley-Terry RM): its score of each sample is the reward component `rm` (nanorl/reward_models.py)."""
    judge: str = ""
    """LLM-judge prompt template, or a file holding one, with {prompt}, {response}, {label}: the judge's
    parsed answer is the reward component `judge`; a failed call leaves the sample out (nanorl/judges.py)."""
    judge_url: str = ""
    """OpenAI-compatible base URL of the judge (e.g. http://host:8000/v1, `vllm serve`); empty: the judge
    model runs in-process in an HF engine."""
    judge_model: str = ""
    """The judge model: the served name with judge_url, else a Hugging Face name or local path to load."""
    judge_parse: str = "number:0:10"
    """How the judge's answer becomes a score in [0, 1]: number:LO:HI (its first number, mapped from
    [LO, HI]) or yesno."""
    judge_concurrency: int = 8
    """judge_url: requests in flight at once (what the server can batch; vLLM serves many at a time)."""
    judge_timeout: float = 60.0
    """judge_url: seconds for the connect and for each read of one request before it is retried."""
    judge_retries: int = 2
    """judge_url: retries of a request (after 0.5 s, 1 s, ...) on a connection error, a timeout, 429 or a
    5xx; what still fails is a counted reward fault (the sample leaves the step)."""
    reward_weights: str = ""
    """Comma list name=weight of the reward components in the total the advantage reads (each 1 unless
    named): e.g. correct=0,rm=1 trains on the reward model alone; `correct` is a number-valued reward."""

    def check(self, cfg) -> None:
        need(not self.judge or self.judge_model, "judge needs judge_model (the served or the local model)")
        need(not (self.judge_url or self.judge_model) or self.judge, "judge_url / judge_model need judge")
        need(not self.judge_url or self.judge_url.startswith(("http://", "https://")),
             f"judge_url must start with http:// or https://, got {self.judge_url!r}")
        need(self.judge_concurrency >= 1 and self.judge_timeout > 0 and self.judge_retries >= 0,
             "judge_concurrency must be >= 1, judge_timeout > 0, judge_retries >= 0 (got "
             f"{self.judge_concurrency}, {self.judge_timeout}, {self.judge_retries})")
        endpoint = [n for n in self.moved() if n in ("judge_concurrency", "judge_timeout", "judge_retries")]
        need(self.judge_url or not endpoint, f"{', '.join(endpoint)}: settings of the calls to judge_url; "
             "the in-process judge (no judge_url) makes none")
        need(self.judge_parse == "yesno" or self.judge_parse.startswith("number:"),
             f"judge_parse must be number:LO:HI or yesno, got {self.judge_parse!r}")
        pairs = [x.split("=") for x in self.reward_weights.split(",")] if self.reward_weights else []
        need(all(len(p) == 2 and p[0].strip() and is_float(p[1]) for p in pairs),
             f"reward_weights must be name=number pairs, comma-separated, got {self.reward_weights!r}")
        scorer = "reward_model" if self.reward_model else "judge" if self.judge else ""
        # without a scorer the reward is --reward's alone and the weights were never read (a dict
        # reward's components are summed unweighted): refused rather than silently ignored
        need(not self.reward_weights or scorer or cfg.plugin, "--reward-weights weighs --reward against "
             "the --reward-model / --judge components, and this run has neither: drop --reward-weights, "
             "or add one")
        need(not (scorer and cfg.env), f"{scorer} with --env is not supported: the environment scores")


@dataclass
class Sampling(Group):
    TITLE = 'sampling (nanorl/rollout.py, nanorl/sampling.py)'

    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature."""
    top_k: int = 0
    """Top-k filter at sampling (0 = off)."""
    top_p: float = 1.0
    """Top-p (nucleus) filter at sampling (1.0 = off)."""
    keep_sampling_mask: bool = False
    """Score every policy on the top-k/top-p support the sampler kept."""
    support_cap: int = 64
    """Most kept ids stored per token with keep_sampling_mask; a larger set falls back to full vocab."""

    def check(self, cfg) -> None:
        need(self.temperature > 0, f"temperature must be > 0 for RL sampling, got {self.temperature}")
        need(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class VLLMEngine(Group):
    TITLE = 'the vLLM engine (--engine vllm, nanorl/vllm_engine.py)'

    gpu_memory_utilization: float = 0.3
    """Share of GPU memory for the engine (weights + KV cache, which it sizes unless kv_cache_gb > 0)."""
    sleep_level: int = 2
    """Sleep mode from the rollout's end to the weight sync: 2 drops weights and KV cache (the sync reloads
    every weight anyway), 1 keeps weights on CPU, 0 stays resident; skipped where vLLM has none (CPU).
    --lora-sync adapter turns 2 into 1 (with a note): level 2 would discard the base it never resends."""
    sync_check_every: int = 1
    """Every N steps, check that the engine's logprobs match the trainer's after the sync (0 = off)."""
    max_model_len: int = 0
    """Longest sequence the engine holds (0 = the longest prompt of the data + max_new_tokens)."""
    kv_cache_gb: float = 0.0
    """KV cache in GiB (0 = GPU: sized by gpu_memory_utilization; CPU: 0.25); > 0 fixes it, also on GPU."""
    enforce_eager: bool = False
    """No CUDA graphs on GPU (slower decoding, faster start-up); CPU always runs eager."""

    def check(self, cfg) -> None:
        need(0 < self.gpu_memory_utilization < 1, "gpu_memory_utilization must be in (0, 1)")
        need(self.kv_cache_gb >= 0, f"kv_cache_gb must be >= 0, got {self.kv_cache_gb}")
        need(self.sync_check_every >= 0, f"sync_check_every must be >= 0, got {self.sync_check_every}")
        need(self.max_model_len == 0 or self.max_model_len > cfg.max_new_tokens,
             f"max_model_len {self.max_model_len} leaves no room for a prompt plus max_new_tokens "
             f"{cfg.max_new_tokens} (0 = sized from the data)")


@dataclass
class Episodes(Group):
    TITLE = "an environment's episodes (--env, --agent: nanorl/env.py)"

    env_max_turns: int = 4
    """Model turns per episode; an episode not done by then ends as turn_cap (truncated)."""
    env_max_tokens: int = 0
    """Response tokens per episode, model and environment tokens together (0 = env_max_turns ×
    max_new_tokens); the context bound: reaching it ends the episode as token_cap (truncated)."""
    tool_timeout: float = -1.0
    """Seconds per tool call; > 0 runs tools in a worker process killed at the limit (the episode ends
    as tool_timeout), 0 in-process; -1 = the environment's default (calc 0, python_tool 5, others 10)."""

    def check(self, cfg) -> None:
        moved = self.moved()
        need(cfg.env or not moved, f"{', '.join(moved)} only shape --env episodes: set --env")
        need(self.env_max_turns >= 1 and self.env_max_tokens >= 0,
             "env_max_turns must be >= 1 and env_max_tokens >= 0")
        need(self.tool_timeout >= 0 or self.tool_timeout == -1,
             f"tool_timeout must be >= 0 or -1, got {self.tool_timeout}")


@dataclass
class AsyncRollout(Group):
    TITLE = 'asynchronous rollout (nanorl/pipeline.py): generation overlapped with training'

    async_steps: int = 0
    """K: a worker process samples and scores batch b from weight version max(0, b − K) while the trainer
    trains on the batches before it (so no sample is more than K versions old); 0 = the synchronous loop.
    The worker runs --threads torch threads (1 when 0); correct the staleness with --tis-cap / --mis-high."""
    partial_rollout: str = ""
    """Partial rollouts, per-token versions recorded ("" = off). abort (slime's): with --over-sample F a
    batch keeps F× its groups in flight and, once it has its groups (with --filter-groups: groups with
    reward variance), aborts the rest into a buffer that the next batch resumes first, under its newer
    weights (nanorl/partial_rollout.py) — in the async worker with --async-steps, else in the step
    itself on the trainer's engine (one process: nanorl/sources.py Partial)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """--partial-rollout: tokens sampled under an older version than their sample's newest leave the loss
    (else they train, IS-corrected by their own rollout logprobs with --tis-cap / --mis-high)."""
    rollout_device: str = ""
    """The worker's device, e.g. cuda:1 to give the engine its own GPU; empty = the trainer's."""

    def check(self, cfg) -> None:
        on = self.async_steps > 0
        need(self.async_steps >= 0, f"async_steps must be >= 0, got {self.async_steps}")
        need(not self.mask_offpolicy_in_partial_rollout or self.partial_rollout,
             "mask_offpolicy_in_partial_rollout needs partial_rollout")
        need(not self.rollout_device or on, "rollout_device needs async_steps >= 1")
        if self.rollout_device:
            import torch
            try:
                torch.device(self.rollout_device)
            except RuntimeError:
                need(False, f"rollout_device {self.rollout_device!r} is not a device "
                     "(cpu, cuda, cuda:1, ...)")
        abort = self.partial_rollout == "abort"
        need(not abort or cfg.dapo.over_sample >= 2, "--partial-rollout abort needs --over-sample >= 2: "
             "with only the batch's groups in flight none is ever left unfinished to abort")
        # the rollout worker would wait for new weights forever
        need(not (on and cfg.saving.debug_rollout_only), "debug_rollout_only makes no update, so "
             "--async-steps has no new weights to wait for: drop one")


class _LossParamsGroup(Group):
    """Every registered loss's own settings (nanorl/losses.py register_policy_loss `params`), by flag
    name: a field per field of each settings class, built from the registry below (LossParams)."""
    TITLE = "a loss's own settings (declared where it is registered: nanorl/losses.py)"

    @classmethod
    def help_classes(cls) -> list[type]:
        """Each settings class: --help shows its fields under its loss (its TITLE)."""
        return list(params_owners())

    def params_for(self, policy_loss: str):
        """The settings of `policy_loss` (its registered class, filled from these fields), or None."""
        cls = POLICY_LOSSES[policy_loss].params if policy_loss in POLICY_LOSSES else None
        return None if cls is None else cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    def check(self, cfg) -> None:
        moved = self.moved()
        for cls, losses in params_owners().items():
            for problem in cls(**{f.name: getattr(self, f.name) for f in fields(cls)}).problems():
                need(False, problem)
            mine = [f.name for f in fields(cls) if f.name in moved]
            need(not mine or cfg.policy_loss in losses, f"{', '.join(mine)} needs policy_loss "
                 f"{' or '.join(losses)} (its own setting)")


# one field per field of the registered settings classes (their defaults; docstrings stay with them)
LossParams = dataclass(make_dataclass(
    "LossParams", [(f.name, f.type, field(default=f.default))
                   for cls in params_owners() for f in fields(cls)], bases=(_LossParamsGroup,)))
# importable by name (a spawned rollout worker unpickles the config)
LossParams.__module__ = __name__


@dataclass
class KL(Group):
    TITLE = 'KL to the reference policy (nanorl/kl.py; its β: kl_coef)'

    kl_estimator: str = "k3"
    """k1, k2, k3, abs, or a straight-through k1+/k3+."""
    kl_in_reward: bool = False
    """Put −β·KL in the per-token reward instead of the loss (outcome estimators: score = Σ rewards)."""
    unbiased_kl: bool = False
    """KL as a loss, weighted by π_θ/π_old: unbiased for off-policy tokens (DeepSeek-V3.2; slime's)."""
    log_kl: bool = False
    """With kl_coef 0: still score the reference and log the KL to it (train/kl_ref, train/kl_loss),
    adding it to neither the loss nor the reward."""
    kl_target: float = 0.0
    """> 0: adapt β toward this KL per token (Ziegler et al. 2019), in either placement."""

    def check(self, cfg) -> None:
        need(not self.kl_in_reward or cfg.kl_coef > 0, "kl_in_reward needs kl_coef > 0")
        need(not self.unbiased_kl or (cfg.kl_coef > 0 and not self.kl_in_reward),
             "unbiased_kl weights the KL loss term: needs kl_coef > 0 without kl_in_reward")
        need(self.kl_target >= 0, f"kl_target must be >= 0, got {self.kl_target}")
        need(not self.kl_target or cfg.kl_coef > 0, "kl_target adapts β: needs kl_coef > 0")
        need(not (self.log_kl and cfg.kl_coef > 0), "log_kl is for kl_coef 0: with a KL term the KL is "
             "logged already")


@dataclass
class Distillation(Group):
    TITLE = "on-policy distillation (nanorl/teacher.py): a teacher scores the student's own samples"

    teacher: str = ""
    """Hugging Face name or local path of a teacher LM with the policy's tokenizer: each step it scores
    the sampled tokens (train/teacher_kl logs KL(π_old ‖ π_teacher)); read by --advantage opd (the
    distill preset) or --distill-coef."""
    distill_coef: float = 0.0
    """λ: add λ·(log π_teacher − log π_old) per token to a task-reward estimator's advantages (slime's
    --opd-kl-coef); 0 = off. Not with --advantage opd, which is that signal alone."""

    def check(self, cfg) -> None:
        need(self.distill_coef >= 0, f"distill_coef must be >= 0, got {self.distill_coef}")
        need(not self.distill_coef or self.teacher, "distill_coef needs --teacher (the model whose "
             "log-probs it distils)")


@dataclass
class DAPO(Group):
    TITLE = 'DAPO: dynamic sampling and overlong responses (nanorl/dapo.py)'

    filter_groups: bool = False
    """Dynamic sampling: drop groups whose rewards are all equal and generate more prompts until the
    step has prompts_per_step groups with signal (with --async-steps: in the rollout worker)."""
    max_gen_batches: int = 10
    """Most generation rounds per step before training on the groups found (the recipe's 10)."""
    over_sample: int = 1
    """Over-sampling with abort (with --filter-groups): the first round starts F× the step's prompts
    (F − 1 more batches from the loader), scores each group as its samples stop, and aborts the rest
    once the step has its groups with signal (1 = off; with --async-steps the worker's first round).
    Aborted tokens are logged."""
    drop_truncated: bool = False
    """Overlong filtering: truncated responses leave the loss (they still count in their group's baseline)."""
    overlong_buffer: float = 0.0
    """Soft overlong punishment: the last share of max_new_tokens where the reward falls linearly
    to −overlong_penalty (the paper's 4096 of 20480 = 0.2; 0 = off)."""
    overlong_penalty: float = 1.0
    """The penalty at max_new_tokens of the soft overlong punishment (the paper's 1.0)."""

    def check(self, cfg) -> None:
        abort = cfg.pipeline.partial_rollout == "abort"
        need(self.max_gen_batches >= 1, f"max_gen_batches must be >= 1, got {self.max_gen_batches}")
        need("max_gen_batches" not in self.moved() or self.filter_groups,
             "max_gen_batches needs filter_groups")
        need(self.over_sample >= 1, f"over_sample must be >= 1, got {self.over_sample}")
        need(self.over_sample == 1 or self.filter_groups or abort, "over_sample needs filter_groups (it "
             "aborts once the step has enough groups with reward variance) or --partial-rollout abort")
        need(self.over_sample == 1 or not cfg.env or abort, "over_sample with --env needs --partial-rollout "
             "abort (an episode is several engine calls: only abort stops and resumes it between turns)")
        need(self.over_sample == 1 or not cfg.memory.routing_replay, "over_sample with --routing-replay is "
             "not supported, --partial-rollout abort included: an aborted request's routing is still open")
        need(0 <= self.overlong_buffer < 1, f"overlong_buffer is a share of max_new_tokens in [0, 1), got "
             f"{self.overlong_buffer}")
        need(self.overlong_penalty > 0, "overlong_penalty must be > 0")
        need("overlong_penalty" not in self.moved() or self.overlong_buffer,
             "overlong_penalty needs overlong_buffer")


@dataclass
class OffPolicy(Group):
    TITLE = 'off-policy correction (nanorl/offpolicy.py): π_old against the rollout policy'

    old_logprobs: str = "auto"
    """recompute (a forward before training), rollout (the engine's), or auto (skip when on-policy)."""
    tis_cap: float = 0.0
    """Truncated importance sampling: clip π_old/π_rollout at C (0 = off)."""
    tis_low: float = 0.0
    """TIS: also clip it from below at this (slime's tis_clip_low; 0 = verl's upper-only TIS)."""
    mis_low: float = 0.0
    """Masked IS: zero the loss where π_old/π_rollout is below this (needs mis_high)."""
    mis_high: float = 0.0
    """Masked IS: ... or above this (0 = off; ICEPOP's token band is 0.5 to 5)."""
    is_level: str = "token"
    """TIS / MIS weights per token, or per sequence (the product of the token ratios)."""
    opsm_delta: float = 0.0
    """OPSM: mask negative-advantage tokens of sequences whose mean KL to the rollout exceeds δ (0 = off)."""

    def check(self, cfg) -> None:
        for name in ("tis_cap", "tis_low", "mis_low", "mis_high", "opsm_delta"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(not self.tis_cap or self.tis_cap > 1 > self.tis_low, "TIS needs tis_low < 1 < tis_cap")
        need(not self.tis_low or self.tis_cap, "tis_low needs tis_cap")
        need(not (self.mis_low or self.mis_high) or 0 <= self.mis_low < 1 < self.mis_high,
             "masked IS needs 0 <= mis_low < 1 < mis_high")
        need(self.is_level in ("token", "sequence"),
             f"is_level must be token or sequence, got {self.is_level!r}")
        need(self.is_level == "token" or self.tis_cap or self.mis_high, "is_level needs tis_cap or mis_high")


@dataclass
class Optimisation(Group):
    TITLE = 'optimisation'

    ppo_epochs: int = 1
    """Passes over each rollout batch; > 1 makes later passes off-policy."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the rollout batch is split into this many)."""
    warmup_steps: int = 20
    """Linear warm-up steps (RL on a warm-started policy needs it: ../shared/FACTS.md)."""
    schedule: str = "cosine"
    """After warm-up: constant or cosine."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.99
    """AdamW's second-moment decay (torch's default is 0.999; nanorl has trained with 0.99 throughout)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (added to the second moment's root)."""
    grad_clip: float = 1.0
    """Max global gradient norm."""

    def check(self, cfg) -> None:
        _at_least(self, 1, ("ppo_epochs", "mini_batches"))
        _at_least(self, 0, ("warmup_steps", "weight_decay", "grad_clip"))
        for name in ("adam_beta1", "adam_beta2"):
            need(0 <= getattr(self, name) < 1, f"{name} must be in [0, 1), got {getattr(self, name)}")
        need(self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps}")
        need(cfg.prompts_per_step * cfg.samples_per_prompt >= self.mini_batches,
             "mini_batches cannot exceed the number of samples per step")


@dataclass
class LoRA(Group):
    TITLE = 'LoRA (nanorl/lora.py, PEFT): adapters instead of full fine-tuning'
    PREFIX = 'lora_'

    rank: int = 0
    """> 0: train LoRA adapters of this rank (PEFT) and freeze the base weights: the optimizer holds only
    the adapters, the reference is the same model with its adapters off (no copy), vLLM gets the merged
    weights; with --async-steps each version sent to the worker is the adapters alone. Raise --lr (~10x
    full fine-tuning's, "LoRA Without Regret"). 0 = full fine-tuning."""
    alpha: float = 32.0
    """LoRA's α: the adapters' update is scaled by α / rank (LoRA Without Regret's fixed 32)."""
    dropout: float = 0.0
    """Dropout on the adapters' input in training forwards (the engine samples without it)."""
    target_modules: str = "all-linear"
    """Modules to adapt, comma-separated (e.g. q_proj,v_proj), or all-linear: every linear layer of
    attention and MLP, not the LM head (attention-only LoRA underperforms: LoRA Without Regret)."""
    sync: str = "merged"
    """--engine vllm: merged (the merged weights through the verified full reload) or adapter (vLLM's
    own LoRA: only the adapters move; faster sync, slower generation: docs/bench_results.md)."""

    def check(self, cfg) -> None:
        on = self.rank > 0
        need(self.rank >= 0, f"lora_rank must be >= 0, got {self.rank}")
        need(self.alpha > 0, f"lora_alpha must be > 0, got {self.alpha}")
        need(0 <= self.dropout < 1, f"lora_dropout must be in [0, 1), got {self.dropout}")
        need(all(t.strip() for t in self.target_modules.split(",")),
             f"lora_target_modules: an empty name in {self.target_modules!r}")
        need(self.sync == "merged" or (on and cfg.engine != "hf"), "lora_sync adapter needs lora_rank > 0 "
             "and the vLLM engine (the HF engine samples from the adapted module itself)")
        need(self.sync != "adapter" or self.rank <= VLLM_LORA_RANKS[-1], f"--lora-sync adapter: "
             f"vLLM 0.32 serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got --lora-rank {self.rank}; "
             "use --lora-sync merged")
        # vLLM's level-2 sleep discards the base weights and the adapter sync never resends them: on a
        # GPU the engine would refuse at step 1's sleep, after the model and the engine loaded. Resolved
        # here (a Config cannot tell a typed --sleep-level 2 from the default), with a note.
        if self.sync == "adapter" and cfg.vllm.sleep_level == 2:
            cfg.vllm.sleep_level = 1
            print("config: --lora-sync adapter runs with --sleep-level 1 (level 2 discards the base "
                  "weights, which the adapter sync never resends; 0 keeps the engine resident)",
                  file=sys.stderr)
        for name in ("lora_alpha", "lora_dropout", "lora_target_modules"):
            need(on or name not in self.moved(), f"{name} needs lora_rank > 0 (it does nothing without)")
        need(not (on and cfg.memory.fsdp), "--lora-rank with --fsdp (not built: the merged-weight stream "
             "and the adapters-off reference run on the full module; DDP works, and LoRA's trainer state "
             "is small enough to replicate) is not supported")


@dataclass
class Memory(Group):
    TITLE = 'memory, speed, precision and ranks'

    micro_batch_size: int = 0
    """Samples per forward/backward (0 = all of a mini-batch)."""
    max_tokens_per_micro_batch: int = 0
    """> 0: micro-batches by token budget in every forward and backward (overrides micro_batch_size):
    packed with flash-attention, else padded rows whose padded size fits (nanorl/batching.py)."""
    skip_zero_advantage: bool = True
    """Rows with advantage 0 on every token (a group whose rewards are all equal) skip the update's and
    the reference's forward; denominators still count them. Exact without a KL loss, entropy bonus or
    critic; with them, those rows' KL/entropy pull is dropped. Off for pretrained models (verl, slime)."""
    logprob_impl: str = "fused"
    """fused (never materialise [tokens, vocab]) or naive (materialised log_softmax)."""
    dtype: str = "float32"
    """Compute dtype (autocast; fp16 with a loss scaler); weights, optimizer state and the RL math stay
    fp32 (nanorl/precision.py); the reference model and the vLLM engine hold weights in this dtype."""
    fp32_lm_head: bool = False
    """Compute the LM head in fp32 under bf16/fp16 (narrows the engine/trainer logprob gap)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations."""
    threads: int = 0
    """torch threads; 0 = 1 for the built-in task (its ops are too small to split, and two threads on a
    busy 2-core box stall each other: 10-15x slower steps), torch's default else."""
    fsdp: bool = False
    """Several ranks: shard weights, gradients and optimizer state (FSDP2) instead of replicating them
    (DDP); the HF engine then keeps a full copy of the weights per rank (nanorl/distributed.py)."""
    routing_replay: bool = False
    """MoE only: replay the rollout's experts in every training forward (nanorl/moe_replay.py)."""

    def check(self, cfg) -> None:
        _at_least(self, 0, ("micro_batch_size", "max_tokens_per_micro_batch", "threads"))
        # routing replay's own forward computes π_old under the replayed routing (nanorl/stages.py),
        # which would silently replace the engine's logprobs that --old-logprobs rollout asks for
        need(not (self.routing_replay and cfg.offpolicy.old_logprobs == "rollout"), "--routing-replay "
             "computes π_old in its own forward (the routing it replays), so --old-logprobs rollout would "
             "be ignored: drop --old-logprobs rollout (auto or recompute), or --routing-replay")
        need(not (self.fsdp and self.routing_replay), "--fsdp with --routing-replay is not supported: "
             "routing replay records and replays in forwards of the HF model itself, outside FSDP's root "
             "forward")


@dataclass
class Evaluation(Group):
    TITLE = 'evaluation'

    eval_every: int = 25
    """Held-out greedy accuracy and pass@k every N steps (0 = only before and after)."""
    pass_k: int = 4
    """k of the pass@k evaluation (temperature sampling), i.e. the samples per eval prompt."""
    eval_temperature: float = 0.0
    """Sampling temperature of the pass@k evaluation (0 = the training temperature)."""
    eval_max_new_tokens: int = 0
    """Longest eval response, greedy and pass@k (0 = max_new_tokens)."""
    eval_limit: int = 0
    """Evaluate on at most this many held-out prompts (0 = all)."""

    def check(self, cfg) -> None:
        _at_least(self, 1, ("pass_k",))
        _at_least(self, 0, ("eval_every", "eval_limit", "eval_temperature", "eval_max_new_tokens"))


@dataclass
class Saving(Group):
    TITLE = 'logging and saving'

    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    resume: str = ""
    """Resume from a checkpoint directory, or 'latest' in out_dir."""
    overwrite: bool = False
    """Start over in an out_dir that holds an earlier run: its metrics.jsonl, checkpoints, rollout dumps
    and TensorBoard logs are deleted first (without it, or --resume, such an out_dir is refused)."""
    keep_checkpoints: int = 2
    """How many checkpoints to keep."""
    tensorboard: bool = False
    """Also log to TensorBoard under out_dir."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project."""
    quiet: bool = False
    """No progress bar (metrics still go to out_dir/metrics.jsonl)."""
    dump_rollouts: int = 0
    """Every N steps, out_dir/rollouts/step_NNNNNN.jsonl: each sample's text, reward, per-token values."""
    dump_rollouts_mb: float = 512.0
    """Disk budget of out_dir/rollouts in MiB (the oldest dumps are deleted; one larger dump is cut)."""
    debug_rollout_only: bool = False
    """Rollout + reward (+ metrics, + dumps) each step and no update: to check a reward function or data."""

    def check(self, cfg) -> None:
        _at_least(self, 1, ("keep_checkpoints",))
        _at_least(self, 0, ("save_every", "dump_rollouts"))
        need(self.dump_rollouts_mb > 0, f"dump_rollouts_mb must be > 0, got {self.dump_rollouts_mb}")
        need(not (self.overwrite and self.resume), "--overwrite deletes the earlier run in --out-dir that "
             "--resume continues: drop one")
