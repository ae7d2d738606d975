"""Streamed weight sync (nanorl/distributed.py iter_full_tensors, nanorl/vllm_engine.py
iter_checkpoint_tensors): under FSDP the engine is fed one gathered tensor at a time, so the extra
memory of a sync is bounded by the largest tensor, not the model.

Measured as the peak RSS of a fresh process (Linux VmHWM, reset through /proc/self/clear_refs)
while a loader copies every streamed tensor into a preallocated copy of the model — what vLLM's
reload_weights does — against gathering the whole state dict first (nanorl's earlier sync). The
model is a Qwen2 of 16 layers whose largest tensor (the 16 MiB embedding) is 1/11 of it, sharded by
FSDP2 over 2 CPU processes (gloo): every all-gather allocates a full tensor, as on GPUs.
No vLLM needed. Run: python -m pytest tests/test_weight_stream.py -q
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

MiB = 2**20


def _peak_rss_mib() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def _measure(init_file: str, rank: int, world: int) -> dict:
    """In a fresh process (one rank): build, shard, then sync into a preallocated 'engine' copy,
    streamed and whole; the peak extra MiB of each."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl import distributed
    from nanorl.engine_weights import iter_checkpoint_tensors

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same model on both ranks
    cfg = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=16,
                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).float()
    engine = {k: v.detach().clone() for k, v in model.state_dict().items()}  # the engine's own copy
    distributed.shard(model, torch.device("cpu"))
    sizes = [p.numel() * p.element_size() for p in model.parameters()]  # unique parameters
    out = {"largest_mib": max(sizes) / MiB, "model_mib": sum(sizes) / MiB, "names": len(engine)}
    for mode in ("stream", "whole"):
        with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on
            f.write("5")
        base, loaded = _peak_rss_mib(), 0
        tensors = (iter_checkpoint_tensors(model) if mode == "stream"
                   else distributed.full_state_dict(model).items())
        for name, t in tensors:  # the loader: copy into the engine's tensor, drop ours
            engine[name].copy_(t)
            loaded += 1
        del tensors, t
        out[mode] = {"peak_mib": _peak_rss_mib() - base, "loaded": loaded}
    dist.destroy_process_group()
    return out


def _run(tmp_path) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc: every large tensor its own mmap, so RSS tracks it
    ranks = [subprocess.Popen([sys.executable, __file__, str(tmp_path / "pg"), str(r), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), [err[-3000:] for _, err in outs]
    return json.loads(outs[0][0].strip().splitlines()[-1])  # rank 0's figures


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_streamed_sync_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    out = _run(tmp_path)
    stream, whole, largest, model = out["stream"], out["whole"], out["largest_mib"], out["model_mib"]
    assert stream["loaded"] == whole["loaded"] == out["names"]  # every name, tied lm_head included
    assert model > 10 * largest  # the bound below means something
    # ~2 full tensors at most: the all-gather's buffer and the gathered tensor (measured 32.3 MiB =
    # 2.0x the largest; the whole state dict first: 179 MiB, the model's 176 + 3)
    assert stream["peak_mib"] <= 2 * largest + 4, out
    assert whole["peak_mib"] >= 0.9 * model, out  # gathering everything first holds the model


def test_tied_weights_stream_once_per_gather_under_every_name():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nanorl.distributed import iter_full_tensors

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         tie_word_embeddings=True))
    items = list(iter_full_tensors(model))
    names = [n for n, _ in items]
    assert sorted(names) == sorted(model.state_dict())  # every name once
    # the alias follows at once: no tensor held across the stream
    i = names.index("model.embed_tokens.weight")
    assert names[i + 1] == "lm_head.weight" and items[i][1] is items[i + 1][1]
    state = model.state_dict()
    assert all(t.data_ptr() == state[n].data_ptr() for n, t in items)  # unsharded: the module's own, no copy


if __name__ == "__main__":  # the measuring subprocess
    print(json.dumps(_measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
