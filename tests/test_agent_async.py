"""--agent with --async-steps: the rollout worker serves the endpoint over its own engine and runs the
agent's episodes; they reach the trainer as the worker's other samples do.

`test_the_worker_runs_the_episodes` runs `train.py --agent ... --async-steps 1` in this process (the
worker is forked, so the recording patches below reach it): every sample carries the version its batch
was sampled from (a failed episode's too), every trained call's ids and logprobs are what the worker's
engine sampled under that version, the agent ran in the worker (its pid, 127.0.0.1), failed episodes
are counted and dropped, the staleness metrics are right, and the endpoint is gone once the run ends.
`test_resume_trains_the_saved_batch`: the batch in flight at a checkpoint, episodes and all,
trains the same after a resume. Later batches do not match: an agent rollout is not a function of its
seed. Which requests share an engine call (the dispatcher's 20 ms quiet gather) and their row order
(arrival order) are thread timing, and the seeded engine's draws follow the rows (docs/agents.md).
Measured: the resumed run's step 4 differed in reward and calls per episode; with the gather made to
wait for every episode and the rows sorted by prompt ids, the worker's engine calls were identical and
only the training figures differed, in float rounding (episodes of one prompt took the same replies in
another order) — so exact resume past the saved batches would need a deterministic dispatcher.
Run: python -m pytest tests/test_agent_async.py -q
"""
import json
import os
import socket
import urllib.parse

import pytest

import train
from nanorl import sources
from nanorl.rollout import HFEngine

pytest.importorskip("openai", reason="the calculator agent is a plain openai client: pip install openai")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the calculator agent, recording where each episode ran; the first episode of each rollout of the
# worker raises (the trainer's evaluation runs the agent too, in the trainer: never failed there)
AGENT = f"""
import json, os, sys
sys.path.insert(0, {os.path.join(REPO, "examples", "agents")!r})
from calculator_agent import run as calc


def run(base_url, api_key, episode_id, row):
    with open(os.environ["AGENT_LOG"], "a") as f:
        f.write(json.dumps([os.getpid(), episode_id, base_url]) + "\\n")
    if os.getpid() != int(os.environ["TRAINER_PID"]) and episode_id.endswith("-0-0"):
        raise RuntimeError("planted failure")
    return calc(base_url=base_url, api_key=api_key, episode_id=episode_id, row=row)
"""
FLAGS = ["--algo", "grpo", "--max-new-tokens", "12", "--prompts-per-step", "4", "--samples-per-prompt", "4",
         "--eval-every", "0", "--eval-limit", "8", "--pass-k", "1", "--threads", "1", "--quiet",
         "--async-steps", "1"]


def lines(path) -> list:
    return [json.loads(x) for x in open(path)] if os.path.exists(path) else []


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """The agent file, and what the run leaves: the worker engine's calls (prompt, sampled ids,
    logprobs, version, pid), the agent's episodes (pid, id, base_url), the batches the trainer took."""
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    calls, episodes, trainer = tmp_path / "calls.jsonl", tmp_path / "episodes.jsonl", os.getpid()
    monkeypatch.setenv("AGENT_LOG", str(episodes))
    monkeypatch.setenv("TRAINER_PID", str(trainer))
    generate, take = HFEngine.generate, sources.Worker.generate

    def recording(self, prompts, n, sampling, until=None):
        out = generate(self, prompts, n, sampling, until)
        if os.getpid() != trainer:  # the worker's engine (its dispatcher thread: one writer)
            with open(calls, "a") as f:
                for s in out:
                    f.write(json.dumps([list(s.prompt_ids), list(s.response_ids), list(s.rollout_logprobs),
                                        s.weight_version, os.getpid()]) + "\n")
        return out
    taken = []

    def taking(self, step, prompts, n, sampling):
        samples = take(self, step, prompts, n, sampling)
        taken.append((step, samples))
        return samples
    monkeypatch.setattr(HFEngine, "generate", recording)
    monkeypatch.setattr(sources.Worker, "generate", taking)
    return {"agent": f"{agent}:run", "calls": calls, "episodes": episodes, "taken": taken, "trainer": trainer}


def test_the_worker_runs_the_episodes(tmp_path, recorded):
    out = tmp_path / "run"
    train.main(["--agent", recorded["agent"], *FLAGS, "--steps", "3", "--out-dir", str(out)])
    calls, taken, trainer = lines(recorded["calls"]), recorded["taken"], recorded["trainer"]
    assert [t for t, _ in taken] == [0, 1, 2] and calls
    worker = {c[4] for c in calls}
    assert len(worker) == 1 and trainer not in worker  # one worker process sampled every call
    # the same prompt and reply may be sampled by several calls (a group's episodes), each with its own
    # logprobs (another batch's padding rounds differently) and version
    index = {}
    for p, r, lp, v, _ in calls:
        index.setdefault((tuple(p), tuple(r)), []).append((lp, v))
    trained_ids = set()
    for t, samples in taken:
        v = max(0, t - 1)  # K = 1: batch t from version t - 1
        assert len({s.episode["episode"] for s in samples}) == 16
        assert all(s.weight_version == v for s in samples), (t, [s.weight_version for s in samples])
        failed = [s for s in samples if s.episode["end"] != "done"]
        assert [(s.episode["end"], s.status, s.response_ids) for s in failed] == [("error", "env_error", [])]
        for s in samples:
            if s.episode["end"] != "done":
                continue
            trained_ids.add(s.episode["episode"])
            assert not s.episode["split"]
            spans = s.episode["spans"]
            for a, b in spans:  # each call: what the worker's engine sampled, under this batch's version
                made = index[(tuple(s.prompt_ids + s.response_ids[:a]), tuple(s.response_ids[a:b]))]
                assert (s.rollout_logprobs[a:b], v) in made
            assert s.loss_mask == [int(any(a <= i < b for a, b in spans)) for i in range(s.response_length)]
    # the episodes ran in the worker, on 127.0.0.1 (failed ones too; evaluation's in the trainer)
    ran = lines(recorded["episodes"])
    in_worker = [(eid, url) for pid, eid, url in ran if pid in worker]
    assert {pid for pid, _, _ in ran} == worker | {trainer}
    assert len(in_worker) == 3 * 16 and trained_ids <= {eid for eid, _ in in_worker}
    assert all(urllib.parse.urlsplit(url).hostname == "127.0.0.1" for _, url in in_worker)
    # failed episodes: dropped (one per batch), counted as run totals; staleness as the versions say
    rows = [x for x in lines(out / "metrics.jsonl") if "rollout/agent/episodes" in x]
    assert [x["rollout/dropped/env_error"] for x in rows] == [1, 1, 1]
    assert [x["rollout/agent_faults/error"] for x in rows] == [1, 2, 3]
    assert all(x["rollout/agent/failed_frac"] == 1 / 16 for x in rows)
    assert [x["rollout/async/staleness_max"] for x in rows] == [0.0, 1.0, 1.0]
    # the endpoint stopped with the worker
    port = urllib.parse.urlsplit(in_worker[0][1]).port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_resume_trains_the_saved_batch(tmp_path, recorded):
    """4 steps saving at step 2, and a run resumed from that checkpoint: the checkpoint holds batch 2
    (episodes, spans, failed ones), sampled ahead by the worker; the resumed run's first step trains
    on it and logs what the uninterrupted run logged at step 3, bit for bit. Not compared: the
    agent_faults run totals (neither the trainer's --env nor its --agent fault counters are in a
    checkpoint) and step 4, whose batch the new worker samples afresh (module docstring)."""
    a, b = tmp_path / "a", tmp_path / "b"
    # every row trains: with --skip-zero-advantage a batch whose groups all have equal rewards logs no
    # train/loss (seen under load, where the episodes' timing, and so the batches, vary from run to run)
    common = ["--agent", recorded["agent"], *FLAGS, "--steps", "4", "--save-every", "2",
              "--keep-checkpoints", "3", "--no-skip-zero-advantage"]
    train.main([*common, "--out-dir", str(a)])
    train.main([*common, "--out-dir", str(b), "--resume", str(a / "checkpoints" / "step_000002")])

    def steps(out):
        skip = ("perf/", "rollout/agent_faults/")
        return {x["step"]: {k: v for k, v in x.items() if not k.startswith(skip)}
                for x in lines(out / "metrics.jsonl") if "train/loss" in x}
    sa, sb = steps(a), steps(b)
    assert sorted(sb) == [3, 4] and sa[3] == sb[3]
    saved = {s.episode["episode"]: s for t, batch in recorded["taken"][:4] if t == 2 for s in batch}
    resumed = recorded["taken"][4]
    assert resumed[0] == 2 and {s.episode["episode"]: s for s in resumed[1]} == saved
