"""Configuration: one dataclass, a docstring per field; every flag of train.py is a field of `Config`.

Read the class top to bottom. Its first section holds the flags a GRPO run sets first; then one section per
concern (data, reward, sampling, engine, environments, async, advantage, loss and each loss's own
knobs, KL, distillation, DAPO, off-policy, optimisation, memory, evaluation). `--help` shows the same
sections in the same order: each `# --- title` comment line is an argument group (`help_layout` reads
them from the source). An `--algo` preset (nanorl/presets.py) is a named set of field values; flags
given override it.

`__post_init__` rejects out-of-range values and flags that would do nothing, with a message naming the
field (the rules: nanorl/config_checks.py). It reads fields only: user code (--plugin, file.py:fn) is
loaded and checked at set-up, by nanorl/plugins.py `apply`, which returns the config with the plug-in's
values filled in.

    python train.py --help        # the flags by section, then every preset
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
from dataclasses import dataclass, fields

from nanorl import config_checks
from nanorl.config_checks import BUILTIN_ENV_NAMES, CHOICES, ConfigError  # noqa: F401 (read from here too)
from nanorl.presets import PRESETS, pretrained_defaults

# Rewards run in worker processes with this per-call timeout unless --reward-timeout says otherwise
# (nanorl/rewards.py reads it as BOUNDED): the math verifier (SymPy), which adversarial output can keep
# busy; the code reward, which bounds each test case itself (5 s, nanorl/code_reward.py) — 120 s per
# program, its cases run in parallel worker processes; a reasoning-gym task's checker (some parse or
# simulate the answer)
BOUNDED_REWARDS = {"math": 10.0, "math_format": 10.0, "code": 120.0, "reasoning_gym": 30.0}
# A user's reward (file.py:fn / module:fn) may hang on anything (a network call, a solver, a bug): by
# default it runs in worker processes too, and a call past this many seconds scores 0 and is counted
USER_REWARD_TIMEOUT = 60.0
# Fields with a fixed set of values: argparse offers them as choices, __post_init__ checks them


@dataclass
class Config:
    # --- start here: the flags a GRPO run sets first
    algo: str = "grpo"
    """Preset: a named set of the fields below (each listed at the end of --help; nanorl/presets.py)."""
    model: str = ""
    """Hugging Face name or local path of a causal LM, or a GGUF file (nanorl/gguf_model.py); empty = the
    built-in tiny Qwen2 (nanorl/task.py)."""
    train_data: str = ""
    """Prompts: a .jsonl / .parquet file, a `datasets` name[:config][@split] (split default train) or
    reasoning_gym:NAME?size=N&seed=S&... (nanorl/reasoning_tasks.py); empty = the built-in arithmetic
    task (nanorl/data.py)."""
    test_data: str = ""
    """Eval sets, comma-separated, each [name=]source in the same forms (split default test), logged
    as eval/<name>/...; empty = the built-in held-out split."""
    reward: str = "exact"
    """Reward: exact, math, format, math_format, exact_format, code, reasoning_gym (the task's checker),
    or module:function / file.py:function
    (fn(prompt, response, label[, sample]); dict keys starting with "_" are logged only)."""
    engine: str = "auto"
    """hf (the trainer's own module), vllm (in-process, weights hot-swapped), or auto: vllm on a GPU
    when importable, else hf (on CPU, vLLM's start-up and kernel compile cost more than a tiny run)."""
    steps: int = 800
    """Optimizer steps (one rollout batch each, times ppo_epochs × mini_batches)."""
    prompts_per_step: int = 16
    """Prompts sampled per optimizer step (over all ranks)."""
    samples_per_prompt: int = 8
    """Responses per prompt (the group size of GRPO/RLOO)."""
    max_new_tokens: int = 4
    """Longest response; longer ones are cut and marked truncated."""
    lr: float = 2e-4
    """AdamW learning rate (the built-in task's, docs/bench_results.md; pretrained models get 1e-6)."""
    kl_coef: float = 0.0
    """β of the KL to the reference policy (0 = no reference model at all; the grpo preset: 0.001)."""
    out_dir: str = "runs/nanorl"
    """Where metrics, checkpoints and the built-in task files go."""
    seed: int = 0
    """Seeds data order, sampling and the built-in model."""
    # --- data and prompt format (nanorl/data.py PromptFormat)
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
    # --- reward and plug-ins (nanorl/rewards.py, nanorl/plugins.py, docs/extending.md)
    reward_timeout: float = -1.0
    """Seconds per reward call; > 0 runs rewards in worker processes and scores a hung call 0; 0 runs
    them in-process; -1 = 10 s for the math rewards, 120 s for code, 30 s for reasoning_gym
    (BOUNDED_REWARDS), 60 s for a user's file.py:fn (USER_REWARD_TIMEOUT), else 0."""
    reward_postprocess: str = ""
    """module:function / file.py:function run on the step's scored Samples (groups in order): may write
    Sample.metadata and set rewards, in place."""
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
    sample_filter: str = ""
    """module:function / file.py:function fn(samples) -> list[bool]: True keeps a scored sample; run after
    the rewards and before the advantages, on top of the default (failed samples never train)."""
    log_metadata: str = ""
    """Comma list of numeric Sample.metadata fields to log as step means under their own names; a name
    ending in "/" is a prefix (e.g. calib/)."""
    plugin: str = ""
    """file.py (or module) whose reward, reward_postprocess, advantage, policy_loss, LOG_METADATA, CONFIG
    (a dict of fields) and make_task(out_dir) fill the settings left at their defaults."""
    # --- sampling (nanorl/rollout.py, nanorl/sampling.py)
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
    # --- the vLLM engine (--engine vllm, nanorl/vllm_engine.py)
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
    # --- multi-turn environments (nanorl/env.py): the environment answers between turns, scores episodes
    env: str = ""
    """calc (the built-in task with a calculator; builds its own model without --model), python_tool
    (a Python-expression tool with ChatML tool calls, for chat models), or module:Class / file.py:Class;
    empty = single-turn responses scored by --reward."""
    env_max_turns: int = 4
    """Model turns per episode; an episode not done by then ends as turn_cap (truncated)."""
    env_max_tokens: int = 0
    """Response tokens per episode, model and environment tokens together (0 = env_max_turns ×
    max_new_tokens); the context bound: reaching it ends the episode as token_cap (truncated)."""
    tool_timeout: float = -1.0
    """Seconds per tool call; > 0 runs tools in a worker process killed at the limit (the episode ends
    as tool_timeout), 0 in-process; -1 = the environment's default (calc 0, python_tool 5, others 10)."""
    agent: str = ""
    """file.py:fn or module:fn, an agent function run per episode against an OpenAI-compatible endpoint
    that serves the policy during rollouts; it returns the episode's reward (nanorl/agent.py, docs/agents.md).
    Without --model: the built-in task's calculator variant (its tokenizer has a chat template)."""
    # --- asynchronous rollout (nanorl/pipeline.py): generation overlapped with training
    async_steps: int = 0
    """K: a worker process samples and scores batch b from weight version max(0, b − K) while the trainer
    trains on the batches before it (so no sample is more than K versions old); 0 = the synchronous loop.
    The worker runs --threads torch threads (1 when 0); correct the staleness with --tis-cap / --mis-high."""
    partial_rollout: str = ""
    """Partial rollouts, per-token versions recorded ("" = off). abort (slime's): with --over-sample F the
    worker keeps F× the batch's groups in flight and, once the batch has its groups, aborts the rest
    into a buffer that the next batch resumes first, under its newer weights (nanorl/partial_rollout.py)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """--partial-rollout: tokens sampled under an older version than their sample's newest leave the loss
    (else they train, IS-corrected by their own rollout logprobs with --tis-cap / --mis-high)."""
    rollout_device: str = ""
    """The worker's device, e.g. cuda:1 to give the engine its own GPU; empty = the trainer's."""
    # --- advantage estimator (nanorl/advantage.py)
    advantage: str = "grpo"
    """Advantage estimator (nanorl/advantage.py ADVANTAGE_ESTIMATORS), or a user one as file.py:fn."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++, OTB)."""
    lam: float = 1.0
    """GAE λ."""
    vf_coef: float = 0.0
    """Value-loss coefficient; > 0 creates a critic (PPO, GAE)."""
    whiten_advantages: bool = True
    """Whiten the advantages over the batch where the estimator does (gae, reinforce_pp,
    reinforce_pp_baseline, gdpo); --no-whiten-advantages keeps them raw (slime's option)."""
    gdpo_weights: str = ""
    """GDPO: comma-separated weight per reward component, in the reward's component order (empty = all 1)."""
    # --- policy loss (nanorl/losses.py)
    policy_loss: str = "ppo"
    """Policy loss (nanorl/losses.py POLICY_LOSSES): ppo, gspo, cispo, gmpo, dppo_tv, dppo_kl, sapo,
    reinforce, gpg, dro, kl_cov, clip_cov; or a user one as file.py:fn."""
    loss_agg: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """Lower clip ε (ratio ≥ 1 − ε) or the loss's own lower bound."""
    clip_high: float = 0.2
    """Upper clip ε (ratio ≤ 1 + ε); DAPO's clip-higher raises it."""
    dual_clip: float = 3.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    top_entropy_quantile: float = 0.0
    """> 0: train only on the top q of the step's tokens by entropy (Wang et al. 2025, "80/20": 0.2)."""
    # --- one loss's own knobs: SAPO, DRO, KL-Cov / Clip-Cov (each needs its policy_loss)
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature τ for A > 0 (Gao et al. 2025: 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature τ for A ≤ 0 (Gao et al. 2025: 1.05; larger damps negative updates faster)."""
    dro_beta: float = 1.0
    """DRO: β of the quadratic penalty ½β(log π_θ − log π_old)² (verl requires it set; no paper default)."""
    cov_ratio: float = 2e-4
    """KL-Cov / Clip-Cov: share of the step's tokens selected by covariance (verl's default 2e-4)."""
    cov_kl_coef: float = 1.0
    """KL-Cov: κ of κ·|log r| on the selected tokens (verl's kl_cov fallback 1.0)."""
    # --- KL to the reference policy (nanorl/kl.py; its β: kl_coef)
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
    # --- on-policy distillation (nanorl/teacher.py): a teacher scores the student's own samples
    teacher: str = ""
    """Hugging Face name or local path of a teacher LM with the policy's tokenizer: each step it scores
    the sampled tokens (train/teacher_kl logs KL(π_old ‖ π_teacher)); read by --advantage opd (the
    distill preset) or --distill-coef."""
    distill_coef: float = 0.0
    """λ: add λ·(log π_teacher − log π_old) per token to a task-reward estimator's advantages (slime's
    --opd-kl-coef); 0 = off. Not with --advantage opd, which is that signal alone."""
    # --- DAPO: dynamic sampling and overlong responses (nanorl/dapo.py)
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
    # --- off-policy correction (nanorl/offpolicy.py): π_old against the rollout policy
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
    # --- optimisation
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
    # --- LoRA (nanorl/lora.py, PEFT): adapters instead of full fine-tuning
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank (PEFT) and freeze the base weights: the optimizer holds only
    the adapters, the reference is the same model with its adapters off (no copy), vLLM gets the merged
    weights. Raise --lr (~10x full fine-tuning's, "LoRA Without Regret"). 0 = full fine-tuning."""
    lora_alpha: float = 32.0
    """LoRA's α: the adapters' update is scaled by α / rank (LoRA Without Regret's fixed 32)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input in training forwards (the engine samples without it)."""
    lora_target_modules: str = "all-linear"
    """Modules to adapt, comma-separated (e.g. q_proj,v_proj), or all-linear: every linear layer of
    attention and MLP, not the LM head (attention-only LoRA underperforms: LoRA Without Regret)."""
    lora_sync: str = "merged"
    """--engine vllm: merged (the merged weights through the verified full reload) or adapter (vLLM's
    own LoRA: only the adapters move; faster sync, slower generation: docs/bench_results.md)."""
    # --- memory, speed, precision and ranks
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
    # --- evaluation, logging, saving
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

    def __post_init__(self):
        if self.reward_timeout == -1:
            user = USER_REWARD_TIMEOUT if ":" in self.reward else 0.0
            self.reward_timeout = BOUNDED_REWARDS.get(self.reward, user)
            # plugins.apply resolves it again when a plug-in changes the reward
            self._auto_reward_timeout = True
        config_checks.check(self)

    def check_estimator(self, fn) -> None:
        """The checks that read what a user advantage estimator `fn` declares (plugins.apply)."""
        config_checks.check_estimator(self, fn)

    @property
    def chat_template_dict(self) -> dict | None:
        """chat_template_kwargs parsed ({} when empty; None when it is not a JSON object)."""
        try:
            value = json.loads(self.chat_template_kwargs or "{}")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def episode_tokens(self) -> int:
        """--env: the most response tokens of one episode (0 without an environment)."""
        return (self.env_max_tokens or self.env_max_turns * self.max_new_tokens) if self.env else 0

    @property
    def advantage_fn(self):
        """The estimator: a registry name as is, or the user function --advantage names."""
        return _user_fn(self.advantage, "advantage")

    @property
    def policy_loss_fn(self):
        """The policy loss: a registry name as is, or the user function --policy-loss names."""
        return _user_fn(self.policy_loss, "policy_loss")

    @property
    def uses_reference(self) -> bool:
        """A reference model exists only when a KL term is on, or --log-kl logs it."""
        return self.kl_coef > 0 or self.log_kl


def _user_fn(spec: str, what: str):
    if ":" not in spec:
        return spec
    # user code: nanorl.plugins is imported only when a flag names a plug-in
    from nanorl.plugins import resolve
    return resolve(spec, what)


def help_layout() -> list[tuple[str, list[tuple[str, str]]]]:
    """Config's `# --- title` sections in source order, each with its (field, docstring) pairs: the
    argument groups of --help, read from this file (one source of truth for the class and the help)."""
    source = inspect.getsource(Config)
    titles = [(i, line.strip()[6:]) for i, line in enumerate(source.splitlines(), 1)
              if line.strip().startswith("# --- ")]
    groups: dict[str, list] = {title: [] for _, title in titles}
    body = ast.parse(source).body[0].body
    for node, doc in zip(body, body[1:]):
        is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and is_doc:
            title = [t for line, t in titles if line < node.lineno][-1]
            groups[title].append((node.target.id, doc.value.value))
    return list(groups.items())


def user_error_line(e: BaseException, prog: str = "train.py") -> str | None:
    """The one line the command line prints for a user's mistake, or None for anything else (a bug,
    which keeps its traceback). A mistake: a ConfigError (every `need` rule, a refused --out-dir), a
    ValueError whose message starts with "config: " (the convention of the checks outside
    config_checks, e.g. nanorl/plugins.py), or either as the cause of another rank's stop (several
    ranks: nanorl/distributed.py fail_together raises "rank R stopped because ..." from it). Field
    names in the message become the flags the user typed (lr → --lr)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConfigError) or (isinstance(e, ValueError) and str(e).startswith("config: ")):
            return f"{prog}: error: {_as_flags(str(e).removeprefix('config: '))}"
        e = e.__cause__
    return None


_FIELD_NAMES = sorted((f.name for f in fields(Config)), key=len, reverse=True)


def _as_flags(msg: str) -> str:
    """msg on one line, its field names as flags: every name with an underscore (no English word has
    one), and a one-word name where it is a subject or an object (the message's first word, the word
    after a first "unknown", after "need(s)", or after "and" / "/" before "must" / "need(s)"):
    "gamma and lam must be ..." → "--gamma and --lam must be ..."; "a reward model" stays as it is."""
    msg = " ".join(msg.split())
    names = "|".join(re.escape(n) for n in _FIELD_NAMES if "_" in n)
    msg = re.sub(rf"(?<![-\w./:'])({names})(?![\w'])", lambda m: "--" + m.group(1).replace("_", "-"), msg)
    words = "|".join(re.escape(n) for n in _FIELD_NAMES if "_" not in n)
    msg = re.sub(rf"^({words})(?=[ :,])", r"--\1", msg)
    msg = re.sub(rf"^unknown ({words}) ", r"unknown --\1 ", msg)
    msg = re.sub(rf"\b(needs? )({words})\b(?![-\w])", r"\1--\2", msg)
    return re.sub(rf"(and |/ )({words})(?= must| need)", r"\1--\2", msg)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (its default prints the usage line first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(argv: list[str] | None = None) -> Config:
    """Flags → Config: preset values first, then every flag the user actually gave."""
    presets = "\n".join(f"  {k:<22} {v[0]}" for k, v in PRESETS.items())
    parser = _Parser(usage="%(prog)s [--algo PRESET] [--flag VALUE ...]", add_help=False,
                                     description="nanorl: RL for language models. Every flag is a field of "
                                     "nanorl/config.py; start with the first group.",
                                     epilog="presets (--algo):\n" + presets,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = {f.name: f.default for f in fields(Config)}
    for i, (title, items) in enumerate(help_layout()):
        group = parser.add_argument_group(title)
        if i == 0:
            group.add_argument("-h", "--help", action="help", help="show this help message and exit")
        for name, doc in items:
            default = defaults.pop(name)
            # argparse %-formats help strings: a literal % is doubled
            kw = dict(default=argparse.SUPPRESS, help=f"{doc} (default {default!r})".replace("%", "%%"))
            if isinstance(default, bool):
                kw.update(action=argparse.BooleanOptionalAction)
            else:
                kw.update(type=type(default), choices=CHOICES.get(name),
                          metavar=None if name in CHOICES else name.upper())
            group.add_argument("--" + name.replace("_", "-"), **kw)
    # a field without a docstring, or above every section, would have no flag
    if defaults:
        raise RuntimeError(f"Config fields outside --help's groups: {sorted(defaults)}")
    given = vars(parser.parse_args(argv))
    algo = given.get("algo", Config.algo)
    if algo not in PRESETS:
        parser.error(f"unknown --algo {algo!r}; valid: {', '.join(PRESETS)}")
    base = pretrained_defaults(given.get("model", ""), set(given) | set(PRESETS[algo][1]))
    return Config(**{**base, **PRESETS[algo][1], **given, "algo": algo})
