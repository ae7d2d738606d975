"""Policy, reference and critic forwards.

Link 3 of the chain (logprob recompute). The trainer scores every response token under three policies:
the old policy π_old (the weights that generated the batch: the denominator of the PPO ratio), the
current policy π_θ (recomputed in every micro-batch, with gradient) and the reference policy π_ref (the
frozen starting model, only when a KL term is on or --log-kl logs it). Start at `response_logprobs`: it
runs a Hugging Face causal LM on a collated batch (nanorl/trajectory.py layout: prompt left-padded to
width P, response right-padded to T); response token t sits at column P + t and is predicted by the
hidden state at column P − 1 + t. Key choices: rows that share a prompt run its prefix once
(`_hidden_shared_prefix`: the same numbers, fewer FLOPs); the head is fused with the log-softmax and the
entropy (nanorl/entropy.py), so the [B·T, V] logits never exist at once (`impl="naive"` materialises
them, for comparison); inside `record_sum_sq_probs()` every scored token also yields Σ_v π_v² from the
same pass (the optimal token baseline needs it). `ValueModel` is PPO's critic: the policy's transformer
with a scalar head, the value at column P − 1 + t estimating V(s_t). The policy and critic hold fp32
masters under autocast, the reference is stored in the compute dtype; every per-token tensor leaves here
as fp32 (nanorl/precision.py).
"""
from __future__ import annotations

import copy
import importlib.util
import os
from contextlib import contextmanager, nullcontext

import torch

from nanorl import gguf_model
from nanorl.entropy import fused_linear_logprobs_entropy, naive_logprobs_entropy
from nanorl.precision import head_is_fp32
from nanorl.presets import model_not_found
from nanorl.trajectory import PaddedBatch

IGNORE = -100
# while record_sum_sq_probs() is active: Σπ² [M] of every head_logprobs call
_SUM_SQ: list | None = None


def best_attn_implementation(compute_dtype: torch.dtype | None = None) -> str:
    """'flash_attention_2' on CUDA with flash-attn installed (varlen packing) and a bf16/fp16 compute
    dtype, else 'sdpa'. flash-attn only takes fp16/bf16 q/k/v ("FlashAttention only support fp16 and
    bf16 data type"): an fp32 run (the weights are fp32 masters, no autocast) would hand it fp32 in
    every forward. None counts as fp32: flash only when the caller says the compute is half."""
    half = compute_dtype in (torch.bfloat16, torch.float16)
    flash = half and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    return "flash_attention_2" if flash else "sdpa"


def load_model(name_or_path: str, device: str = "cpu", compute_dtype: torch.dtype = torch.float32,
               flag: str = "--model"):
    """Any causal LM by Hugging Face name or local path, and its tokenizer. The weights load in fp32
    whatever the checkpoint's dtype: they are the master copy the optimizer updates (a bf16 weight
    cannot hold an RL-sized update; nanorl/precision.py). compute_dtype: the run's --dtype, the dtype
    every forward runs in (autocast). Attention: flash-attention 2 when it is installed, the device is
    CUDA and compute_dtype is bf16/fp16 (packed varlen micro-batches, nanorl/batching.py), else sdpa:
    flash-attn refuses the fp32 q/k/v of an fp32 run. A GGUF file (or a directory holding one) loads
    dequantized, with the tokenizer and chat template in it (nanorl/gguf_model.py). A path that names
    nothing, a truncated weights file, or a tokenizer that cannot pad: one line naming `flag` and the
    path (`_unreadable_model`, `_ensure_pad_token`)."""
    try:
        tokenizer = gguf_model.load_tokenizer(name_or_path)
        model = gguf_model.load_causal_lm(name_or_path, dtype=torch.float32,
                                          attn_implementation=best_attn_implementation(compute_dtype))
    except Exception as e:
        clear = _unreadable_model(name_or_path, e, flag)
        if clear is None:
            raise
        raise clear from e
    _ensure_pad_token(tokenizer, model.get_input_embeddings().num_embeddings, name_or_path, flag)
    was = dropout_off(model)
    if was and int(os.environ.get("RANK", "0")) == 0:
        print(f"nanorl: {flag} {name_or_path} has dropout on ({', '.join(was)}): off in every RL forward "
              "(the engine samples without it, so every ratio and logprob must be scored without it)",
              flush=True)
    model.to(device)
    # training forwards never need the KV cache
    model.config.use_cache = False
    return model, tokenizer


def load_empty_model(name_or_path: str, config, generation_config,
                     compute_dtype: torch.dtype = torch.float32, flag: str = "--model"):
    """What `load_model` returns for the checkpoint another process loaded (--fsdp's rank 0, which hands
    over its model's `config` and `generation_config`), without reading its weights: the same model
    built with its parameters on the meta device (no memory, no values; filled from rank 0 after
    sharding, nanorl/distributed.py `receive_from_rank0`), its buffers real (the rotary frequencies, computed
    from the config), its tokenizer read from `name_or_path` as `load_model` reads it. `layout` tells
    whether the two builds agree."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    tokenizer = gguf_model.load_tokenizer(name_or_path)
    # include_buffers=False: only parameters go to the meta device; buffers (the rotary inv_freq) and
    # whatever else __init__ computes stay real and small, as from_pretrained makes them
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=best_attn_implementation(compute_dtype))
    # from_pretrained ties the output embedding to the input one after loading; from_config on the
    # meta device leaves them two parameters
    model.tie_weights()
    model.generation_config = generation_config
    _ensure_pad_token(tokenizer, model.get_input_embeddings().num_embeddings, name_or_path, flag)
    # rank 0's config already holds the zeros: this only sets the modules' rates as load_model does
    dropout_off(model)
    model.config.use_cache = False
    # from_pretrained returns a model in eval mode
    model.eval()
    return model, tokenizer


def layout(model) -> list[tuple]:
    """What two builds of one model must share: each module's class, each parameter's and buffer's
    name, shape and dtype, and which parameter names are one tensor (tied embeddings)."""
    first: dict[int, str] = {}
    rows = [("module", name, type(m).__name__) for name, m in model.named_modules()]
    rows += [("parameter", name, tuple(p.shape), str(p.dtype), first.setdefault(id(p), name))
             for name, p in model.named_parameters(remove_duplicate=False)]
    rows += [("buffer", name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()]
    return rows


def dropout_off(model) -> list[str]:
    """Switch dropout off for good (p = 0), train mode or not; returns the config's non-zero dropout
    settings it found ("attn_pdrop=0.1", ...). The trainer keeps the policy in train mode (Hugging Face
    checkpoints expect it), where GPT-2's family drops 10% of activations: the π_old recompute and the
    update would each draw their own masks while the engine sampled with none, so the first epoch's
    ratio is not 1 and every logprob is noise (0.095 apart in two scorings of one batch). The seeds'
    Megatron runs set --attention-dropout 0.0 --hidden-dropout 0.0 for the same reason. The config is
    zeroed too (some models read it at forward time; a saved checkpoint says what was trained)."""
    # a multimodal config nests the language model's (get_text_config may return the config itself)
    text = model.config.get_text_config()
    was = []
    for config in [model.config] + ([text] if text is not model.config else []):
        for key, value in sorted(vars(config).items()):
            if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
                was.append(f"{key}={value:g}")
                setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        # attention modules hold their rate as a float (Llama / Qwen: self.attention_dropout)
        for key in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, key, None), float):
                setattr(module, key, 0.0)
    return list(dict.fromkeys(was))


def _unreadable_model(path: str, error: Exception, flag: str = "--model") -> ValueError | None:
    """One line for a --model that cannot be loaded, or None (the library's own error stays): a path
    that names nothing (nanorl/presets.py model_not_found), or a truncated or corrupt safetensors file,
    named (the library's "incomplete metadata" names none)."""
    if isinstance(error, OSError):
        return model_not_found(path, error, flag)
    if type(error).__name__ != "SafetensorError":
        return None
    from safetensors import safe_open

    bad = []
    if os.path.isdir(path):
        for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
            try:
                with safe_open(os.path.join(path, name), "pt"):
                    pass
            except Exception:
                bad.append(name)
    what = f"{os.path.join(path, bad[0])} is" if bad else "a weights file is"
    return ValueError(f"config: {flag} {path}: {what} not a complete safetensors file (truncated or "
                      f"corrupt: {error}); download or save it again")


def _ensure_pad_token(tokenizer, vocab_size: int, path: str, flag: str = "--model") -> None:
    """Give a tokenizer without a usable pad token its EOS token as pad, with a note; refuse when it has
    no EOS token in the model's vocabulary either. Usable: an id the embedding has. Many base models
    ship without one, and transformers 5 then names "<|endoftext|>" the pad token even when the
    vocabulary lacks it (an id one past the embedding: an IndexError in the first rollout). EOS rather
    than a refusal: pad positions are masked out of attention and loss, so any real token pads, and
    EOS is what Hugging Face and TRL pad with."""
    def usable(i):
        return i is not None and 0 <= i < vocab_size

    if usable(tokenizer.pad_token_id):
        return
    if not usable(tokenizer.eos_token_id):
        raise ValueError(f"config: {flag} {path}: the tokenizer has neither a pad token nor an EOS token "
                         f"in the model's vocabulary ({vocab_size} tokens); set pad_token in its "
                         "tokenizer_config.json")
    missing = "none" if tokenizer.pad_token is None else (
        f"{tokenizer.pad_token!r}, id {tokenizer.pad_token_id}, outside the model's {vocab_size} tokens")
    tokenizer.pad_token = tokenizer.eos_token
    print(f"nanorl: {flag} {path}: the tokenizer's pad token ({missing}) is replaced by its EOS token "
          f"{tokenizer.eos_token!r} (pad positions are masked out)", flush=True)


def _hidden(model, batch: PaddedBatch, replay=None) -> torch.Tensor:
    """Hidden states of the columns that predict the response tokens: [B, T, H]."""
    shared = _shared_prompts(model, batch) if replay is None else None
    if shared is not None:
        return _hidden_shared_prefix(model, batch, *shared)
    P, T = batch.prompt_width, batch.response_ids.shape[1]
    with replay if replay is not None else nullcontext():
        h = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids, use_cache=False).last_hidden_state
    return h[:, P - 1:P - 1 + T]  # [B, T, H]


def _shared_prompts(model, batch: PaddedBatch):
    """(first row of each run of rows with one prompt [U], the run each row is in [B]) when runs of
    consecutive rows share their prompt (a GRPO group's samples, as collate lays them out), else None.
    Not with gradient checkpointing (Hugging Face turns the cache off there), FSDP's sharded weights,
    nor a mixture of experts (routing record / replay, nanorl/moe_replay.py, expect whole rows)."""
    P, ids, attn = batch.prompt_width, batch.input_ids, batch.attention_mask
    if P < 2 or ids.shape[0] < 2 or getattr(model, "is_gradient_checkpointing", False):
        return None
    config = getattr(model, "config", None)
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        return None
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return None
    same = ((ids[1:, :P] == ids[:-1, :P]) & (attn[1:, :P] == attn[:-1, :P])).all(-1)  # [B-1] row = previous
    # a 1-token prompt: no prefix to share
    if not bool(same.any()) or not bool(attn[:, :P - 1].any(-1).all()):
        return None
    starts = torch.cat([same.new_ones(1), ~same])  # [B] a row that starts a run
    return starts.nonzero().flatten(), starts.long().cumsum(0) - 1  # [U], [B]


def _hidden_shared_prefix(model, batch: PaddedBatch, first: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """_hidden with each shared prompt run once: columns 0 … P−2 of one row per run go through the model
    with a KV cache, the cache is copied to every row of the run (index_select: differentiable, so each
    row's gradient reaches the shared prefix, summed as the full forward sums it), then the last prompt
    column and the response columns run on top. The same numbers as one full forward (the attention of
    a column sees the same keys and values), for fewer FLOPs: a GRPO group of 8 samples of a 6-token
    prompt and 4 response tokens runs 5 + 8·5 token positions instead of 8·10 (issue 23)."""
    from transformers import DynamicCache

    P, T = batch.prompt_width, batch.response_ids.shape[1]
    cache = DynamicCache()
    model.base_model(input_ids=batch.input_ids[first, :P - 1],
                     attention_mask=batch.attention_mask[first, :P - 1],
                     position_ids=batch.position_ids[first, :P - 1], past_key_values=cache, use_cache=True)
    cache.reorder_cache(run)  # [U, ...] -> [B, ...]
    h = model.base_model(input_ids=batch.input_ids[:, P - 1:], attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids[:, P - 1:], past_key_values=cache,
                         use_cache=True).last_hidden_state  # [B, 1 + T, H]
    return h[:, :T]  # [B, T, H]


def response_logprobs(model, batch: PaddedBatch, temperature: float = 1.0, *, entropy: bool = True,
                      support: torch.Tensor | None = None, impl: str = "fused", replay=None):
    """Per-token logprobs [B, T] (fp32) of the response tokens and their entropies [B, T] (or None).

    support: [B, T, K] kept token ids (keep-sampling-mask), -1 padded; tokens outside get −inf.
    replay: a context manager (nanorl/moe_replay.py) entered around the model forward.
    Padding positions return 0 and get no gradient.
    """
    h = _hidden(model, batch, replay)  # [B, T, H]
    real = batch.attention_mask[:, batch.prompt_width:].bool()  # [B, T] real response tokens
    # Only real tokens go through the LM head (the costliest matmul with a 152k vocabulary), as in
    # the packed path (nanorl/batching.py): padding costs nothing there and gets 0 below.
    sup = support[real] if support is not None else None  # [M, K]
    lp, ent = head_logprobs(model, h[real], batch.response_ids[real], temperature, sup, impl)  # [M], [M]
    zeros = torch.zeros(real.shape, dtype=torch.float32, device=h.device)  # [B, T]
    return zeros.masked_scatter(real, lp.float()), (zeros.masked_scatter(real, ent.float()) if entropy
                                                    else None)


def head_logprobs(model, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  support: torch.Tensor | None = None, impl: str = "fused"):
    """Score hidden states h [N, H] with the LM head: (logprobs [N], entropy [N]) of `targets` [N]
    (IGNORE rows give 0). Fused by default; heads with a bias or a logit transform (Gemma's
    soft-capping, Cohere's scale) fall back to materialised logits."""
    head, want_sq = model.get_output_embeddings(), _SUM_SQ is not None
    if impl == "fused" and getattr(head, "bias", None) is None and not _has_logit_transform(model):
        # The fused function runs its own matmuls: give it the dtype autocast would have used (or
        # fp32 for an fp32 head) explicitly, with autocast off, so forward and backward agree. fp32
        # master weights go in as they are: it casts them per call and returns ∂W in fp32 (m2).
        dev, w = h.device.type, head.weight
        dtype = (torch.float32 if head_is_fp32(head) else
                 torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w.dtype)
        w = w if w.dtype in (dtype, torch.float32) else w.to(dtype)
        with torch.autocast(device_type=dev, enabled=False):
            out = fused_linear_logprobs_entropy(h.to(dtype), w, targets, temperature=temperature,
                                                support=support, sum_sq=want_sq)
    else:
        logits = model.lm_head(h) if hasattr(model, "lm_head") else head(h)  # [N, V]
        out = naive_logprobs_entropy(logits.float(), targets, temperature=temperature, support=support,
                                     sum_sq=want_sq)
    if want_sq:
        _SUM_SQ.append(out[2])
    return out[0], out[1]


@contextmanager
def record_sum_sq_probs():
    """Inside, every scoring forward also returns Σ_v π_v² of each scored token, computed in the same
    fused pass over the vocabulary (no extra forward): yields a list that gets one [M] tensor per LM-head
    call, M = the real response tokens of that call in row-major [B, T] order (the order
    `response_logprobs` and the packed path scatter logprobs in). The optimal token baseline needs it."""
    global _SUM_SQ
    if _SUM_SQ is not None:
        raise RuntimeError("record_sum_sq_probs is already active")
    _SUM_SQ = []
    try:
        yield _SUM_SQ
    finally:
        _SUM_SQ = None


def _has_logit_transform(model) -> bool:
    """Models whose logits are not just `hidden @ W.T` (Gemma's soft-capping, Cohere's scale)."""
    cfg = model.config
    return bool(getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None))


class ValueModel(torch.nn.Module):
    """PPO's critic: the policy's transformer (copied, trained separately) plus a scalar head."""

    def __init__(self, policy):
        super().__init__()
        self.body = copy.deepcopy(policy.base_model)
        # fp32 masters under autocast; else the body's dtype
        dtype = next(policy.parameters()).dtype
        self.head = torch.nn.Linear(policy.config.hidden_size, 1, dtype=dtype)
        # start at V = 0: no bias from a random head
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: PaddedBatch) -> torch.Tensor:
        """Values [B, T] (fp32) of the states before each response token."""
        h = self.body(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, use_cache=False).last_hidden_state
        P, T = batch.prompt_width, batch.response_ids.shape[1]
        h = h[:, P - 1:P - 1 + T]  # [B, T, H]
        h = h if torch.is_autocast_enabled(h.device.type) else h.to(self.head.weight.dtype)
        return self.head(h).squeeze(-1).float()  # [B, T]


def frozen_copy(model, dtype: torch.dtype | None = None):
    """The reference policy: a deep copy with gradients off, its parameters stored in `dtype` (the
    compute dtype: it never trains, so it needs no fp32 master copy). Each parameter is copied
    straight into `dtype` (never a full fp32 duplicate first: 28 GB for a 7B model); tied parameters
    stay tied; buffers (rotary frequencies) are copied as they are, in their own dtype."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), requires_grad=False)
            # deepcopy takes these instead of copying the masters
            for p in model.parameters()}
    ref = copy.deepcopy(model, memo)
    ref.eval()
    return ref

