"""Asynchronous RL (nanorl/pipeline.py, issue 20): K = 0 is the synchronous run bitwise; no sample
older than K versions reaches the loss and each carries the version that really sampled it; a forced
mid-generation update gives two-version samples with the right per-token versions, logprobs and
masks; an async run resumes to the uninterrupted run; a worker's error surfaces in the trainer.
(The learning test is in tests/test_learning.py.)   python -m pytest tests/test_pipeline.py -q
"""
import copy
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

import train
from nanorl import checkpoint, pipeline, rollout_worker, scoring, sources, stages
from nanorl.config import Config
from nanorl.policy import response_logprobs
from nanorl.trajectory import collate

TINY = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-every", "0", "--eval-limit", "8",
        "--quiet", "--pass-k", "2", "--threads", "1", "--schedule", "constant"]
TIMING = ("perf/",)  # phase times, throughput, memory, the pipeline's waits: differ run to run


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from nanorl.task import make_default
    # the 60-step warm start these tests were written on: its answers are 1 to 3 digits long, so a
    # mid-generation update falls inside some responses and after others
    return make_default(str(tmp_path_factory.mktemp("task")), seed=0, sft_steps=60)


def args(task, out, *extra):
    return ["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
            "--out-dir", str(out), *TINY, *extra]


def step_lines(out) -> list[dict]:
    """Every logged training step, without the wall-clock figures (they differ run to run)."""
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith(TIMING)} for x in lines if "train/loss" in x]


def weights(out, step):
    return checkpoint.load_file(os.path.join(out, "checkpoints", f"step_{step:06d}", "model.safetensors"))


def setup_run(task, out, **kw):
    return train.setup(Config.from_flags(model=task["model"], train_data=task["train"],
                                         test_data=task["test"],
                              quiet=True,
                              **{"out_dir": str(out), "eval_every": 0, "threads": 1, "prompts_per_step": 4,
                                 "samples_per_prompt": 2, **kw}))


def logprobs_under(model, state, batch):
    """Teacher-forced response logprobs [B, T] of `batch` under the weights `state`."""
    scratch = copy.deepcopy(model)
    scratch.load_state_dict(state)
    with torch.no_grad():
        return response_logprobs(scratch, batch, 1.0)[0]


def next_version(run, pipe, versions: dict, t: int, g: torch.Generator, scale: float = 0.05) -> None:
    """"Train" step t: move every weight (a version that differs from the last), keep a copy in
    versions[t + 1] and publish it to the worker, as train.py's sync does."""
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    versions[t + 1] = {k: x.clone() for k, x in run.model.state_dict().items()}
    run.step = t + 1
    pipe.publish(run.model, t + 1)


def driven(run, steps: int, K: int):
    """Drive the pipeline as train.py does, weights perturbed at every step (`next_version`) so that
    versions differ: yields (t, pipe, samples, batch, versions) for each step t once batch t is taken
    (checked to come from version max(0, t − K) exactly), then trains; closes the pipeline at the end."""
    pipe = run.pipeline = pipeline.start(run)
    run.source = sources.Worker(pipe, run.source)
    versions = {0: {k: v.clone() for k, v in run.model.state_dict().items()}}
    g = torch.Generator().manual_seed(0)
    try:
        for t in range(steps):
            samples = pipe.take(t, run.loader.next_batch())
            assert {s.weight_version for s in samples} == {max(0, t - K)}
            yield t, pipe, samples, collate(samples, run.tokenizer.pad_token_id), versions
            next_version(run, pipe, versions, t, g)
    finally:
        pipe.close()


def test_k0_is_the_synchronous_run_bitwise(task, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(pipeline, "start", lambda *a: started.append(a))  # K = 0 must never get here
    train.main(args(task, tmp_path / "sync", "--steps", "3"))
    train.main(args(task, tmp_path / "k0", "--steps", "3", "--async-steps", "0"))
    a, b = step_lines(tmp_path / "sync"), step_lines(tmp_path / "k0")
    assert len(a) == 3 and a == b and not any("async/" in k for x in a for k in x)
    wa, wb = weights(tmp_path / "sync", 3), weights(tmp_path / "k0", 3)
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and not started


def test_staleness_bound_and_each_version_is_the_engines(task, tmp_path):
    """Driven like train.py drives it, with weights perturbed at every step so that versions differ:
    batch t comes from version max(0, t − K) exactly, and its rollout logprobs are that version's
    teacher-forced logprobs (so the label is the engine's version at sampling time), not the next.
    The worker's reference logprobs are, bit for bit, what the trainer's own recompute gives."""
    K, steps = 2, 6
    run = setup_run(task, tmp_path, steps=steps, async_steps=K, kl_coef=0.01)
    for t, pipe, samples, batch, versions in driven(run, steps, K):
        v = max(0, t - K)
        assert pipe.metrics["async/staleness_max"] == pipe.metrics["async/staleness_mean"] == t - v
        assert pipe.metrics["async/offpolicy_token_frac"] == (1.0 if t > v else 0.0)
        m = batch.response_mask > 0

        def gap(u):  # the largest |Δ logprob| between the rollout and version u's weights
            return float((logprobs_under(run.model, versions[u], batch) -
                          batch.rollout_logprobs)[m].abs().max())
        assert gap(v) < 1e-5
        if v + 1 in versions:
            assert gap(v + 1) > 1e-3
        with torch.no_grad():
            ref = scoring.score_batch(run, run.ref, batch, None)[0]
        assert torch.equal(pipe.ref_logprobs(samples, batch), ref)
    run.logger.close()


def test_remax_baselines_are_the_greedy_rewards_of_the_batchs_version(task, tmp_path):
    """ReMax with --async-steps: each sample carries its prompt's greedy reward under the version that
    sampled its batch (not the trainer's newer one), and train.py's advantage reads exactly those."""
    from nanorl.rewards import score_samples
    from nanorl.rollout import HFEngine, SamplingConfig
    K, steps = 1, 3
    run = setup_run(task, tmp_path, steps=steps, async_steps=K, advantage="remax", max_new_tokens=4)
    pipe = run.pipeline = pipeline.start(run)
    run.source = sources.Worker(pipe, run.source)
    versions = {0: {k: v.clone() for k, v in run.model.state_dict().items()}}
    g = torch.Generator().manual_seed(0)
    greedy_sp = SamplingConfig(temperature=0.0, max_new_tokens=4,
                               stop_token_ids=pipe_stop_tokens(run))
    seen_differ = False
    try:
        for t in range(steps):
            prompts = run.loader.next_batch()
            samples = pipe.take(t, prompts)
            v = max(0, t - K)

            def greedy_rewards(u):  # the greedy responses' rewards under version u, per sample
                scratch = copy.deepcopy(run.model)
                scratch.load_state_dict(versions[u])
                greedy = HFEngine(scratch, pad_id=run.tokenizer.pad_token_id).generate(
                    [p.ids for p in prompts], 1, greedy_sp)
                r = score_samples(run.rewards, run.tokenizer, prompts, greedy)
                return [r[s.group_id] for s in samples]
            got = [s.greedy_baseline for s in samples]
            assert got == greedy_rewards(v)
            # the trainer's own version t would give other baselines (the test is not vacuous)
            seen_differ |= t > v and greedy_rewards(t) != got
            baselines = stages.greedy_baselines(train.sampler_of(run), prompts, samples, None, None)
            assert baselines.tolist() == got
            next_version(run, pipe, versions, t, g, scale=0.5)  # far enough to change greedy answers
    finally:
        pipe.close()
        run.logger.close()
    assert seen_differ
    train.main(args(task, tmp_path / "e2e", "--steps", "2", "--async-steps", "1", "--advantage", "remax"))
    assert len(step_lines(tmp_path / "e2e")) == 2


USER_ENV = ("from nanorl.env import Env, Step\n\n"
            "class UserEnv(Env):\n    def reset(self, prompt):\n        self.label = prompt.label\n"
            "        self.kind = int(prompt.text[0]) % 3\n\n    def step(self, action):\n"
            "        if self.kind == 0 and action.turn == 0:\n"
            "            raise ValueError('bad tool input')\n"
            "        if action.turn == 0:\n            return Step([13, 13], 0.0, False, {'tool_calls': 1})\n"
            "        return Step(None, float(action.text == self.label), True, {})\n")


def test_env_episodes_run_in_the_worker_from_the_batchs_version(task, tmp_path):
    """--env with --async-steps: the worker's own driver plays the episodes (two model turns around an
    environment message); every model token's rollout logprob is version max(0, t − K)'s, environment
    tokens are masked out, and the environment faults raised in the worker reach the trainer's totals."""
    (tmp_path / "user_env.py").write_text(USER_ENV)
    env = f"{tmp_path / 'user_env.py'}:UserEnv"
    K, steps = 1, 3
    run = setup_run(task, tmp_path / "driven", steps=steps, async_steps=K, env=env, env_max_turns=2)
    try:
        for t, _, samples, batch, versions in driven(run, steps, K):
            two_turns = [s for s in samples if s.episode["turns"] == 2]
            assert two_turns, "no episode reached its second model turn"
            m = batch.response_mask > 0  # the model's own tokens (environment tokens are 0 in it)
            assert any(0 in s.loss_mask for s in two_turns)  # environment tokens inside responses
            gap = (logprobs_under(run.model, versions[max(0, t - K)], batch) - batch.rollout_logprobs)[m]
            assert float(gap.abs().max()) < 1e-5
        assert run.episodes.faults["env_error"] > 0  # counted in the worker, totalled here
    finally:
        run.episodes.close()
        run.logger.close()
    train.main(args(task, tmp_path / "e2e", "--steps", "2", "--async-steps", "1", "--env", env,
                    "--env-max-turns", "2"))
    lines = [json.loads(x) for x in open(tmp_path / "e2e" / "metrics.jsonl")]
    lines = [x for x in lines if "rollout/async/staleness_max" in x]  # the steps (all-zero groups: no loss)
    assert [x["rollout/async/staleness_max"] for x in lines] == [0, 1]
    assert lines[-1]["rollout/env_faults/env_error"] > 0 and "rollout/env/turns_mean" in lines[-1]


def pipe_stop_tokens(run):
    from nanorl.rollout import stop_token_ids
    return stop_token_ids(run.model, run.tokenizer)


def test_trainer_refuses_a_sample_older_than_k(task, tmp_path, monkeypatch):
    """train.py end to end: the logged staleness is exactly min(step, K); a worker breaking the rule by
    one version (planted: it samples batch b from b − K − 1) stops the run before that batch trains."""
    train.main(args(task, tmp_path / "ok", "--steps", "4", "--async-steps", "2"))
    assert [x["rollout/async/staleness_max"] for x in step_lines(tmp_path / "ok")] == [0, 1, 2, 2]
    monkeypatch.setattr(rollout_worker, "sampled_from", lambda b, K, v0: max(v0, b - K - 1))  # forked
    with pytest.raises(RuntimeError, match="a sample of version 0 reached step 3"):
        train.main(args(task, tmp_path / "bad", "--steps", "4", "--async-steps", "2"))
    assert len(step_lines(tmp_path / "bad")) == 3  # steps 0-2 trained (within the bound), step 3 never did


def test_spawned_worker_is_the_forked_one(task, tmp_path, monkeypatch):
    """The start method CUDA needs (spawn: a fresh interpreter, everything pickled to it) samples the
    same batches as the fork used on CPU: the same run, metric for metric. (Not bit for bit: the
    spawned worker does not inherit this test session's torch-only entropy path, tests/conftest.py,
    so its reference logprobs differ in the last bits.)"""
    train.main(args(task, tmp_path / "fork", "--steps", "2", "--async-steps", "1"))
    monkeypatch.setattr(pipeline, "start_method", lambda device: "spawn")
    train.main(args(task, tmp_path / "spawn", "--steps", "2", "--async-steps", "1"))
    forked, spawned = step_lines(tmp_path / "fork"), step_lines(tmp_path / "spawn")
    assert len(forked) == 2 and [x["rollout/reward_mean"] for x in forked] == [x["rollout/reward_mean"]
                                                                               for x in spawned]
    assert forked == [pytest.approx(x, rel=1e-5, abs=1e-9) for x in spawned]


def test_async_resume_is_the_uninterrupted_run(task, tmp_path):
    """K = 1: 4 steps, and the same run resumed from its step-2 checkpoint, log the same steps 3-4
    and end on the same weights. Batch 2 (version 1, which the checkpoint does not hold) comes from
    pipeline.pt; batch 3 is sampled again from version 2 with its seed."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", "--async-steps", "1", "--save-every", "2", "--keep-checkpoints", "3")
    train.main(args(task, a, *extra))
    ck = os.path.join(a, "checkpoints", "step_000002")
    assert pipeline.FILE in checkpoint.verify(ck)["files"]
    train.main(args(task, b, *extra, "--resume", ck))
    la, lb = step_lines(a), step_lines(b)
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_async_resume_of_a_synchronous_checkpoint_samples_from_its_weights(task, tmp_path):
    """A checkpoint without in-flight batches (saved by a synchronous run): the first K resumed
    batches come from the checkpoint's own version, the oldest there is, never from an older slot."""
    train.main(args(task, tmp_path / "sync", "--steps", "2"))
    ck = os.path.join(tmp_path / "sync", "checkpoints", "step_000002")
    train.main(args(task, tmp_path / "async", "--steps", "5", "--async-steps", "2", "--resume", ck))
    assert [x["rollout/async/staleness_max"] for x in step_lines(tmp_path / "async")] == [0, 1, 2]


def test_worker_error_is_raised_in_the_trainer(task, tmp_path, monkeypatch):
    def broken(self, b, prompts):
        raise ValueError("planted failure in the worker")
    monkeypatch.setattr(rollout_worker.Worker, "rollout", broken)  # inherited by the forked worker
    with pytest.raises(RuntimeError, match="rollout worker failed(.|\n)*planted failure"):
        train.main(args(task, tmp_path, "--steps", "2", "--async-steps", "1"))


def test_config_rejects_what_async_cannot_do():
    # (--partial-rollout abort without --async-steps runs in the synchronous step: tests/test_sync_partial.py)
    for kw, msg in ((dict(async_steps=1, mask_offpolicy_in_partial_rollout=True), "needs partial_rollout"),
                    (dict(rollout_device="cpu"), "rollout_device needs async_steps"),
                    (dict(async_steps=1, rollout_device="tpu0"), "is not a device"),
                    (dict(async_steps=-1), "async_steps must be >= 0")):
        with pytest.raises(ValueError, match=msg):
            Config.from_flags(**kw)


def _pool_in_a_fork(own_server: bool, out) -> None:
    from concurrent.futures import ProcessPoolExecutor
    if own_server:
        rollout_worker._own_forkserver()
    try:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver")) as pool:
            out.put(pool.submit(os.getpid).result(timeout=60) != os.getpid())
    except ChildProcessError as e:
        out.put(repr(e))


@pytest.mark.parametrize("own_server", [True, False], ids=["own", "inherited"])
def test_a_forked_worker_starts_reward_pools_from_its_own_forkserver(own_server):
    """The trainer's forkserver is running (its reward pool, once vLLM is loaded) when the rollout
    worker is forked: the worker's first pool must not ask the inherited server (ECHILD)."""
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=mp.get_context("forkserver")) as pool:
        pool.submit(os.getpid).result(timeout=60)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_pool_in_a_fork, args=(own_server, out))
    child.start()
    got = out.get(timeout=120)
    child.join(timeout=60)
    assert got is True if own_server else "ChildProcessError" in got  # the inherited one: the bug
