"""Multi-turn episodes (nanorl/env.py, nanorl/tool_envs.py): token-in/token-out ids, rollout logprobs
equal to the trainer's recompute on every model token, no loss or gradient on environment tokens,
and every way an episode can fail ends it with a status and a count instead of crashing the step.

The tokenizer here is a BPE one whose merges make the failure real: the policy samples "a", "b" as
two tokens, decoding gives "ab", re-encoding gives ONE token, so a driver that re-tokenised the
conversation between turns would feed (and train on) ids the policy never sampled.
Run: python -m pytest tests/test_env.py -q
"""
import time
from types import SimpleNamespace

import pytest
import torch

from nanorl.data import Prompt
from nanorl.env import Env, Step, ToolRunner, episode_metrics, turn_reward_tensor
from nanorl.episodes import ChatTurns, EpisodeRunner
from nanorl.policy import response_logprobs
from nanorl.rollout import HFEngine, RolloutEngine, SamplingConfig
from nanorl.task import build_model
from nanorl.trajectory import collate

PAD, END = 0, 1
STOPS = (END, 6, 7)  # <|im_end|>, "c", "d": a random model ends its turns within a few tokens
TURNS = 3
OBS = ["ab", "abcd", "ba"]  # tool outputs; each re-encodes into merged pieces


def bpe_chat_tokenizer():
    """14 tokens: specials, "\\n", letters, and merges ab, cd, abcd, ba; a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<|im_end|>": 1, "<|im_start|>": 2, "\n": 3, "a": 4, "b": 5, "c": 6, "d": 7, "t": 8,
             "u": 9, "ab": 10, "cd": 11, "abcd": 12, "ba": 13}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("c", "d"), ("ab", "cd"), ("b", "a")]))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(["<pad>", "<|im_end|>", "<|im_start|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'][0] + '\\n' + m['content'] + "
                         "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>a\\n' "
                         "}}{% endif %}")
    return tok


def chat_prompts(tok, texts):
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
           for t in texts]
    return [Prompt(ids=list(i), text=t, label="x") for i, t in zip(ids, texts)]


class Echo(Env):
    """Answers model turn k with OBS[k]; done after TURNS model turns (reward 1), a tool call each turn."""
    def step(self, action):
        if action.turn == TURNS - 1:
            return Step(None, 1.0, True, {})
        return Step(OBS[action.turn], 0.0, False, {"tool_calls": 1})


class Recording(RolloutEngine):
    """An engine wrapper that records every prompt it is given and every turn it returns."""
    def __init__(self, engine):
        self.engine, self.prompts, self.turns = engine, [], []

    def generate(self, prompts, n, sampling):
        out = self.engine.generate(prompts, n, sampling)
        self.prompts += [list(p) for p in prompts]
        self.turns += [list(s.response_ids) for s in out]
        return out


@pytest.fixture(scope="module")
def tok():
    return bpe_chat_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(len(tok), seed=0, hidden=64).eval()  # random weights, head_dim 32


@pytest.fixture(scope="module")
def episodes(tok, model):
    engine = Recording(HFEngine(model, pad_id=PAD))
    engine.engine.generator.manual_seed(0)
    runner = EpisodeRunner(engine, Echo, tok, max_turns=TURNS + 1, max_tokens=64)
    sp = SamplingConfig(temperature=0.9, max_new_tokens=8, stop_token_ids=STOPS)
    samples = runner.generate(chat_prompts(tok, ["abcd", "cd", "ba", "dab"]), 6, sp)
    return runner, engine, samples


def assert_tito(tok, runner, engine, samples) -> int:
    """Every episode's ids are prompt + sampled + env tokens (encoded alone) + ..., and each turn's
    prompt was exactly the ids so far; → the number of episodes that ran all TURNS turns."""
    calls = iter(zip(engine.prompts, engine.turns))
    seen = {}  # the engine is called turn by turn over the live episodes, in order
    for turn in range(TURNS):
        for b, s in enumerate(samples):
            if len(s.episode["spans"]) > turn:
                seen[b, turn] = next(calls)
    full = 0
    for b, s in enumerate(samples):
        spans, expect = s.episode["spans"], []
        for k, (start, end) in enumerate(spans):
            prompt, sampled = seen[b, k]
            assert prompt == s.prompt_ids + expect, "the next prompt must extend the same ids (TITO)"
            expect += sampled
            if k + 1 < len(spans):  # the environment's message: framed by the template, encoded once, alone
                lead = "\n" if sampled[-1] == END else "<|im_end|>\n"  # what the template writes after a turn
                env = tok(lead + "<|im_start|>t\n" + OBS[k] + "<|im_end|>\n<|im_start|>a\n",
                          add_special_tokens=False)["input_ids"]
                assert env == runner.turns.encode(OBS[k], "tool", sampled[-1])
                expect += env
        assert s.response_ids == expect
        assert s.loss_mask == [int(any(a <= t < e for a, e in spans)) for t in range(len(expect))]
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m == 0)
        full += len(spans) == TURNS and s.episode["end"] == "done"
    return full


def test_ids_are_prompt_plus_sampled_plus_env_tokens_encoded_alone(tok, episodes):
    runner, engine, samples = episodes
    assert [s.group_id for s in samples] == [g for g in range(4) for _ in range(6)]
    full = assert_tito(tok, runner, engine, samples)
    assert full >= 8, f"only {full} episodes reached {TURNS} turns"
    # The hazard is real on this tokenizer: re-encoding the decoded conversation changes the ids.
    changed = sum(tok(tok.decode(s.prompt_ids + s.response_ids), add_special_tokens=False)["input_ids"]
                  != s.prompt_ids + s.response_ids for s in samples)
    assert changed >= 3, changed


def test_every_model_token_logprob_equals_the_trainer_recompute_hf(model, episodes):
    _, _, samples = episodes
    long = [s for s in samples if s.episode["turns"] >= TURNS]
    # env tokens between turns
    assert len(long) >= 8 and all(0 < sum(s.loss_mask) < s.response_length for s in long)
    batch = collate(long, PAD)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch, temperature=0.9)  # [B, T] the trainer's fp32 recompute
    valid = batch.response_mask.bool()  # model tokens only
    assert int(valid.sum()) == sum(sum(s.loss_mask) for s in long)
    gap = (lp - batch.rollout_logprobs)[valid].abs()
    print(f"max |Δlogprob| over {int(valid.sum())} model tokens: {gap.max():.2e}")
    assert gap.max() < 1e-4  # fp32: measured ~1e-6


def test_environment_tokens_get_no_loss_and_no_gradient(model, episodes):
    from nanorl.advantage import grpo
    from nanorl.losses import LossConfig, total_loss

    _, _, samples = episodes
    batch = collate(samples, PAD)
    env_tok = torch.zeros_like(batch.response_mask, dtype=torch.bool)  # [B, T] the environment's tokens:
    for b, s in enumerate(samples):                                      # the gaps between model turns
        spans = s.episode["spans"]
        for (_, end), (nxt, _) in zip(spans, spans[1:]):
            env_tok[b, end:nxt] = True
    assert int(env_tok.sum()) > 0
    lp, ent = response_logprobs(model, batch, temperature=0.9)  # [B, T] with grad
    lp.retain_grad()
    scores = torch.arange(len(samples), dtype=torch.float32) % 3  # rewards that differ within groups
    adv, _ = grpo(scores=scores, mask=batch.response_mask, index=batch.group_ids)
    loss, _ = total_loss(LossConfig(), lp, lp.detach(), adv, batch.response_mask, entropy=ent)
    loss.backward()
    assert (lp.grad[env_tok] == 0).all() and (lp.grad[~env_tok & (batch.response_mask > 0)] != 0).any()
    assert not batch.response_mask[env_tok].any()  # no loss mask on them, so no loss term
    shifted = torch.where(env_tok, lp.detach() - 5.0, lp.detach())  # move only env-token logprobs
    again, _ = total_loss(LossConfig(), shifted, lp.detach(), adv, batch.response_mask, entropy=ent.detach())
    assert torch.equal(again, loss.detach())  # no loss term reads them


# ----------------------------------------------------------------------------- failures end episodes
class Scripted(RolloutEngine):
    """An engine that 'samples' fixed turns: ids [5] * length + stop (no stop when length < 0)."""
    def __init__(self, length=2):
        self.length = length

    def generate(self, prompts, n, sampling):
        from nanorl.trajectory import Sample
        out = []
        for g, p in enumerate(prompts):
            r = [5] * min(abs(self.length), sampling.max_new_tokens)
            status = "truncated"
            if self.length >= 0 and len(r) < sampling.max_new_tokens:
                r, status = r + [END], "completed"
            out.append(Sample(prompt_ids=list(p), response_ids=r, rollout_logprobs=[-1.0] * len(r),
                              status=status,
                              group_id=g))
        return out


def hang(x):
    time.sleep(60)


class Flaky(Env):
    """Behaviour chosen by the prompt text: raise, hang in a tool, never finish, or go on with ids."""
    def reset(self, prompt):
        self.mode = prompt.text
        return None

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("tool crashed")
        if self.mode == "hang":
            self.call(hang, 1)
        return Step([3, 3, 3], 0.5, False, {"tool_calls": 1})  # ids: used as given, no template needed


def run_flaky(tok, mode, length=2, max_tokens=64, max_turns=3):
    runner = EpisodeRunner(Scripted(length), Flaky, tok, max_turns=max_turns, max_tokens=max_tokens,
                           tool_timeout=0.5, log=lambda text: None)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=4, stop_token_ids=(END,))
    try:
        return runner, runner.generate([Prompt(ids=[2], text=mode, label="")], 2, sp)
    finally:
        runner.close()


@pytest.mark.parametrize("mode,length,max_tokens,end,status", [
    ("raise", 2, 64, "env_error", "env_error"),
    ("hang", 2, 64, "tool_timeout", "tool_timeout"),
    ("go_on", 2, 64, "turn_cap", "truncated"),
    ("go_on", -1, 64, "truncated", "truncated"),   # a turn without a stop token
    ("go_on", 2, 10, "token_cap", "truncated"),    # 3 + 3 env tokens, then no room for another turn
])
def test_failures_end_the_episode_with_a_status_and_a_count(tok, mode, length, max_tokens, end, status):
    start = time.perf_counter()
    runner, samples = run_flaky(tok, mode, length, max_tokens)
    assert time.perf_counter() - start < 20  # the hung tool was killed at 0.5 s per call
    assert [s.episode["end"] for s in samples] == [end,
                                                           end] and {s.status for s in samples} == {status}
    m = episode_metrics(samples)
    assert m[f"env/end/{end}"] == 1.0 and sum(v for k, v in m.items() if k.startswith("env/end/")) == 1.0
    if end in ("env_error", "tool_timeout"):
        assert runner.faults[end] == 2
    if end == "turn_cap":  # 3 model turns, environment tokens between them, rewards summed
        assert samples[0].response_ids == [5, 5, END, 3, 3, 3] * 2 + [5, 5, END] and samples[0].reward == 1.5
    if end == "token_cap":
        assert len(samples[0].response_ids) <= 10 and samples[0].loss_mask[-1] == 1  # ends on a model token
    collate(samples, PAD)  # trainable as they are


class MaskFirst(Echo):
    """Echo that keeps the first model turn out of the loss (train only what follows the tool's answer)."""
    def step(self, action):
        obs, reward, done, info = super().step(action)
        return Step(obs, reward, done, {**info, "mask_turn": action.turn == 0})


def test_an_environment_masks_a_model_turn_out_of_the_loss(tok, model):
    engine = HFEngine(model, pad_id=PAD)
    engine.generator.manual_seed(0)
    runner = EpisodeRunner(engine, MaskFirst, tok, max_turns=TURNS + 1, max_tokens=64)
    sp = SamplingConfig(temperature=0.9, max_new_tokens=8, stop_token_ids=STOPS)
    samples = runner.generate(chat_prompts(tok, ["abcd", "cd", "ba", "dab"]), 3, sp)
    # the episodes the environment answered after their first turn (a truncated one never reached it)
    answered = [s for s in samples if len(s.episode["spans"]) > 1]
    for s in answered:
        (a, b), later = s.episode["spans"][0], s.episode["spans"][1:]
        assert s.loss_mask[a:b] == [0] * (b - a)  # the first turn: masked
        assert all(s.loss_mask[x:y] == [1] * (y - x) for x, y in later)  # the later ones train
    assert len(answered) >= 3, [s.episode for s in samples]


def test_turn_rewards_land_on_each_turns_last_token(tok):
    _, samples = run_flaky(tok, "go_on")  # rewards 0.5 on each of 3 turns
    tr = turn_reward_tensor(samples, 16)
    assert tr[0].nonzero().squeeze(1).tolist() == [2, 8, 14] and torch.allclose(tr.sum(1),
                                                                                torch.tensor([1.5, 1.5]))
    # outcome only: scores suffice
    assert turn_reward_tensor([s for s in run_flaky(tok, "raise")[1]], 4) is None
    # the trainer hands them to an estimator that reads token rewards, with or without KL
    from nanorl.config import Config
    from nanorl.kl import FixedKLController
    batch = collate(samples, PAD)
    batch.tensors.turn_rewards = turn_reward_tensor(samples, batch.response_ids.shape[1])
    from nanorl.plan import make_plan
    cfg = Config.from_flags(algo="reinforce_pp", advantage="reinforce_pp", kl_coef=0.001, kl_in_reward=True,
                 kl_estimator="k1")
    run = SimpleNamespace(cfg=cfg, kl_ctl=FixedKLController(0.001),
                          plan=make_plan(cfg, cfg.advantage, cfg.policy_loss))
    from nanorl import stages
    inputs = stages.advantage_inputs(run, run.plan, batch, torch.zeros_like(batch.response_mask), None)
    assert torch.equal(inputs["token_rewards"], batch.tensors.turn_rewards) and "scores" not in inputs


# ----------------------------------------------------------------------------- built-in environments
def test_calc_env_frames_tool_output_with_its_template():
    from nanorl.tool_envs import CalcEnv, build_calc_tokenizer, calc

    ctok = build_calc_tokenizer()
    assert calc("3+4+9") == 16 and calc("18-9") == 9
    with pytest.raises(ValueError):
        calc("3*4")
    env = CalcEnv()
    env.tools = ToolRunner(0)
    env.reset(Prompt(ids=[1], text="3+4+9=", label="16"))
    mk = lambda text: SimpleNamespace(text=text, ids=[], turn=0)  # noqa: E731
    assert env.step(mk("calc(3+4+9)")) == ("16", 0.0, False, {"tool_calls": 1})
    assert env.step(mk("16")) == (None, 1.0, True, {}) and env.step(mk("15"))[1] == 0.0
    ids = ChatTurns(ctok).encode("16", "tool", ctok.eos_token_id)
    assert ctok.convert_ids_to_tokens(ids) == [">", "1", "6", "="]


# Qwen2.5's layout of tool results (written here from its documented rendering): a run of tool messages
# is one user turn of <tool_response> blocks. The Qwen3-like one renders the LAST assistant turn with
# an empty thinking block, so a longer conversation does not extend a shorter one.
QWEN25_LIKE = ("{%- for m in messages -%}{%- if m['role'] == 'tool' -%}"
               "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user\\n' "
               "}}{%- endif -%}"
               "{{ '<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
               "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}"
               "{%- else -%}{{ '\\n' }}{%- endif -%}"
               "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- "
               "endif -%}"
               "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
QWEN3_LIKE = QWEN25_LIKE.replace("{{ '<|im_start|>' + m['role'] + '\\n' + m['content']",
                                 "{{ '<|im_start|>' + m['role'] + '\\n' + ('<think>\\n\\n</think>\\n\\n' if "
                                 "loop.last and m['role'] == 'assistant' else '') + m['content']")


@pytest.fixture(scope="module")
def qtok():
    from nanorl.task import build_real_shape_tokenizer  # Qwen2.5's vocabulary and special-token ids
    tok = build_real_shape_tokenizer()
    tok.chat_template = QWEN25_LIKE
    return tok


def test_chat_turns_frame_qwen_layouts(qtok):
    want = "\n<|im_start|>user\n<tool_response>\n2615\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert qtok.decode(ChatTurns(qtok).encode("2615", "tool", qtok.eos_token_id)) == want
    # stopped otherwise
    assert qtok.decode(ChatTurns(qtok).encode("2615", "tool", None)) == "<|im_end|>" + want
    q3 = __import__("copy").copy(qtok)
    q3.chat_template = QWEN3_LIKE
    last = q3.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                  tokenize=False)
    assert "<think>" in last  # re-rendered once a message follows: framed from the longer rendering alone
    assert q3.decode(ChatTurns(q3).encode("2615", "tool", q3.eos_token_id)) == want


def test_python_tool_chatml_call_answer_and_hang(qtok):
    from nanorl.tool_envs import PythonToolEnv, python_expression

    assert python_expression("37 * 43 + 2**10") == "2615" and python_expression("sqrt(16)") == "4.0"
    with pytest.raises(ValueError):
        python_expression("__import__('os').system('true')")
    turns = ["<tool_call>\n{\"name\": \"python\", \"arguments\": "
             "{\"expression\": \"37 * 43\"}}\n</tool_call>",
             "So the answer is \\boxed{1591}."]

    class Replay(RolloutEngine):  # an engine that writes the scripted turns in turn, each ended by <|im_end|>
        calls = 0

        def generate(self, prompts, n, sampling):
            from nanorl.trajectory import Sample
            text, Replay.calls = turns[Replay.calls % 2], Replay.calls + 1
            ids = qtok(text, add_special_tokens=False)["input_ids"] + [qtok.eos_token_id]
            return [Sample(prompt_ids=p, response_ids=ids, rollout_logprobs=[0.0] * len(ids))
                    for p in prompts]

    render = lambda text: qtok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                  add_generation_prompt=True)["input_ids"]
    runner = EpisodeRunner(Replay(), PythonToolEnv, qtok, max_turns=3, max_tokens=400, render=render)
    sp = SamplingConfig(max_new_tokens=64, stop_token_ids=(qtok.eos_token_id,))
    try:
        s, = runner.generate([Prompt(ids=[1], text="What is 37 * 43?", label="1591")], 1, sp)
        assert s.episode["end"] == "done" and s.reward == 1.0 and s.episode["tool_calls"] == 1
        start, end = s.episode["spans"][0][1], s.episode["spans"][1][0]
        assert qtok.decode(s.response_ids[start:end]) == ("\n<|im_start|>user\n<tool_response>\n1591\n"
                                                          "</tool_response>"
                                                          "<|im_end|>\n<|im_start|>assistant\n")
        turns[0] = turns[0].replace("37 * 43", "9**9**9")  # runs for minutes: killed at the timeout
        runner.tools.timeout = 1.0
        s, = runner.generate([Prompt(ids=[1], text="What is 37 * 43?", label="1591")], 1, sp)
        assert s.episode["end"] == "tool_timeout" and runner.faults["tool_timeout"] == 1
    finally:
        runner.close()


def test_config_refuses_env_flags_that_do_nothing():
    from nanorl.config import Config
    with pytest.raises(ValueError, match="env_max_turns only shape --env episodes"):
        Config.from_flags(env_max_turns=2)
    with pytest.raises(ValueError, match="--reward does nothing with --env"):
        Config.from_flags(env="calc", max_new_tokens=12, reward="math")
    with pytest.raises(ValueError, match="--env calc needs --max-new-tokens >= 12"):
        Config.from_flags(env="calc")
    assert Config.from_flags(env="calc", max_new_tokens=12, env_max_turns=3).episode_tokens == 36


def test_train_step_survives_a_faulty_user_environment(tmp_path):
    """train.py --env file.py:Class on the built-in model: episodes that raise or hang are counted,
    the steps and the evaluation run through, env metrics are logged."""
    import json

    import train
    from nanorl.task import make_default
    task = make_default(str(tmp_path / "task"))
    (tmp_path / "user_env.py").write_text(
        "import time\nfrom nanorl.env import Env, Step\n\ndef hang():\n    time.sleep(60)\n\n"
        "class UserEnv(Env):\n    def reset(self, prompt):\n        self.label = prompt.label\n"
        "        self.kind = int(prompt.text[0]) % 4\n\n    def step(self, action):\n"
        "        if self.kind == 0 and action.turn == 0:\n            raise ValueError('bad tool input')\n"
        "        if self.kind == 1 and action.turn == 0:\n            self.call(hang)\n"
        "        if action.turn == 0:\n            return Step([13, 13], 0.0, False, {'tool_calls': 1})\n"
        "        return Step(None, float(action.text == self.label), True, {})\n")
    res = train.main(["--env", f"{tmp_path / 'user_env.py'}:UserEnv", "--model", task["model"],
                      "--train-data",
                      task["train"], "--test-data", task["test"], "--eval-limit", "8", "--pass-k", "1",
                      "--steps", "2",
                      "--prompts-per-step", "8", "--samples-per-prompt", "2", "--tool-timeout", "0.3",
                      "--quiet",
                      "--threads", "1", "--out-dir", str(tmp_path / "run"), "--env-max-turns", "2"])
    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [x for x in lines if "rollout/env/turns_mean" in x]
    assert res["step"] == 2 and len(steps) == 2 and "eval/tool_use_rate" in lines[0]
    assert sum(x["rollout/env/end/env_error"] + x["rollout/env/end/tool_timeout"] for x in steps) > 0
    assert steps[-1].get("rollout/env_faults/env_error", 0) + steps[-1].get("rollout/env_faults/tool_timeout",
                                                                            0) > 0
