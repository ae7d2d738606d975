"""slime's partial rollouts without --async-steps (--partial-rollout abort in the synchronous loop,
nanorl/sources.py Partial): each step over-samples on the trainer's engine, trains the first groups that
finish and buffers the rest unfinished; the next step resumes them first under its new weights, per
token versioned (--env episodes too); the buffer survives a checkpoint.
    python -m pytest tests/test_sync_partial.py -q
"""
import copy
import os

import pytest
import torch
from test_async_dapo import (
    half as half,  # the half-rewarded task's reward fixture (pytest finds it by name)
    logged,
    run_args,
)
from test_dapo import assert_full
from test_partial_rollout import (
    calc_args,
    calc_task as calc_task,  # the --env calc task fixture, shared
    every_step,
)
from test_pipeline import (
    args,
    logprobs_under,
    setup_run,
    task as task,  # the trained task fixture, shared (pytest finds it by name)
    weights,
)

import train
from nanorl import sources, stages
from nanorl.config import Config, ConfigError
from nanorl.logger import PhaseTimer
from nanorl.trajectory import collate
from nanorl.weight_broadcast import free_port

ABORT = ("--partial-rollout", "abort", "--over-sample", "2", "--max-new-tokens", "6")


def test_sync_abort_run_trains_with_resumed_groups(task, tmp_path):
    """train.py with --partial-rollout abort --over-sample 2 and no --async-steps: the source is the
    synchronous one (no worker), every step trains, some steps resume groups the step before cut, and no
    token is more than one version old."""
    result = train.main(args(task, tmp_path, "--steps", "4", *ABORT))
    lines = every_step(tmp_path)
    assert result["step"] == 4 and len(lines) == 4 and any("train/loss" in x for x in lines)
    assert sum(x["rollout/async/aborted_tokens"] for x in lines) > 0
    assert sum(x["rollout/async/resumed_groups"] for x in lines) > 0
    assert max(x["rollout/async/partial_frac"] for x in lines) > 0  # samples of two versions trained
    assert all(x["rollout/async/staleness_max"] <= 1 for x in lines)
    assert not any("rollout/async/trainer_wait_s" in x for x in lines)  # no worker ran


def test_aborted_samples_resume_from_their_tokens_under_the_new_weights(task, tmp_path):
    """Step 0 (version 0) over-samples 8 groups, trains 4 and buffers the unfinished ones; step 1 (version
    1, the weights step 0 trained) starts with those groups: each resumed sample is its buffered tokens
    (versions 0, logprobs of version 0), then tokens of version 1 sampled given that whole prefix (their
    rollout logprobs are version 1's, teacher-forced after the old tokens); the mask flag leaves exactly
    the old tokens out of the loss. Red checks (scratch edits, restored): the buffer dropped (no group
    resumed) and a resume restarted from the prompt (the old tokens gone) both fail here."""
    run = setup_run(task, tmp_path, steps=4, partial_rollout="abort", over_sample=2, samples_per_prompt=4,
                    max_new_tokens=6, mask_offpolicy_in_partial_rollout=True, lr=1e-3)
    assert isinstance(run.source, sources.Partial) and run.pipeline is run.source
    try:
        old = {k: v.clone() for k, v in run.model.state_dict().items()}
        first = train.rl_step(run)
        run.step += 1
        buffered = [(p, [copy.deepcopy(s) for s in g]) for p, g in run.source.rollout.buffer]
        partial = [s for _, g in buffered for s in g if s.status == "aborted"]
        assert first["rollout/async/aborted_groups"] > 0 and any(s.response_ids for s in partial)
        assert any(not torch.equal(old[k], v) for k, v in run.model.state_dict().items())  # it trained
        metrics = {}
        samples, _ = stages.rollout(train.sampler_of(run), run.plan, run.sampling, run.loader.next_batch(),
                                    PhaseTimer(), metrics)
    finally:
        run.logger.close()
    assert metrics["async/resumed_groups"] == len(buffered) > 0
    n, resumed = 4, 0
    # the buffered groups lead the step, in their order; their samples keep the old tokens
    for (p, g), got in zip(buffered, [samples[i:i + n] for i in range(0, len(buffered) * n, n)]):
        for was, s in zip(g, got):
            k, L = len(was.response_ids), s.response_length
            assert s.prompt_ids == p.ids and s.status in ("completed", "truncated")
            assert s.response_ids[:k] == was.response_ids and s.rollout_logprobs[:k] == was.rollout_logprobs
            if was.status == "aborted":  # resumed: versions [0]*k + [1]*(L-k), the old tokens masked
                resumed += L > k
                assert s.token_versions == [0] * k + [1] * (L - k)
                assert s.loss_mask == [0] * k + [1] * (L - k) if L > k else s.loss_mask in (None, [1] * L)
            else:  # finished under version 0: nothing to resume
                assert s.token_versions == [0] * L and s.response_ids == was.response_ids
    assert resumed > 0
    assert all(s.token_versions == [1] * s.response_length for s in samples[len(buffered) * n:])
    batch = collate(samples, run.tokenizer.pad_token_id)
    real = batch.attention_mask[:, batch.prompt_width:] > 0  # [B, T] every sampled token
    tv = torch.full(real.shape, -1)  # [B, T] each token's version
    for b, s in enumerate(samples):
        tv[b, :s.response_length] = torch.tensor(s.token_versions)
    lp_old = logprobs_under(run.model, old, batch)  # [B, T]
    lp_new = logprobs_under(run.model, run.model.state_dict(), batch)  # [B, T]
    assert (lp_old - batch.rollout_logprobs)[tv == 0].abs().max() < 1e-5
    assert (lp_new - batch.rollout_logprobs)[tv == 1].abs().max() < 1e-5
    assert (lp_old - batch.rollout_logprobs)[tv == 1].abs().max() > 1e-4  # the new part is really new
    assert 0 < metrics["async/partial_frac"] < 1 and metrics["async/masked_token_frac"] > 0


def test_resume_with_a_buffer_is_the_uninterrupted_run(task, tmp_path):
    """4 steps saved every step, and the same run resumed from the first checkpoint whose buffer holds
    aborted samples with tokens: the resumed run resumes that buffer in its first step and logs the
    very steps after it, ending on the same weights. Red check (scratch edit, restored): a resume that
    does not load the buffer (Partial.load a no-op) logs other steps."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", *ABORT, "--save-every", "1", "--keep-checkpoints", "5")
    train.main(args(task, a, *extra))
    for k in range(1, 4):
        ck = os.path.join(a, "checkpoints", f"step_{k:06d}")
        buffer = torch.load(os.path.join(ck, sources.Partial.FILE), weights_only=True)["buffer"]
        if any(s["status"] == "aborted" and s["response_ids"] for g in buffer for s in g["samples"]):
            break
    else:
        pytest.fail("no checkpoint holds an aborted sample with tokens")
    train.main(args(task, b, *extra, "--resume", ck))
    la, lb = every_step(a), every_step(b)
    assert [x["step"] for x in lb] == list(range(k + 1, 5)) and la[k:] == lb
    assert lb[0]["rollout/async/resumed_groups"] == len(buffer)
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_env_episodes_abort_resume_and_survive_a_checkpoint(calc_task, tmp_path):
    """--env calc in the synchronous loop: episodes still going once the step has its groups are aborted
    (between turns or inside one) and resumed by the next step at their next turn; 4 steps saved every
    step, and the run resumed from the first checkpoint whose buffer holds an aborted episode logs the
    very steps after it and ends on the same weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", "--partial-rollout", "abort", "--over-sample", "2", "--save-every", "1",
             "--keep-checkpoints", "5", "--mask-offpolicy-in-partial-rollout")
    train.main(calc_args(calc_task, a, *extra))
    lines = every_step(a)
    assert sum(x["rollout/async/resumed_groups"] for x in lines) > 0
    assert all(x["rollout/async/staleness_max"] <= 1 and x["rollout/env/turns_mean"] >= 1 for x in lines)
    for k in range(1, 4):
        ck = os.path.join(a, "checkpoints", f"step_{k:06d}")
        buffer = torch.load(os.path.join(ck, sources.Partial.FILE), weights_only=True)["buffer"]
        if any(s["status"] == "aborted" and s["response_ids"] for g in buffer for s in g["samples"]):
            break
    else:
        pytest.fail("no checkpoint holds an aborted episode with tokens")
    train.main(calc_args(calc_task, b, *extra, "--resume", ck))
    assert every_step(a)[k:] == every_step(b)
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_filter_groups_aborts_once_the_step_has_kept_groups(task, half, tmp_path, monkeypatch):
    """--filter-groups with synchronous --partial-rollout abort --over-sample 4: the step keeps 4 × 2
    groups in flight and aborts once 2 WITH reward variance are in (partial_rollout.GroupFilter on the
    engine's own source), so every step fills in one round; the cut groups resume in the next step."""
    seen = []
    real = train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch) or real(run, batch))
    flags = [x for x in run_args(task, tmp_path, half, "--partial-rollout", "abort", "--over-sample", "4")]
    i = flags.index("--async-steps")
    del flags[i:i + 2]  # the synchronous loop
    train.main(flags)
    assert logged(tmp_path, "rollout/dapo/gen_rounds") == [1] * 4 and len(seen) == 4
    assert_full(seen)
    assert sum(logged(tmp_path, "rollout/async/aborted_groups")) > 0
    assert sum(logged(tmp_path, "rollout/async/resumed_groups")) > 0
    assert max(logged(tmp_path, "rollout/async/staleness_max")) <= 1
    assert any(f < 1 for f in logged(tmp_path, "rollout/groups_kept_frac"))  # the filter dropped some


@pytest.mark.slow
def test_two_ranks_keep_a_buffer_each_and_resume_exactly(task, tmp_path):
    """torchrun, 2 gloo ranks: each rank over-samples its shard of the step's groups, aborts and resumes
    its own (partial_rollout.pt and partial_rollout.rank1.pt in a checkpoint, each with its loader
    position); the ranks end in sync, and a 2-rank run resumed from its step-2 checkpoint logs the
    uninterrupted run's steps 3-4 and ends on its weights (red when rank 1 resumes rank 0's buffer)."""
    from test_lockstep import run as launch
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", *ABORT, "--save-every", "2", "--keep-checkpoints", "3")
    for out, more in ((a, ()), (b, ("--resume", str(a / "checkpoints" / "step_000002")))):
        proc = launch("train.py", *args(task, out, *extra, *more), ranks=2, port=free_port())
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert "ranks in sync" in proc.stdout
    ck = a / "checkpoints" / "step_000002"
    assert {sources.Partial.FILE, "partial_rollout.rank1.pt"} <= set(os.listdir(ck))
    la, lb = every_step(a), every_step(b)
    assert sum(x["rollout/async/resumed_groups"] for x in la) > 0
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_agent_never_gets_there():
    """--agent cannot abort (its episodes run in the user's function): the config refuses its
    --over-sample before any partial rollout is built."""
    with pytest.raises(ConfigError, match="--agent with --over-sample is not supported"):
        Config.from_flags(partial_rollout="abort", over_sample=2, agent="agent.py:fn")


def test_config_takes_abort_without_async_steps():
    cfg = Config.from_flags(partial_rollout="abort", over_sample=2)
    assert cfg.pipeline.async_steps == 0 and cfg.pipeline.partial_rollout == "abort"
    with pytest.raises(ValueError, match="needs --over-sample >= 2"):
        Config.from_flags(partial_rollout="abort")
