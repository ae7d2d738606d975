"""The memory plan (nanorl/memory_plan.py) and its check at set-up (nanorl/build.py check_memory): the 7B
GRPO arithmetic of issue 45 (M4) term by term, its refusal on one H200 with the levers named, runs that
fit, what LoRA and FSDP divide, and the module copied alone (torch and the standard library).
    python -m pytest tests/test_memory_plan.py -q
"""
import pytest
import torch

from nanorl import build, memory_plan
from nanorl.config import Config
from nanorl.presets import PRESETS, PRETRAINED_DEFAULTS

GiB = 2 ** 30
H200 = 140 * GiB  # torch's total_memory of an H200 is ~140 GiB (nvidia-smi: 143771 MiB)
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)


def meta_model(**config):
    """A Qwen2 model of this config on the meta device: its shapes, no memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**config))


def grpo(**flags) -> Config:
    """`train.py --algo grpo --model <pretrained>` on a GPU: the preset, then the pretrained defaults."""
    pretrained = {k: v for k, (v, _) in PRETRAINED_DEFAULTS.items()}
    return Config.from_flags(**{**pretrained, **PRESETS["grpo"][1], "model": "m", **flags})


@pytest.fixture(scope="module")
def qwen7b():
    return build.model_shape(meta_model(**QWEN25_7B))


def test_7b_grpo_defaults_arithmetic_of_the_issue(qwen7b):
    """fp32 masters 28.4 + grads 28.4 + Adam 56.8 + bf16 reference 14.2 GiB = 128 GiB (±10%)."""
    assert qwen7b.params == 7_615_616_512 and qwen7b.trainable == qwen7b.params  # Qwen2.5-7B's count
    plan = memory_plan.estimate(qwen7b, grpo(), vllm=True, device_bytes=H200)
    terms = {"fp32 masters": 28.4, "Adam": 56.8, "reference (bfloat16)": 14.2}
    for k, want in terms.items():
        assert plan.resident[k] / GiB == pytest.approx(want, rel=0.01), k
    assert plan.train["gradients"] / GiB == pytest.approx(28.4, rel=0.01)
    four = sum(plan.resident[k] for k in terms) + plan.train["gradients"]
    assert four / GiB == pytest.approx(128, rel=0.10)
    # vLLM asleep in training, its 0.3 share at wake-up on top of what stays: past the card
    assert plan.sample["vLLM"] == pytest.approx(0.3 * H200) and plan.resident["vLLM (awake all run)"] == 0
    assert plan.peak > H200 and not plan.fits()
    why = plan.refusal()
    for lever in ("--kl-coef 0", "--gpu-memory-utilization", "--max-tokens-per-micro-batch", "--lora-rank",
                  "--fsdp"):
        assert lever in why, lever
    assert "\n" not in why and "peak" in plan.line()


def test_what_fits_one_h200(qwen7b):
    """The 0.5B model with the same flags; 7B with LoRA (no full gradients or moments, no reference
    copy); 7B without KL, vLLM or anything but the trainer (a ~135 GiB peak: the memory stage of
    gpu_check.py measures this one)."""
    small = build.model_shape(meta_model(**QWEN25_05B))
    assert memory_plan.estimate(small, grpo(), vllm=True, device_bytes=H200).fits()
    adapters = 40_370_176  # rank 16 on every linear layer of the 28 blocks
    lora = memory_plan.Shape(**{**vars(qwen7b), "params": qwen7b.params + adapters, "trainable": adapters})
    plan = memory_plan.estimate(lora, grpo(lora_rank=16), vllm=True, device_bytes=H200)
    assert plan.fits() and plan.resident["reference (bfloat16)"] == 0 and plan.train["gradients"] < GiB
    bare = memory_plan.estimate(qwen7b, grpo(kl_coef=0.0, engine="hf"), vllm=False, device_bytes=H200)
    assert bare.fits() and 115 < bare.peak / GiB < 138, bare.line()
    assert "--kl-coef 0" not in bare.refusal()  # no reference: not a lever


def test_fsdp_divides_the_state_and_activations_follow_the_token_budget(qwen7b):
    one = memory_plan.estimate(qwen7b, grpo(), vllm=True, device_bytes=H200)
    eight = memory_plan.estimate(qwen7b, grpo(fsdp=True), vllm=True, world=8, device_bytes=H200)
    for k in ("fp32 masters", "Adam", "reference (bfloat16)"):
        assert eight.resident[k] == pytest.approx(one.resident[k] / 8)
    assert eight.fits()

    def act(plan):
        return next(v for k, v in plan.train.items() if k.startswith("activations"))
    half = memory_plan.estimate(qwen7b, grpo(max_tokens_per_micro_batch=8192), vllm=True, device_bytes=H200)
    off = memory_plan.estimate(qwen7b, grpo(gradient_checkpointing=False), vllm=True, device_bytes=H200)
    assert act(half) < act(one) < act(off) / 5  # checkpointing keeps ~1/L of the blocks' activations
    # the async worker on this GPU: its copy, reference and the one ipc slot whatever K (the versions
    # in flight wait in host memory), and vLLM awake all run
    here = memory_plan.estimate(qwen7b, grpo(async_steps=1), vllm=True, device_bytes=H200, worker_here=True)
    assert here.resident["async worker"] == pytest.approx(3 * 2 * qwen7b.params)
    far = memory_plan.estimate(qwen7b, grpo(async_steps=4), vllm=True, device_bytes=H200, worker_here=True)
    assert far.resident["async worker"] == here.resident["async worker"]
    # no sync check: the worker's model copy stays in host memory
    unchecked = memory_plan.estimate(qwen7b, grpo(async_steps=1, sync_check_every=0), vllm=True,
                                     device_bytes=H200, worker_here=True)
    assert unchecked.resident["async worker"] == pytest.approx(2 * 2 * qwen7b.params)
    assert here.resident["vLLM (awake all run)"] == pytest.approx(0.3 * H200) and here.sample["vLLM"] == 0
    away = memory_plan.estimate(qwen7b, grpo(async_steps=1), vllm=True, device_bytes=H200)
    assert away.resident["async worker"] == 0 and away.sample["vLLM"] == 0
    # LoRA: one copy on the GPU (the reference, adapters off), no frozen copy, a slot of the adapters
    adapters = 40_370_176
    lora = memory_plan.Shape(**{**vars(qwen7b), "params": qwen7b.params + adapters, "trainable": adapters})
    for check in (1, 0):
        plan = memory_plan.estimate(lora, grpo(async_steps=1, lora_rank=16, sync_check_every=check),
                                    vllm=True, device_bytes=H200, worker_here=True)
        assert plan.resident["async worker"] == pytest.approx(2 * lora.params + 2 * adapters)


def test_set_up_prints_the_plan_and_refuses_what_does_not_fit(monkeypatch, capsys):
    """build.check_memory, as load_policy calls it on CUDA (a GPU of 140 GiB faked here)."""
    props = type("Props", (), {"total_memory": H200, "uuid": "GPU-a"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(build, "vllm_importable", lambda: True)
    model = meta_model(**QWEN25_7B)
    with pytest.raises(ValueError, match=r"^--model m: the run needs ~1\d\d\.\d GiB per GPU.*Levers: --kl"):
        build.check_memory(grpo(engine="auto"), model, torch.device("cuda:0"))
    assert "memory plan (GiB per GPU)" in capsys.readouterr().out
    plan = build.check_memory(grpo(kl_coef=0.0, engine="hf"), model, torch.device("cuda:0"))
    assert plan.fits()


def test_memory_plan_is_torch_and_stdlib_only(copied_alone, qwen7b):
    mod = copied_alone("memory_plan")
    shape = mod.Shape(**vars(qwen7b))
    assert mod.estimate(shape, grpo(), vllm=True, device_bytes=H200).peak == \
        memory_plan.estimate(qwen7b, grpo(), vllm=True, device_bytes=H200).peak


def test_load_policy_checks_the_rollout_device_first_and_the_memory_after_loading(monkeypatch):
    """build.load_policy on CUDA (two GPUs of 140 GiB faked, the model a meta-device 7B): an async run's
    --rollout-device that does not exist fails before anything loads; the 7B GRPO run with default flags
    is refused once the model's size is known; with --kl-coef 0 and the HF engine it is built."""
    props = type("Props", (), {"total_memory": H200, "uuid": "GPU-a"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(build, "vllm_importable", lambda: True)
    loaded = []
    monkeypatch.setattr(build, "load_model", lambda *a: loaded.append(a) or (meta_model(**QWEN25_7B), None))
    cuda = torch.device("cuda:0")
    with pytest.raises(ValueError, match="--rollout-device cuda:2: this machine has 2 CUDA device"):
        build.load_policy(grpo(async_steps=1, rollout_device="cuda:2"), cuda, torch.bfloat16)
    assert loaded == []
    with pytest.raises(ValueError, match="the run needs ~.*Levers: --kl-coef 0"):
        build.load_policy(grpo(), cuda, torch.bfloat16)
    model, _ = build.load_policy(grpo(kl_coef=0.0, engine="hf"), cuda, torch.bfloat16)
    assert len(loaded) == 2 and model.training
