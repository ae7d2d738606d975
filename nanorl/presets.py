"""Presets: named sets of Config values (`--algo`), and the defaults a pretrained checkpoint gets.

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
                                           ^^^^^^^^^   ^^^^ which estimator, which loss, where KL goes

The Config defaults (nanorl/config.py) are tuned for the built-in tiny task; an `--algo` preset
overrides them, flags override the preset, and a `--model` of pretrained scale (hidden size >=
PRETRAINED_HIDDEN) first gets PRETRAINED_DEFAULTS, each with the reason it was chosen.

    python train.py --help        # every preset, one line each
"""
from __future__ import annotations

import os

# name -> (one line for --help, field overrides). The defaults of Config are GRPO's.
PRESETS: dict[str, tuple[str, dict]] = {
    "grpo": ("group-normalised advantages, PPO clip, K3 KL as a loss (DeepSeekMath)",
             dict(advantage="grpo", kl_coef=0.001, kl_estimator="k3", loss_agg="seq-mean-token-mean")),
    "dr_grpo": ("GRPO without std division or length bias (Dr. GRPO, Liu et al. 2025)",
                dict(advantage="dr_grpo", loss_agg="seq-mean-token-sum-norm")),
    "dapo": ("clip-higher 0.2/0.28, token-mean, dynamic sampling, overlong filter + soft punishment (DAPO)",
             dict(advantage="grpo", clip_high=0.28, loss_agg="token-mean", filter_groups=True,
                  max_gen_batches=10, drop_truncated=True, overlong_buffer=0.2, overlong_penalty=1.0)),
    "rloo": ("leave-one-out baseline (Ahmadian et al. 2024)", dict(advantage="rloo")),
    "reinforce_pp": ("REINFORCE++: KL in the reward, batch-whitened returns (Hu 2025)",
                     dict(advantage="reinforce_pp", kl_coef=0.001, kl_in_reward=True, kl_estimator="k1")),
    "reinforce_pp_baseline": ("REINFORCE++ with a group-mean baseline, K3 KL as a loss",
                              dict(advantage="reinforce_pp_baseline", kl_coef=0.001, kl_estimator="k3")),
    "ppo": ("critic + GAE + clipped value loss (Schulman et al. 2017)",
            dict(advantage="gae", lam=0.95, vf_coef=0.5, loss_agg="token-mean")),
    "gspo": ("sequence-level ratio and clip (GSPO, Zheng et al. 2025)",
             dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean")),
    "cispo": ("clipped, stop-gradient IS weight times logprob (MiniMax-M1 2025)",
              dict(policy_loss="cispo", clip_low=1.0, clip_high=4.0, loss_agg="token-mean")),
    "gmpo": ("geometric mean of token ratios per sequence (GMPO, Zhao et al. 2025)",
             dict(policy_loss="gmpo", clip_low=0.4, clip_high=0.4, loss_agg="seq-mean-token-mean")),
    "opo": ("length-weighted group baseline (OPO, Hao et al. 2025)", dict(advantage="opo")),
    "otb": ("optimal token baseline, variance-weighted per timestep", dict(advantage="otb")),
    "remax": ("greedy-response reward as the baseline (ReMax, Li et al. 2023)", dict(advantage="remax")),
    "sapo": ("soft gate σ(τ(r−1))·4/τ instead of a clip, seq-mean-token-mean (SAPO, Gao et al. 2025)",
             dict(policy_loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, loss_agg="seq-mean-token-mean")),
    "gpg": ("REINFORCE loss, group-mean advantage rescaled for zero-variance groups (GPG, Chu et al. 2025)",
            dict(advantage="gpg", policy_loss="gpg", loss_agg="token-mean")),
    "kl_cov": ("KL penalty on the highest-covariance tokens (KL-Cov, Cui et al. 2025; verl's defaults)",
               dict(policy_loss="kl_cov", cov_ratio=2e-4, cov_kl_coef=1.0, loss_agg="token-mean")),
    "clip_cov": ("detach random high-covariance tokens (Clip-Cov, Cui et al. 2025; verl's defaults)",
                 dict(policy_loss="clip_cov", cov_ratio=2e-4, loss_agg="token-mean")),
    "distill": ("on-policy distillation: reverse KL to --teacher on the student's own samples (opd)",
                dict(advantage="opd", loss_agg="token-mean")),
    "gdpo": ("each reward component normalised in its group, then summed (GDPO)",
             dict(advantage="gdpo", reward="exact_format")),
}


# Defaults for a pretrained policy (--model with hidden size >= PRETRAINED_HIDDEN), below presets and
# flags. The Config defaults are tuned for the built-in tiny task; these are for real checkpoints:
PRETRAINED_DEFAULTS: dict[str, tuple[object, str]] = {
    "lr": (1e-6, "TRL GRPOConfig's default; verl's GRPO examples; DAPO (Yu et al. 2025)"),
    "warmup_steps": (10, "DAPO: linear warm-up over 10 rollout steps"),
    "schedule": ("constant", "DAPO and verl's default (constant after warm-up)"),
    "dtype": ("bfloat16", "verl FSDP mixed precision: bf16 compute, fp32 master weights"),
    "gradient_checkpointing": (True, "verl's GRPO examples enable it"),
    "max_tokens_per_micro_batch": (16384, "verl's ppo_max_token_len_per_gpu default"),
    "max_new_tokens": (1024, "verl's GSM8K GRPO example: max_response_length 1024"),
    "skip_zero_advantage": (False, "verl and slime train every row: zero-advantage rows keep their KL pull"),
}
PRETRAINED_HIDDEN = 512  # every pretrained LM from ~100M parameters up; nanorl's tiny models are <= 256


def cpu_defaults() -> dict[str, tuple[object, str]]:
    """What replaces two of the GPU choices above on a machine without CUDA. Measured with GRPO on
    SmolLM2-135M (8 x 8 samples, 24 tokens, 2 threads; docs/bench_results.md): activation checkpointing
    re-runs the forward and buys memory a laptop has (train phase 11 s without, 19 s with, in bf16);
    bf16 autocast pays only where the CPU has bf16 instructions (train 11 s vs fp32's 15 s), and is
    emulated, ~18x slower, where it has not (an AVX2-only CPU)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return {"gradient_checkpointing": (False, "a CPU run: recomputing the forward costs more than it saves"),
            "dtype": ("bfloat16" if native else "float32",
                      "this CPU has bf16 instructions" if native else "this CPU has no bf16 instructions")}


def pretrained_defaults(model: str, overridden: set[str]) -> dict:
    """PRETRAINED_DEFAULTS when `model` is a pretrained-scale checkpoint (cpu_defaults over them without
    CUDA), printed once (the ones a flag or the preset sets are left out); {} for the built-in or a tiny
    model."""
    hidden = model_hidden_size(model) if model else 0
    if hidden < PRETRAINED_HIDDEN:
        return {}
    import torch
    table = {**PRETRAINED_DEFAULTS, **({} if torch.cuda.is_available() else cpu_defaults())}
    chosen = {k: v for k, (v, _) in table.items() if k not in overridden}
    if chosen:
        why = "; ".join(f"{k}={v} ({table[k][1]})" for k, v in chosen.items())
        print(f"nanorl: pretrained-model defaults for {model} (hidden size {hidden} >= {PRETRAINED_HIDDEN}): "
              f"{why}. Flags override them.", flush=True)
    return chosen


def model_hidden_size(model: str) -> int:
    """The hidden size in a checkpoint's config (a local path or a cached/downloadable hub name)."""
    from nanorl.gguf_model import load_config

    try:
        # a GGUF file's config is in its metadata
        cfg = load_config(model)
    except OSError as e:
        clear = model_not_found(model, e)
        if clear is None:
            raise
        raise clear from e
    cfg = getattr(cfg, "text_config", None) or cfg  # multimodal configs nest the language model's
    return int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "d_model", 0) or 0)


def model_not_found(model: str, error: OSError, flag: str = "--model") -> ValueError | None:
    """The one line for a --model (or `flag`: --teacher, ...) that names nothing: transformers answers
    a missing local path with "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" (it
    took the path for a hub name), and an uncached hub name offline with a paragraph. None when
    `model` exists (a directory transformers cannot read: its own message names the missing file).
    "config: " makes the command line print it as one line (nanorl/config.py user_error_line)."""
    if os.path.exists(model):
        return None
    # a hub name is `name` or `owner/name`; anything else can only be a local path
    path_like = model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model
    if path_like or model.endswith(".gguf"):
        return ValueError(f"config: {flag} {model}: no such file or directory")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ValueError(f"config: {flag} {model}: no such local path, and not a Hugging Face hub model that "
                      f"is cached here or can be downloaded ({first[:200]})")
