"""--agent (nanorl/agent.py): an unmodified openai-client agent runs through the endpoint; the recorded
ids are what the engine sampled, the loss mask covers exactly them; a decode → re-encode of a reply
is caught (the episode is split, never trained on ids the policy did not sample); failed episodes are
counted and dropped; the endpoint refuses a request without the token (401) and from another machine
(403, its check); and (slow) an agent trained through `python train.py --agent ...` learns.

The re-tokenisation test uses tests/test_env.py's BPE tokenizer: the policy's "a", "b" (two tokens)
decode to "ab", which re-encodes to ONE token, so a server that re-tokenised would change the ids.
Run: python -m pytest tests/test_agent.py -q
"""
import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from nanorl.agent import AgentRunner, _message, loopback
from nanorl.config import Config, ConfigError
from nanorl.data import Prompt
from nanorl.rollout import HFEngine, RolloutEngine, SamplingConfig
from nanorl.sources import Agents
from nanorl.task import build_model
from nanorl.tool_envs import build_calc_tokenizer
from nanorl.trajectory import TRAINS, Sample
from nanorl.weight_broadcast import free_port
from tests.test_env import bpe_chat_tokenizer

openai = pytest.importorskip("openai", reason="the agents here are plain openai clients: pip install openai")


class Recording(RolloutEngine):
    """Records every (prompt, sampled ids, logprobs) the wrapped engine produced."""
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, sampling):
        out = self.engine.generate(prompts, n, sampling)
        self.calls += [(list(p), list(s.response_ids), list(s.rollout_logprobs))
                       for p, s in zip(prompts, out)]
        return out


class Scripted(RolloutEngine):
    """Always samples "a", "b", <|im_end|> (two tokens that re-encode as one)."""
    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, sampling):
        self.calls += [list(p) for p in prompts]
        return [Sample(prompt_ids=list(p), response_ids=[4, 5, 1], rollout_logprobs=[-0.5, -0.25, -0.125],
                       group_id=i) for i, p in enumerate(prompts)]


def one_tool_call(base_url, api_key, episode_id, row):
    """Multi-turn, one tool call, whatever the model says: the plain openai client."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "tool", "content": "16"}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return float(second.choices[0].message.content.strip() == row["label"])


def calc_prompts(tok, texts):
    return [Prompt(ids=tok(t, add_special_tokens=False)["input_ids"], text=t, label=str(eval(t[:-1])))
            for t in texts]


def test_openai_agent_records_the_sampled_ids_and_masks_the_rest():
    tok = build_calc_tokenizer()
    engine = Recording(HFEngine(build_model(len(tok), seed=0, hidden=64).eval(), pad_id=0))
    engine.engine.generator.manual_seed(0)
    runner = AgentRunner(engine, one_tool_call, tok)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    try:
        samples = runner.rollout(calc_prompts(tok, ["3+4+9=", "1+2+3="]), 3, sp)
    finally:
        runner.close()
    assert len(samples) == 6 and [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1]
    assert len(engine.calls) == 12  # 2 calls per episode, 6 episodes
    for s in samples:
        info = s.episode
        assert (info["end"], info["calls"], info["split"], s.status in TRAINS) == ("done", 2, False, True)
        (a0, a1), (b0, b1) = info["spans"]
        assert a0 == 0 and b1 == s.response_length
        # each call: its prompt = the ids so far, its sampled ids and logprobs as the engine returned them
        for start, end in info["spans"]:
            call = (s.prompt_ids + s.response_ids[:start], s.response_ids[start:end],
                    s.rollout_logprobs[start:end])
            assert call in engine.calls
        # between them, the tool's answer framed by the template, encoded once (">16="); the template's
        # "<eos>" after the reply too when the model ran out of tokens before writing its own
        stopped = s.response_ids[a1 - 1] == tok.eos_token_id
        assert s.response_ids[a1:b0] == tok(("" if stopped else "<eos>") + ">16=",
                                            add_special_tokens=False)["input_ids"]
        assert s.loss_mask == [int(a0 <= t < a1 or b0 <= t < b1) for t in range(s.response_length)]
        assert all(v == 0.0 for v in s.rollout_logprobs[a1:b0])
    metrics = Agents(runner).metrics(samples)
    assert metrics["agent/episodes"] == 6 and metrics["agent/calls_per_episode"] == 2.0
    assert metrics["agent/failed_frac"] == 0.0


def run_bpe(agent_fn, prompts=("t",), **kw):
    tok = bpe_chat_tokenizer()
    runner = AgentRunner(Scripted(), agent_fn, tok, **kw)
    ps = [Prompt(ids=tok.apply_chat_template([{"role": "user", "content": "t"}],
                                            add_generation_prompt=True)["input_ids"], text=t, label="x")
          for t in prompts]
    try:
        return tok, runner, runner.rollout(ps, 1, SamplingConfig(max_new_tokens=8, stop_token_ids=(1,)))
    finally:
        runner.close()


def reply_then_tool(base_url, api_key, episode_id, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "t"}]
    for _ in range(2):
        text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "ba"}]
    return 1.0


def test_replies_are_never_retokenised():
    tok, runner, (s,) = run_bpe(reply_then_tool)
    first = runner.engine.calls[0]
    tool = tok("\n<|im_start|>t\nba<|im_end|>\n<|im_start|>a\n", add_special_tokens=False)["input_ids"]
    # call 2's prompt: call 1's + the SAMPLED ids [a, b, <|im_end|>] + the tool message, never "ab" as one id
    assert runner.engine.calls[1] == first + [4, 5, 1] + tool
    assert s.prompt_ids == first and s.response_ids == [4, 5, 1] + tool + [4, 5, 1]
    assert s.loss_mask == [1, 1, 1] + [0] * len(tool) + [1, 1, 1]
    assert s.rollout_logprobs[:3] == [-0.5, -0.25, -0.125] and not s.episode["split"]


def test_a_planted_retokenisation_is_caught(monkeypatch):
    """A server that decoded the reply and re-encoded the conversation: call 2's prompt holds "ab" as
    one id, so it does not extend call 1's prompt + sampled ids; the episode is split into one Sample
    per call (counted in agent/split_frac), and no trained token is one the policy did not sample."""
    def reencode(self, e, body):
        msgs = [_message(m) for m in body["messages"]]
        return self._encode(self._render(msgs, None)), msgs
    monkeypatch.setattr(AgentRunner, "_chat_ids", reencode)
    tok, runner, samples = run_bpe(reply_then_tool)
    assert 10 in runner.engine.calls[1]  # the merged "ab": the plant happened
    assert len(samples) == 2 and all(s.episode["split"] for s in samples)
    assert all(s.response_ids == [4, 5, 1] and s.reward == 1.0 for s in samples)
    assert Agents(runner).metrics(samples)["agent/split_frac"] == 1.0


def test_rewritten_history_falls_back_to_one_sample_per_call():
    def editor(base_url, api_key, episode_id, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": "t"}]
        client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "u"}]
        client.chat.completions.create(model="policy", messages=messages)
        return {"correct": 1.0, "format": 0.5}
    _, runner, samples = run_bpe(editor)
    assert [s.episode["call"] for s in samples] == [0, 1]
    assert all(s.reward == {"correct": 1.0, "format": 0.5} and s.status == "completed" for s in samples)


def failing(base_url, api_key, episode_id, row):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    what = row["prompt"]
    if what == "raise":
        raise RuntimeError("the agent's bug")
    if what == "sleep":
        time.sleep(3)
    if what == "bad":
        try:  # n > 1 is refused (400): the episode fails even if the agent carries on
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "t"}], n=2)
        except openai.BadRequestError:
            pass
    if what in ("ok", "bad"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "t"}])
    return {"correct": 1.0}


def test_failed_episodes_are_counted_and_dropped():
    logs = []
    _, runner, samples = run_bpe(failing, prompts=("ok", "raise", "sleep", "bad", "none"), timeout=1.5,
                                 log=logs.append)
    ends = [s.episode["end"] for s in samples]
    assert ends == ["done", "error", "timeout", "malformed", "no_calls"]
    assert [s.status for s in samples] == ["completed", "env_error", "tool_timeout", "env_error", "env_error"]
    assert [s.status in TRAINS for s in samples] == [True, False, False, False, False]
    # one reward kind per batch: a failed episode's reward is the components at 0
    assert samples[1].reward == {"correct": 0.0} and samples[0].reward == {"correct": 1.0}
    assert dict(runner.faults) == {"error": 1, "timeout": 1, "malformed": 1, "no_calls": 1}
    metrics = Agents(runner).metrics(samples)
    assert metrics["agent/failed_frac"] == 0.8 and metrics["agent_faults/timeout"] == 1
    assert len(logs) == 1 and "the agent's bug" in logs[0]  # the first traceback, once


def test_the_endpoint_needs_the_token_and_loopback():
    runner = AgentRunner(Scripted(), failing, bpe_chat_tokenizer())
    runner._serve()
    base = f"http://127.0.0.1:{runner._server.server_address[1]}"

    def get(path, token=None, body=None):
        req = urllib.request.Request(base + path, data=body, headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    try:
        assert get("/v1/models")[0] == 401
        assert get("/v1/models", token="guess")[0] == 401
        assert get("/e/1-0-0/v1/chat/completions", body=b"{}")[0] == 401
        code, out = get("/v1/models", token=runner.token)
        assert code == 200 and out["data"][0]["id"] == "policy"
        # an episode that is not running now
        assert get("/e/9-9-9/v1/chat/completions", token=runner.token, body=b'{"messages": []}')[0] == 404
    finally:
        runner.close()
    assert all(loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "::ffff:127.0.0.1"))
    assert not any(loopback(h) for h in ("10.0.0.1", "192.168.1.2", "::ffff:10.0.0.1", "2001:db8::1", "x"))


def test_config_refuses_what_cannot_combine():
    assert Config.from_flags(agent="a.py:run").agent == "a.py:run"
    # the async worker serves the endpoint (tests/test_agent_async.py)
    assert Config.from_flags(agent="a.py:run", async_steps=2).pipeline.async_steps == 2
    for bad in (dict(env="calc", max_new_tokens=12), dict(reward="math"), dict(filter_groups=True),
                dict(over_sample=2, async_steps=1, partial_rollout="abort")):
        with pytest.raises(ConfigError, match="agent"):
            Config.from_flags(agent="a.py:run", **bad)
    with pytest.raises(ConfigError, match="file.py:fn"):
        Config.from_flags(agent="a.py")


@pytest.mark.slow
def test_an_agent_learns_through_train_py(tmp_path):
    """GRPO through train.py --agent examples/agents/calculator_agent.py:run on the built-in task's
    calculator variant: held-out greedy accuracy (the agent's reward, 200 problems) rises. Measured (2
    shared cores of an Intel Xeon, seed 0, 30 steps of 16 prompts x 8 episodes, lr 3e-4): accuracy
    0.490 -> 0.935, model calls per sampled episode 1.24 -> 1.73 (the agent learns to call the
    calculator), 165 s. The +0.25 margin sits far inside that gain and above the ~0.035 noise of 200
    greedy problems."""
    import train

    start = time.perf_counter()
    res = train.main(["--algo", "grpo", "--agent", "examples/agents/calculator_agent.py:run",
                      "--max-new-tokens", "12", "--steps", "30", "--eval-every", "0", "--pass-k", "1",
                      "--seed", "0", "--threads", "1", "--lr", "3e-4", "--quiet", "--out-dir", str(tmp_path)])
    before, after = res["before"]["eval/accuracy"], res["after"]["eval/accuracy"]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"rollout/agent/episodes"' in x]
    calls = [x["rollout/agent/calls_per_episode"] for x in rows]
    print(f"30 steps in {time.perf_counter() - start:.0f}s: accuracy {before:.3f} -> {after:.3f}; "
          f"calls per episode {sum(calls[:5]) / 5:.2f} -> {sum(calls[-5:]) / 5:.2f}")
    assert len(rows) == 30 and torch.isfinite(torch.tensor(calls)).all()
    assert after - before >= 0.25


@pytest.mark.slow
def test_two_ranks_each_serve_their_own_endpoint(tmp_path):
    """torchrun with 2 CPU ranks (gloo): each rank serves its shard's episodes on its own port, the step
    trains on both shards and the ranks end with identical weights (train.py's check)."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()),
           "train.py", "--algo", "grpo", "--agent", "examples/agents/calculator_agent.py:run",
           "--max-new-tokens", "12", "--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
           "--eval-every", "0", "--eval-limit", "16", "--threads", "1", "--quiet", "--out-dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ranks in sync: parameters identical on 2 ranks" in res.stdout, res.stdout[-2000:]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl") if '"rollout/agent/episodes"' in x]
    assert len(rows) == 2 and all(r["rollout/agent/failed_frac"] < 1 for r in rows), rows
