"""--async-steps K with --lora-rank R (nanorl/pipeline.py, nanorl/lora.py): each version carries the
adapters alone, the worker holds the frozen base once and samples batch t from version max(0, t − K)'s
adapters exactly (not an older or newer one), its reference is the base (adapters off) bit for bit the
trainer's, a train.py run trains only the adapters, and a resume from a mid-flight checkpoint is the
uninterrupted run.   python -m pytest tests/test_async_lora.py -q
"""
import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import train
from nanorl import checkpoint, lora, pipeline, scoring, sources, weight_broadcast
from nanorl.config import Config
from nanorl.policy import response_logprobs
from nanorl.shared_weights import slot_layout
from nanorl.trajectory import collate

TINY = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
        "--quiet", "--pass-k", "2", "--threads", "1", "--schedule", "constant", "--lora-rank", "8",
        "--lr", "3e-3"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    # the warm start tests/test_pipeline.py uses: answers of 1 to 3 digits, rewards with variance
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0, sft_steps=60)


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--out-dir", str(out), *TINY, *extra]


def step_lines(out) -> list[dict]:
    """Every logged training step, without the wall-clock figures (they differ run to run)."""
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith("perf/")} for x in lines if "train/loss" in x]


def adapters_at(out, step) -> dict:
    return load_file(lora.adapter_path(os.path.join(out, "checkpoints", f"step_{step:06d}")))


def test_a_version_is_the_adapters_alone():
    """The layout both channels send (shared_weights.slot_layout over weight_broadcast.version_state):
    with LoRA only `lora_` tensors, a small fraction of the full policy's bytes."""
    from nanorl.task import build_model, build_tokenizer
    model = build_model(len(build_tokenizer()), seed=0)
    full = slot_layout(model, torch.float32)[1]
    lora.apply(model, 8, 32.0, 0.0, "all-linear")
    layout, size = slot_layout(model, torch.float32)
    names = [n for names, *_ in layout for n in names]
    assert names and all(".lora_" in n for n in names)
    assert set(names) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(weight_broadcast.version_state(model)) == set(names)
    assert size < full / 10


def perturb_adapters(run, g: torch.Generator, scale: float = 0.05) -> None:
    """"Train" a step: move every adapter tensor (the base stays as it is, as LoRA's update leaves it)."""
    with torch.no_grad():
        for n, p in run.model.named_parameters():
            if ".lora_" in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def logprobs_under(model, state, batch):
    """Teacher-forced response logprobs [B, T] of `batch` under the weights `state` (adapters on)."""
    scratch = copy.deepcopy(model)
    scratch.load_state_dict(state)
    with torch.no_grad():
        return response_logprobs(scratch, batch, 1.0)[0]


def test_worker_samples_from_the_newest_published_adapter(task, tmp_path):
    """Driven as train.py drives it, the adapters perturbed at every step so that versions differ:
    batch t's rollout logprobs are version max(0, t − K)'s teacher-forced ones (its adapters on the
    worker's base), not the next version's; the worker's reference logprobs (its base, adapters off) are
    bit for bit the trainer's (lora.Reference); each version carries the adapters' bytes only."""
    K, steps = 1, 5
    run = train.setup(Config.from_flags(model=task["model"], train_data=task["train"], test_data=task["test"],
                                        quiet=True, out_dir=str(tmp_path), eval_every=0, threads=1,
                                        prompts_per_step=4, samples_per_prompt=2, steps=steps, async_steps=K,
                                        kl_coef=0.01, lora_rank=8))
    assert isinstance(run.ref, lora.Reference)
    pipe = run.pipeline = pipeline.start(run)
    run.source = sources.Worker(pipe, run.source)
    versions = {0: {k: v.clone() for k, v in run.model.state_dict().items()}}
    g = torch.Generator().manual_seed(0)
    full_mib = sum(t.numel() * 4 for t in run.model.state_dict().values()) / 2**20
    try:
        for t in range(steps):
            samples = pipe.take(t, run.loader.next_batch())
            v = max(0, t - K)
            assert {s.weight_version for s in samples} == {v}
            assert pipe.metrics["async/version_mib"] < full_mib / 10
            batch = collate(samples, run.tokenizer.pad_token_id)
            m = batch.response_mask > 0

            def gap(u):  # the largest |Δ logprob| between the rollout and version u's weights
                return float((logprobs_under(run.model, versions[u], batch) - batch.rollout_logprobs)[m]
                             .abs().max())
            assert gap(v) < 1e-5
            if v + 1 in versions:
                assert gap(v + 1) > 1e-3
            if v > 0:
                assert gap(v - 1) > 1e-3
            with torch.no_grad():
                ref = scoring.score_batch(run, run.ref, batch, None)[0]
            assert torch.equal(pipe.ref_logprobs(samples, batch), ref)
            perturb_adapters(run, g)
            versions[t + 1] = {k: x.clone() for k, x in run.model.state_dict().items()}
            run.step = t + 1
            pipe.publish(run.model, t + 1)
    finally:
        pipe.close()
        run.logger.close()


@pytest.mark.slow
def test_train_py_async_lora_trains_the_adapters(task, tmp_path):
    """train.py end to end, --async-steps 1 --lora-rank 8 with a KL term (the worker's reference):
    staleness 0, 1, 1, 1; the adapters move, the checkpoint holds them (PEFT format), not a full model."""
    train.main(args(task, tmp_path, "--steps", "4", "--async-steps", "1", "--kl-coef", "0.01"))
    lines = step_lines(tmp_path)
    assert [x["rollout/async/staleness_max"] for x in lines] == [0, 1, 1, 1]
    assert all(x["train/loss"] == x["train/loss"] for x in lines) and "train/kl" in str(lines[-1])
    ck = os.path.join(tmp_path, "checkpoints", "step_000004")
    assert not os.path.exists(os.path.join(ck, "model.safetensors"))
    adapters = adapters_at(tmp_path, 4)
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in adapters.items())  # B starts at 0


@pytest.mark.slow
def test_async_lora_resume_is_the_uninterrupted_run(task, tmp_path):
    """K = 1: 4 steps, and the same run resumed from its step-2 checkpoint (batch 2, sampled from the
    version-1 adapters the checkpoint does not hold, comes from pipeline.pt), log the same steps 3-4
    and end on the same adapters, bit for bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", "--async-steps", "1", "--save-every", "2", "--keep-checkpoints", "3",
             "--kl-coef", "0.01")
    train.main(args(task, a, *extra))
    ck = os.path.join(a, "checkpoints", "step_000002")
    assert pipeline.FILE in checkpoint.verify(ck)["files"]
    train.main(args(task, b, *extra, "--resume", ck))
    la, lb = step_lines(a), step_lines(b)
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    wa, wb = adapters_at(a, 4), adapters_at(b, 4)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
