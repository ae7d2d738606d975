"""gpu_check.py stages 9-11 (issue 45): the fused head on a second GPU, the TF32 sync bound, vLLM's runner.

Stage 9 (M2, `device_head_stage`): the Triton fused head with its tensors on cuda:1 while cuda:0 is
current, in a child process (a kernel launched on the wrong device can end the process's CUDA context).
Stage 10 (TF32, `tf32_stage`): the gap TF32 matmuls open between fp32 trainer and engine, held to the
bound nanorl/sync_check.py `sync_bound` picks. Stage 11 (N2, `runner_stage`): which model runner vLLM
runs on this device, and its sync check across sleep and wake-up; skipped without vLLM (`need_vllm`).
Criteria: `crit_device_head`, `crit_tf32`, `crit_runner`.
"""
from __future__ import annotations

import importlib.util
import pathlib

import torch

# random_batch, micro_batch_loss (never `bench`: bench imports this file)
import bench_steps
from gpu_checks.common import Check, finite, in_child, sync
from gpu_checks.step_and_head import peaked_head
from nanorl import entropy
from nanorl.rollout import SamplingConfig


# 9 (M2): the fused head with its tensors on another device than the current one
def device_head_child(H: int, V: int, N: int, chunk: int, device: str, backend: str) -> dict:
    """The current device stays cuda:0, the head's tensors live on `device` (cuda:1): the Triton kernels
    must launch on their tensors' device. Compared with the torch path on the same tensors."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    h, w = peaked_head(N, H, V, dev)
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, V, (N,), generator=g).to(dev)                              # [N]
    out = {}
    for b in dict.fromkeys((backend, "torch")):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = entropy.fused_linear_logprobs_entropy(hh, ww, targets, 0.7, None, chunk_size=chunk,
                                                        backend=b)
        gh, gw = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), [hh, ww])
        sync(dev)
        out[b] = [x.detach().float() for x in (lp, ent, gh, gw)]
    errs = {n: float((a - b).abs().max() / (b.abs().max() if n.startswith("grad") else 1))
            for n, a, b in zip(("logprob", "entropy", "grad_h", "grad_w"), out[backend], out["torch"])}
    return dict(errors=errs, devices=sorted({str(x.device) for x in out[backend]}), want=str(dev),
                current=torch.cuda.current_device() if dev.type == "cuda" else None, backend=backend)


def need_second_gpu() -> str | None:
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        return "one GPU: M2 (the fused head on a second device) needs two"
    return None


def device_head_stage(c: Check) -> dict:
    """9 (M2): the Triton fused head (logprobs, entropy, both gradients) with its tensors on cuda:1 while
    cuda:0 is current, against the torch path, in a child process (a kernel launched on the wrong device
    can end the process's CUDA context). --cpu: the torch path on the host stands in."""
    H, V = c.sizes.head[-1]
    cuda = c.device.type == "cuda"
    r = in_child(c, f"{__name__}:device_head_child", dict(H=H, V=V, N=c.sizes.N, chunk=c.sizes.chunk,
                                              device="cuda:1" if cuda else "cpu",
                                              backend="triton" if cuda else "torch"))
    if "errors" in r:
        c.row("9 M2", f"fused head on {r['want']}, current device {r['current']}, {r['backend']}",
              ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items()), "vs the torch path")
    return r


def crit_device_head(r: dict) -> list[str]:
    """Stage 9: no error, every output on the tensors' device, and the kernel agrees with the torch path
    (stage 2's "bf16 vs torch path" bounds)."""
    if "errors" not in r:
        return [f"error: {r.get('error', '')[-400:]}"]
    tol = dict(logprob=1e-3, entropy=1e-3, grad_h=1 / 64, grad_w=1 / 64)
    bad = [f"outputs on {r['devices']}, want {r['want']}"] if r["devices"] != [r["want"]] else []
    return bad + [f"{k} vs torch path: max|Δ| {v:.2e} > {tol[k]:.0e}" for k, v in r["errors"].items()
                  if not (finite(v) and v <= tol[k])]


# 10: TF32 against the fp32 sync bound
def tf32_stage(c: Check) -> dict:
    """10: an fp32 run's logprobs with TF32 matmuls (what train.py's precision.setup_device turns on) vs
    full fp32 (what vLLM computes by default), on the stage-1 shape with its LM head scaled to peaked
    logits; the statistic the sync check holds to the bound `sync_check.sync_bound` picks for this
    process's precision. --cpu: no TF32 (the precision setting is a no-op there)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl.policy import response_logprobs
    from nanorl.sync_check import SYNC_BOUNDS, sync_bound
    s, dev = c.sizes, c.device
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM(Qwen2Config(**s.model, attn_implementation="sdpa"))
    model.config.use_cache = False
    model.eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # logits of std ~5: a trained model's spread (tied: embeddings too)
    P = s.T // 4
    batch = bench_steps.random_batch([(P, s.T - P)] * s.rows, model.config.vocab_size, dev)
    stat, bound, named = sync_bound(torch.float32, torch.float32)  # under this process's precision
    was, lp = torch.get_float32_matmul_precision(), {}
    try:
        for precision_ in ("highest", was):
            torch.set_float32_matmul_precision(precision_)
            with torch.no_grad():
                lp[precision_] = response_logprobs(model, batch, 1.0, entropy=False)[0]   # [rows, T − P]
    finally:
        torch.set_float32_matmul_precision(was)
    d = (lp[was] - lp["highest"]).abs()[batch.response_mask > 0]
    r = dict(precision=was, stat=stat, bound=bound, named=named, max=float(d.max()), mean=float(d.mean()),
             fp32_bound=SYNC_BOUNDS[torch.float32][1])
    c.row("10 TF32", f"fp32 logprobs, matmul precision {was} vs highest, {s.rows}×{s.T}",
          f"max {r['max']:.1e}, mean {r['mean']:.1e}", f"sync check: {stat} <= {bound:g} ({named}); the "
          f"fp32 max bound {r['fp32_bound']:g} would " + ("fail" if r["max"] > r["fp32_bound"] else "hold"))
    del model
    return r


def crit_tf32(r: dict) -> list[str]:
    """Stage 10: the sync check's statistic of the TF32 gap within the bound sync_bound picks here (a
    build that held a TF32 run to the fp32 max bound would raise a false sync error)."""
    value = r[r["stat"]]
    if not (finite(value) and value <= r["bound"]):
        return [f"{r['stat']} |Δlogprob| {value:.2e} > the sync bound {r['bound']:g} ({r['named']}, matmul "
                f"precision {r['precision']}): a healthy fp32 run would fail its sync check"]
    return []


# 11 (N2): vLLM's model runner, when vLLM is installed
N2_NOT_HERE = ("routed experts (R3) and LoRA adapters on V2 are not run here: tests/test_moe_replay.py and "
               "tests/test_lora_vllm.py on a GPU machine with vLLM")


def need_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM not installed: Model Runner V2 (N2: every CUDA run of vLLM 0.32) not checked; "
                "with vLLM this stage checks the runner, the sync check before and after a sleep/wake cycle; "
                + N2_NOT_HERE)
    return None


def runner_stage(c: Check) -> dict:
    """11 N2: which model runner vLLM runs here (V2 on CUDA, V1 on CPU: never run before on V2), and the
    engine's sync check on it: weights streamed in, then sleep (level 2: weights and KV cache dropped,
    with CUDA graphs captured) and wake through a second update, each version held to the sync bound
    against the trainer's own forward. A tiny fp32 Qwen2 shape: what V2 changes, not speed."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl.sync_check import SyncError
    from nanorl.vllm_engine import VLLMEngine

    def version(v: int):
        torch.manual_seed(v)
        cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                          bos_token_id=0, eos_token_id=1, initializer_range=0.2)
        return Qwen2ForCausalLM(cfg).float().eval()
    path = pathlib.Path(c.workdir, "n2_tiny").as_posix()
    version(0).save_pretrained(path)
    cpu = c.device.type != "cuda"
    eng = VLLMEngine(path, dtype="float32", seed=0, max_model_len=256,
                     kv_cache_bytes=(4 << 20) if cpu else None, gpu_memory_utilization=0.1)
    r = dict(runner=eng.model_runner, want="v1" if cpu else "v2", sleep=eng.sleep_supported, checks=[],
             error="")
    prompts, sampling = [[0, 5, 6, 7] * 5, [0, 9] * 9], SamplingConfig(max_new_tokens=16, seed=0)
    try:
        for v in (1, 2):
            model = version(v).to(c.device)
            if v == 2:
                eng.sleep(2)  # CPU: no sleep mode, logged; CUDA: weights and KV cache dropped
            eng.update_weights(model, v)
            eng.generate(prompts, 2, sampling)
            r["checks"].append(eng.check_sync(model))
    except SyncError as e:  # the finding itself
        r["error"] = str(e)[:400]
    finally:
        eng.close()
    worst = max((x["max_abs_logprob_diff"] for x in r["checks"]), default=float("nan"))
    c.row("11 N2", f"vLLM model runner, tiny fp32 Qwen2, sleep {'level 2' if r['sleep'] else 'n/a'}",
          f"runner {r['runner'].upper()}", f"sync checks {len(r['checks'])}/2, max |Δlogprob| {worst:.1e}; "
          + N2_NOT_HERE)
    return r


def crit_runner(r: dict) -> list[str]:
    """Stage 11: the runner vLLM is expected to pick here (V2 on CUDA: otherwise V2 is still unrun), and
    both sync checks within their bound (before and after sleep)."""
    bad = [] if r["runner"] == r["want"] else [
        f"vLLM runs Model Runner {r['runner'].upper()}, want {r['want'].upper()} (its start-up log says why)"]
    if r["error"] or len(r["checks"]) != 2:
        bad.append(f"sync check: {r['error'] or 'did not run twice'}")
    return bad
