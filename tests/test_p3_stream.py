"""Issue 30, m1 / m4 / m8 (nanorl/distributed.py).

m1: the weight stream (iter_full_tensors, engine_weights.iter_checkpoint_tensors, VLLMEngine.update_weights)
yields tensors in the engine's dtype, each shard cast before its all-gather, equal to the cast of the
full fp32 tensor: on 1 rank and on 2 FSDP ranks over gloo.
m4: check_ranks_in_sync checksums the stream (never the full state dict) and still catches a planted
difference on one rank.
m8: an accelerate config asking for what nanorl does not support (DeepSpeed, a dynamo backend, ...) gets
a clear error; one asking for mixed precision leaves nanorl's precision alone.

The 2-rank cases run this file as a script under torchrun (2 CPU processes, gloo, under a timeout).
"""
import os
import subprocess
import sys

import pytest
import torch

from nanorl.weight_broadcast import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
for _k in list(ENV):  # a test's own accelerate settings only
    if _k.startswith("ACCELERATE_"):
        del ENV[_k]


def tiny_model(seed: int = 0):
    """A 2-layer Qwen2 with tied embeddings (two names, one tensor) and an integer buffer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    # a persistent integer buffer: the stream must pass it through, never cast it
    model.register_buffer("step_count", torch.arange(5, dtype=torch.int64))
    return model


# ----------------------------------------------------------------------------- m1, 1 rank

def test_stream_in_engine_dtype_on_one_rank():
    from nanorl.distributed import iter_full_tensors
    model = tiny_model()
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}  # fp32 reference
    got = list(iter_full_tensors(model, torch.bfloat16))
    assert sorted(k for k, _ in got) == sorted(full)
    for k, t in got:
        if full[k].is_floating_point():
            assert t.dtype == torch.bfloat16, k
            assert torch.equal(t, full[k].to(torch.bfloat16)), k
        else:
            assert t.dtype == torch.int64 and torch.equal(t, full[k]), k
    # the masters themselves are untouched, and no dtype: the module's own tensors, no copy
    assert next(model.parameters()).dtype == torch.float32
    same = dict(iter_full_tensors(model))
    assert same["model.embed_tokens.weight"].data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # tied: one tensor under both names, back to back
    names = [k for k, _ in got]
    i = names.index("model.embed_tokens.weight")
    assert names[i + 1] == "lm_head.weight" and got[i][1] is got[i + 1][1]


def test_vllm_engine_streams_in_its_dtype(monkeypatch):
    """VLLMEngine.update_weights hands sync_weights the stream in the engine's dtype (no vLLM needed:
    update_weights is called on a stand-in engine, sync_weights is captured)."""
    pytest.importorskip("transformers")
    from nanorl import vllm_engine
    seen = {}

    def capture(llm, named_tensors, reset_prefix_cache=True):
        seen.update({k: v.dtype for k, v in named_tensors})

    monkeypatch.setattr(vllm_engine, "sync_weights", capture)

    class Stub:
        llm, dtype, _asleep, adapters = object(), torch.bfloat16, None, None

    vllm_engine.VLLMEngine.update_weights(Stub(), tiny_model(), version=1)
    floats = {k: d for k, d in seen.items() if d.is_floating_point}
    assert "lm_head.weight" in floats and set(floats.values()) == {torch.bfloat16}, seen


# ----------------------------------------------------------------------------- 2 ranks (script mode)

def torchrun(mode: str, port: int, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.abspath(__file__), mode]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_stream_in_engine_dtype_on_two_fsdp_ranks():
    res = torchrun("stream", port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(res.stdout.count(f"rank {r} stream ok") for r in (0, 1)) == [1, 1], res.stdout


@pytest.mark.slow
def test_rank_check_streams_and_catches_a_planted_difference():
    res = torchrun("ranks", port=free_port())
    assert res.returncode == 0, res.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r} identical: passed" in res.stdout, res.stdout
        assert f"rank {r} planted: caught" in res.stdout, res.stdout
        assert f"rank {r} fsdp: passed" in res.stdout, res.stdout


def _worker_stream(rank: int, world: int) -> None:
    from nanorl import distributed
    from nanorl.engine_weights import iter_checkpoint_tensors
    model = tiny_model(seed=0)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}  # before sharding, fp32
    distributed.shard(model, torch.device("cpu"))
    p = model.model.layers[0].mlp.down_proj.weight
    assert hasattr(p, "to_local") and p.to_local().shape[0] < p.shape[0]  # really sharded
    # the cast happens on the shard: its DTensor is still sharded, in bf16
    cast = p.detach().to(torch.bfloat16)
    assert cast.placements == p.placements and cast.to_local().dtype == torch.bfloat16
    for stream in (distributed.iter_full_tensors(model, torch.bfloat16),
                   iter_checkpoint_tensors(model, torch.bfloat16)):
        got = list(stream)
        assert {k for k, _ in got} == set(full), sorted(set(full) ^ {k for k, _ in got})
        for k, t in got:
            assert not hasattr(t, "to_local"), k  # a plain, full tensor
            if full[k].is_floating_point():
                assert t.dtype == torch.bfloat16 and torch.equal(t, full[k].to(torch.bfloat16)), k
            else:
                assert torch.equal(t, full[k]), k
    print(f"rank {rank} stream ok", flush=True)


def _worker_ranks(rank: int, world: int) -> None:
    from nanorl import distributed

    def never(*a, **k):
        raise AssertionError("check_ranks_in_sync built the whole state dict")

    distributed.full_state_dict = never  # m4: the check must stream, never gather everything at once
    model = tiny_model(seed=0)
    distributed.check_ranks_in_sync(model, world)
    print(f"rank {rank} identical: passed", flush=True)
    if rank == 1:  # one element of one tensor, by less than a bf16 ulp of it
        with torch.no_grad():
            model.model.layers[1].self_attn.o_proj.weight[3, 5] += 1e-6
    try:
        distributed.check_ranks_in_sync(model, world)
        print(f"rank {rank} planted: missed", flush=True)
    except RuntimeError as e:
        assert "ranks hold different weights" in str(e)
        print(f"rank {rank} planted: caught", flush=True)
    sharded = tiny_model(seed=0)
    distributed.shard(sharded, torch.device("cpu"))
    distributed.check_ranks_in_sync(sharded, world)  # gathers tensor by tensor: a collective per tensor
    print(f"rank {rank} fsdp: passed", flush=True)


# ----------------------------------------------------------------------------- m8

CHECK = """
import torch
from nanorl import distributed
rank, world, device = distributed.init()
acc = distributed.make_accelerator()
m = acc.prepare_model(torch.nn.Linear(4, 4))
out = m(torch.ones(2, 4))
print("mixed_precision", acc.mixed_precision, "dynamo", acc.state.dynamo_plugin.backend.value,
      "out", out.dtype)
"""


def run_check(env: dict, launcher: list[str] | None = None, tmp_path=None) -> subprocess.CompletedProcess:
    if launcher is None:
        cmd = [sys.executable, "-c", CHECK]
    else:
        script = tmp_path / "check.py"
        script.write_text(CHECK)
        cmd = [*launcher, str(script)]
    return subprocess.run(cmd, cwd=REPO, env={**ENV, **env}, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("var,value,named", [
    ("ACCELERATE_USE_DEEPSPEED", "true", "DeepSpeed"),
    ("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR", "dynamo backend INDUCTOR"),
    ("ACCELERATE_USE_FSDP", "true", "--fsdp"),
    ("ACCELERATE_USE_MEGATRON_LM", "true", "Megatron-LM"),
])
def test_unsupported_accelerate_settings_are_refused(var, value, named):
    res = run_check({var: value})
    assert res.returncode != 0
    assert "does not support" in res.stderr and var in res.stderr and named in res.stderr, res.stderr[-2000:]


def test_make_accelerator_refuses_without_init(monkeypatch):
    """A caller that builds the Accelerator without `init` (a user's own script) gets the same refusal
    before accelerate reads the setting."""
    from nanorl import distributed
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED.*DeepSpeed"):
        distributed.make_accelerator()


def test_accelerate_mixed_precision_does_not_change_nanorls():
    res = run_check({"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert res.returncode == 0, res.stderr[-2000:]
    # no autocast added by accelerate's prepare_model: the fp32 module answers in fp32
    assert "mixed_precision no dynamo NO out torch.float32" in res.stdout, res.stdout
    assert "mixed_precision=bf16 is ignored" in res.stderr


CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: {mp}
num_machines: 1
num_processes: 1
use_cpu: true
dynamo_config:
  dynamo_backend: {dynamo}
"""


@pytest.mark.parametrize("dynamo,mp,ok", [("INDUCTOR", "'no'", False), ("'NO'", "bf16", True)])
def test_an_accelerate_config_file(tmp_path, dynamo, mp, ok):
    """Through `accelerate launch --config_file` (what `accelerate config` writes): the launcher turns
    the file into the environment nanorl checks."""
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text(CONFIG.format(dynamo=dynamo, mp=mp))
    res = run_check({}, [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg)],
                    tmp_path)
    if ok:
        assert res.returncode == 0, res.stderr[-2000:]
        assert "mixed_precision no dynamo NO out torch.float32" in res.stdout, res.stdout
    else:
        assert res.returncode != 0 and "ACCELERATE_DYNAMO_BACKEND" in res.stderr, res.stderr[-2000:]


if __name__ == "__main__":
    torch.set_num_threads(1)
    from nanorl import distributed as _d
    _rank, _world, _ = _d.init()
    {"stream": _worker_stream, "ranks": _worker_ranks}[sys.argv[1]](_rank, _world)
    _d.end_process()  # without the teardown that can abort a gloo rank at exit
