"""LoRA (--lora-rank, nanorl/lora.py): PEFT adapters on the built-in task's model.

What must hold: the optimizer holds only the adapters and the base weights come out of training
bit-identical; the reference is the base model (adapters off) without a copy; the engines get the
merged weights under the base model's names; checkpoints hold PEFT-format adapters that resume
exactly and export to a merged Hugging Face model; gradient checkpointing and micro-batching give the
same step; what is not built fails with a clear error. The learning test is in tests/test_learning.py,
the DDP gradient in tests/test_multirank.py, the vLLM sync in tests/test_lora_vllm.py.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import train
from nanorl import checkpoint, lora
from nanorl.config import parse_args
from nanorl.policy import load_model, response_logprobs
from nanorl.rollout import SamplingConfig
from nanorl.task import make_default
from nanorl.trajectory import collate


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0)


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
            "--pass-k", "2", "--warmup-steps", "1", "--lr", "3e-3", "--lora-rank", "4", "--quiet",
            "--threads", "1", "--schedule", "constant", "--out-dir", str(out), *extra]


def a_batch(run, n=4):
    samples = run.engine.generate([p.ids for p in run.loader.prompts[:2]], n, SamplingConfig(
        max_new_tokens=4, stop_token_ids=(run.tokenizer.eos_token_id,), seed=3))
    return collate(samples, run.tokenizer.pad_token_id)


def base_weights(model) -> dict:
    """The frozen tensors of an adapted model under the base model's names."""
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}


def test_training_moves_only_adapters_and_reference_is_the_base_model(task, tmp_path):
    run = train.setup(parse_args(args(task, tmp_path, "--kl-coef", "0.05", "--steps", "4")))
    adapters = {id(p) for n, p in run.model.named_parameters() if ".lora_" in n}
    held = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in held} == adapters and len(held) == 2 * 7 * 2  # 2 layers × 7 linears × (A, B)
    # no reference copy: the reference runs the policy module itself, adapters off
    assert run.ref.trained.policy is run.model
    w0 = load_file(os.path.join(task["model"], "model.safetensors"))
    steps = []
    for _ in range(4):
        steps.append(train.rl_step(run))
        run.step += 1
    # the adapters moved away from the reference
    assert max(m.get("train/kl_ref", 0) for m in steps) > 0
    now = base_weights(run.model)
    assert set(w0) <= set(now) and all(torch.equal(now[k], w0[k]) for k in w0)  # bit-identical base
    base = load_model(task["model"])[0]
    batch = a_batch(run)
    with torch.no_grad():
        ref = run.ref(batch, None)[0]
        want = response_logprobs(base, batch)[0]
        policy = run.trained(batch, None)[0]
    assert torch.equal(ref, want)  # adapters off == the base model, exactly
    assert (policy - want).abs().max() > 1e-3  # adapters on: the trained policy


def test_merged_weights_have_base_names_and_match_the_adapted_forward(task, tmp_path):
    run = train.setup(parse_args(args(task, tmp_path, "--steps", "1")))
    with torch.no_grad():  # adapters that do something (B starts at 0)
        for n, p in run.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    merged = lora.merged_state_dict(run.model)
    base = load_model(task["model"])[0]
    assert sorted(merged) == sorted(base.state_dict())  # the base model's names
    assert not any(".lora_" in k or "base_layer" in k for k in merged)
    base.load_state_dict(merged)
    batch = a_batch(run)
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(base, batch)[0], run.trained(batch, None)[0],
                                   atol=1e-5, rtol=0)
    q = run.model.model.layers[0].self_attn.q_proj
    delta = q.lora_B["default"].weight @ q.lora_A["default"].weight * q.scaling["default"]
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight + delta)
    bf16 = lora.merged_state_dict(run.model, torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())


def test_checkpoint_is_peft_format_resumes_exactly_and_exports_merged(task, tmp_path):
    """2N steps == N steps + resume + N steps (metrics and adapters, bitwise), with a KL term so the
    adapters-off reference is exercised; the checkpoint loads with PeftModel.from_pretrained and
    python -m nanorl.export writes a plain HF model with the same outputs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    extra = ("--kl-coef", "0.05", "--save-every", "1", "--mini-batches", "2")
    a, b = tmp_path / "a", tmp_path / "b"
    train.main(args(task, a, "--steps", "4", *extra))
    train.main(args(task, b, "--steps", "2", *extra))
    train.main(args(task, b, "--steps", "4", "--resume", "latest", *extra))
    lines = [[{k: v for k, v in json.loads(x).items() if not k.startswith(("perf/", "eval/"))}
              for x in open(o / "metrics.jsonl") if "rollout/reward_mean" in x] for o in (a, b)]
    assert [r["step"] for r in lines[1]] == [1, 2, 3, 4] and lines[0] == lines[1]
    ca, cb = (os.path.join(o, "checkpoints", "step_000004") for o in (a, b))
    wa, wb = (load_file(lora.adapter_path(c)) for c in (ca, cb))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not os.path.exists(os.path.join(ca, "model.safetensors"))  # adapters only
    assert json.load(open(os.path.join(ca, "trainer_state.json")))["layout"] == "lora"
    # PEFT's own loader, and the merged export
    peft_model = PeftModel.from_pretrained(load_model(task["model"])[0], ca).eval()
    out = tmp_path / "exported"
    from nanorl import export
    export.main([str(a), str(out)])
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    ids = torch.tensor([[2, 5, 12, 7, 12, 4, 14]])  # "0+5=..." in the 15-token vocabulary
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(input_ids=ids).logits, atol=1e-5, rtol=0)
        base = load_model(task["model"])[0].eval()
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-3
    # a LoRA checkpoint into a full fine-tuning run: said so
    full = args(task, tmp_path / "c", "--steps", "4")
    del full[full.index("--lora-rank"):full.index("--lora-rank") + 2]
    run = train.setup(parse_args(full))
    with pytest.raises(checkpoint.CheckpointError, match="LoRA checkpoint, but this run has no --lora-rank"):
        train.resume_run(run, ca)


def test_gradient_checkpointing_and_micro_batches_give_the_same_step(task, tmp_path):
    plain = train.main(args(task, tmp_path / "p", "--steps", "2", "--kl-coef", "0.05"))["last"]
    split = train.main(args(task, tmp_path / "s", "--steps", "2", "--kl-coef", "0.05",
                            "--gradient-checkpointing", "--micro-batch-size", "3"))["last"]
    for k in ("train/loss", "train/grad_norm", "train/kl_ref"):
        assert split[k] == pytest.approx(plain[k], rel=1e-4, abs=1e-7), k
    bf16 = train.main(args(task, tmp_path / "b", "--steps", "2", "--dtype", "bfloat16"))["last"]
    assert 0 < bf16["train/grad_norm"] < float("inf")


@pytest.mark.parametrize("flags,match", [
    (["--lora-alpha", "16"], "lora_alpha needs lora_rank > 0"),
    (["--lora-target-modules", "q_proj"], "lora_target_modules needs lora_rank > 0"),
    (["--lora-rank", "8", "--fsdp"], "--lora-rank with --fsdp .* is not supported"),
    (["--lora-rank", "8", "--lora-dropout", "1"], r"lora_dropout must be in \[0, 1\)"),
    (["--lora-sync", "adapter"], "lora_sync adapter needs lora_rank > 0 and the vLLM engine"),
    (["--lora-rank", "8", "--lora-sync", "adapter", "--engine", "hf"], "lora_sync adapter needs"),
])
def test_config_refuses_what_lora_cannot_do(flags, match):
    with pytest.raises(ValueError, match=match):
        parse_args(flags)


def test_adapter_sync_refuses_sleep_level_2():
    """--lora-sync adapter never resends the base weights, which sleep level 2 discards (GPU only:
    an engine object with sleep mode on, no vLLM started)."""
    from nanorl.vllm_engine import VLLMEngine
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.sleep_supported, engine._asleep, engine.adapters = True, None, object()  # a stand-in AdapterSync
    with pytest.raises(RuntimeError, match="use --sleep-level 1"):
        engine.sleep(2)
