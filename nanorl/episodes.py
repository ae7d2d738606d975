"""The multi-turn rollout driver: plays a batch of episodes (--env) over any rollout engine.

Link 1 of the chain (rollout) as episodes. Start at `EpisodeRunner`: it drives a batch of episodes over
a rollout engine (HF or vLLM: only `engine.generate` is called), alternating the model's turns with
the environment's (nanorl/env.py `Env`), and returns one `Sample` per episode, so advantages, losses,
batching and checkpoints never learn that an environment was involved. Key choices: token-in/token-out
(turn k+1's prompt is turn k's prompt + the sampled ids + the environment's tokens, never a
re-encoding; the environment's text is framed as a chat turn by `ChatTurns`); the environment's tokens
sit in the response with loss mask 0; the caps (tokens, turns) end an episode "truncated", a raising
environment "env_error", both counted (`EpisodeRunner.faults`). The Sample of an episode and its end
reasons: `EpisodeRunner`'s docstring. --partial-rollout abort: `generate(..., until)` aborts the episodes
still going once a batch has its groups, `resume` plays them on from their last turn (the environment
rebuilt by replaying the recorded turns: it is never pickled).

Test: python -m pytest tests/test_env.py -q
"""
from __future__ import annotations

import numbers
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from nanorl.env import ENDS, Action, Env, ToolRunner, ToolTimeout
from nanorl.trajectory import Sample

# ----------------------------------------------------------------------------- environment tokens
# private-use placeholders: never in real text
U, A, M = "\ue010", "\ue011", "\ue012"


class ChatTurns:
    """The ids of an environment message between two assistant turns, from the tokenizer's chat template.

    Rendering [user, assistant, <role> message] + the generation prompt with placeholder contents
    gives the text the template puts between an assistant content and the observation (the
    assistant's end-of-turn, the message's header: "<|im_end|>\\n<|im_start|>tool\\n") and after the
    observation up to the next assistant content. The model's turn already ends with the stop token
    it sampled, so the message is the first text minus that token's text + observation + the second,
    encoded once, alone. Only this one rendering is read, so a template that renders a last
    assistant turn differently from an earlier one (Qwen3's thinking block) is framed as an earlier one.
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer, self.kwargs, self._frames = tokenizer, dict(template_kwargs or {}), {}

    def frame(self, role: str) -> tuple[str, str]:
        """(between an assistant content and the observation, after the observation) for `role`."""
        if role not in self._frames:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("ChatTurns: the tokenizer has no chat template; the environment must return "
                                 "its observations as token ids")
            full = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": U}, {"role": "assistant", "content": A},
                 {"role": role, "content": M}],
                tokenize=False, add_generation_prompt=True, **self.kwargs)
            if full.count(A) != 1 or full.count(M) != 1 or full.index(A) > full.index(M):
                raise ValueError("ChatTurns: the chat template does not render an assistant turn followed "
                                 f"by a {role!r} message: no token-in/token-out frame for it")
            self._frames[role] = tuple(full[full.index(A) + 1:].split(M))
        return self._frames[role]

    def encode(self, observation: str, role: str, stop_id: int | None) -> list[int]:
        between, post = self.frame(role)
        stop = self.tokenizer.convert_ids_to_tokens(stop_id) if stop_id is not None else None
        # the model wrote its stop
        lead = between[len(stop):] if stop and between.startswith(stop) else between
        return list(self.tokenizer(lead + observation + post, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- the driver
@dataclass
class _Episode:
    env: Env
    prompt_ids: list[int]
    group: int
    # response: model and environment tokens
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    # per token: a [K] row of kept ids, or None (unrestricted)
    support: list = field(default_factory=list)
    # (start, end) of each model turn in ids
    spans: list = field(default_factory=list)
    # one per model turn
    rewards: list = field(default_factory=list)
    tool_calls: int = 0
    end: str | None = None
    version: int | None = None
    experts: torch.Tensor | None = None
    # the version that recorded `experts` (the last turn's)
    routing_version: int | None = None
    # the last model turn was cut by an abort (--partial-rollout abort): a resume continues it
    cut: bool = False


@dataclass
class _Until:
    """`EpisodeRunner.generate`'s `until` over a batch of episodes (n per group, consecutive): asked as
    groups finish, between rounds and inside a model turn between decode steps; once it has said so,
    it stays so (every episode still going is aborted)."""
    fn: Callable[[list[Sample]], bool]
    eps: list[_Episode]
    n: int
    sample: Callable[[_Episode], Sample]
    # episode index → the Sample `fn` was handed (the result holds those very Samples)
    built: dict[int, Sample] = field(default_factory=dict)
    said: bool = False

    def __call__(self) -> bool:
        """`fn` on the groups that have all ended since its last call."""
        if self.said:
            return True
        new = []
        for start in range(0, len(self.eps), self.n):
            idx = range(start, start + self.n)
            if start not in self.built and all(self.eps[i].end is not None for i in idx):
                for i in idx:
                    self.built[i] = self.sample(self.eps[i])
                new += [self.built[i] for i in idx]
        self.said = bool(new) and self.fn(new)
        return self.said


class EpisodeRunner:
    """Multi-turn episodes over `engine`, one environment per episode (`make_env()`), TITO throughout.

    max_turns: model turns per episode; max_tokens: response tokens per episode (model + environment);
    tool_timeout: seconds per tool call (0 in-process; None = the factory's `tool_timeout`);
    render(text) → prompt ids for a string that `reset` returns (train.py passes the run's prompt
    format); template_kwargs: chat-template options (ChatTurns); log: where the first traceback of
    an environment fault goes. `generate(prompts, n, sampling)` takes nanorl.data Prompts (the
    environment needs the row, not only its ids) and returns scored Samples.

    Token-in/token-out (TITO). Turn k+1's prompt is turn k's prompt + the ids the engine sampled + the
    environment's tokens, never a re-encoding of the decoded conversation: re-tokenising text changes ids
    (merged BPE pieces, a newline dropped at a turn boundary), and the trainer would then recompute
    log-probabilities of tokens the policy never sampled. An environment message is framed by the chat
    template's own turn delimiters and encoded ONCE, alone (`ChatTurns`); the frame is read off the template
    by rendering placeholder messages, so any ChatML-like template works unchanged.

    The Sample of an episode: prompt_ids = the first prompt; response_ids = turn 1 + env 1 + turn 2 + ... (it
    always ends with a model turn); loss_mask 1 on model tokens, 0 on environment tokens (context the policy
    sees but never produced); rollout_logprobs the engine's for model tokens, 0 (unused) for environment
    tokens. Sample.episode: the end reason, the model turns' spans, per-turn rewards, the number of tool
    calls, whether an abort cut the last turn ("cut"). Rewards: every `step` returns one; the episode's
    reward is their sum (floats, or dicts summed per component). When an environment rewards turns before
    the last, `turn_reward_tensor` places each on its turn's last token, for the estimators that read token
    rewards (GAE, REINFORCE++, ReMax); outcome estimators read the sum (nanorl/advantage.py). GRPO groups
    are the n episodes started from the same prompt (group_id = prompt index).

    How an episode ends (Sample.episode["end"], logged per step as env/end/<reason>):
      done         the environment said so                                  status completed
      truncated    a turn ran out of max_new_tokens without a stop token    status truncated
      token_cap    the episode's response reached max_tokens                status truncated
      turn_cap     max_turns model turns and the environment not done       status truncated
      env_error    reset/step raised (the first traceback is logged)        status env_error, counted
      tool_timeout a tool call passed its time limit (its process killed)   status tool_timeout, counted
      aborted      --partial-rollout abort (`until`), between turns or inside  status aborted
                   one (episode["cut"]); the next batch resumes it (`resume`)
    None of them raises. The last three do not train: the step drops them after scoring and counts
    them (nanorl/stages.py, trajectory.TRAINS).
    """

    def __init__(self, engine, make_env, tokenizer, *, max_turns: int = 4, max_tokens: int = 256,
                 tool_timeout: float | None = None, render=None, template_kwargs: dict | None = None,
                 log=print):
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"EpisodeRunner: max_turns and max_tokens must be >= 1, got {max_turns}, "
                             f"{max_tokens}")
        self.engine, self.make_env, self.tokenizer = engine, make_env, tokenizer
        self.render, self.log = render, log
        self.max_turns, self.max_tokens = max_turns, max_tokens
        if tool_timeout is None:
            tool_timeout = getattr(make_env, "tool_timeout", Env.tool_timeout)
        self.tools, self.turns = ToolRunner(tool_timeout), ChatTurns(tokenizer, template_kwargs)
        # env_error / tool_timeout over the whole run
        self.faults = Counter()
        self._logged = False

    def generate(self, prompts, n: int, sampling, until=None) -> list[Sample]:
        """n episodes per prompt, consecutive, group_id = the prompt's index; each Sample scored.

        until (--partial-rollout abort, nanorl/partial_rollout.py): called after every round of turns
        (the model's, then the environment's) with the n Samples of each group whose episodes have all
        ended since the last call (the result holds those very Samples). True aborts every episode still
        going, at that turn boundary: it comes back with status "aborted" and every turn it had, the
        environment's last answer included, for `resume` to play its next turn."""
        eps = [self._start(p, g) for g, p in enumerate(prompts) for _ in range(n)]
        return self._play(eps, sampling, n, until)

    def resume(self, prompts, samples: list[Sample], sampling) -> list[Sample]:
        """Aborted episodes (`generate`'s, each with its prompt) played on from their next turn under the
        engine's current weights, to their end; each Sample keeps its recorded tokens, logprobs, mask and
        turns, and the group id it had. The environment object is not carried: a fresh one is replayed
        through `reset` and the recorded model turns' `step`s (`_replayed`), so a buffer of aborted
        episodes is plain data (a checkpoint holds it); an environment whose replay does not give back the
        recorded tokens ends its episode env_error (counted)."""
        eps = [self._replayed(p, s) for p, s in zip(prompts, samples)]
        return self._play(eps, sampling, 1, None)

    def _play(self, eps: list[_Episode], sampling, n: int, until) -> list[Sample]:
        """Rounds of turns until every episode has ended; each live episode plays its own next turn
        (resumed ones may be at different turns). With `until`: `generate`'s abort."""
        stop = None if until is None else _Until(until, eps, n, self._sample)
        while any(e.end is None for e in eps):
            live = [e for e in eps if e.end is None]
            stepped = self._model_turn(live, sampling, stop)
            for e in live:
                if e.end is None and id(e) not in stepped:
                    self._env_turn(e, len(e.spans) - 1)
            if stop is not None and stop():
                for e in eps:
                    if e.end is None:
                        e.end = "aborted"
        built = {} if stop is None else stop.built
        samples = [built[i] if i in built else self._sample(e) for i, e in enumerate(eps)]
        names = list(dict.fromkeys(k for s in samples if isinstance(s.reward, dict) for k in s.reward))
        # one reward kind per batch (collate): a float becomes zeros
        for s in samples if names else []:
            s.reward = s.reward if isinstance(s.reward, dict) else dict.fromkeys(names, 0.0)
        return samples

    def close(self) -> None:
        self.tools.close()

    # -- one episode's pieces
    def _start(self, prompt, group: int) -> _Episode:
        env = self.make_env()
        env.tools = self.tools
        e = _Episode(env, list(prompt.ids), group)
        try:
            e.prompt_ids = self._reset_ids(env, prompt)
        # environment code: a fault ends this episode, never the step
        except Exception as err:
            self._fault(e, err)
        return e

    def _replayed(self, prompt, s: Sample) -> _Episode:
        """The aborted episode `s` at its next turn: its recorded ids, logprobs, mask and turns, and a fresh
        environment brought to the same point by `reset` and a `step` per recorded model turn, each
        checked to answer with the recorded environment tokens."""
        if s.status != "aborted" or s.episode is None or s.episode["end"] != "aborted":
            raise ValueError(f"EpisodeRunner.resume: an aborted episode is needed, got status {s.status!r}")
        R, info = s.response_length, s.episode
        rows = [None] * R if s.sampling_support is None else \
            [None if bool((row < 0).all()) else row[row >= 0] for row in s.sampling_support]
        e = _Episode(self.make_env(), list(s.prompt_ids), s.group_id, ids=list(s.response_ids),
                     logps=list(s.rollout_logprobs), mask=list(s.loss_mask or [1] * R), support=rows,
                     spans=[tuple(x) for x in info["spans"]],
                     # a step's reward per finished turn (a cut turn's 0 is `_sample`'s padding)
                     rewards=list(info["turn_rewards"][:len(info["spans"]) - info["cut"]]),
                     tool_calls=info["tool_calls"], version=s.weight_version, experts=s.routed_experts,
                     routing_version=s.routing_version,
                     cut=info["cut"])
        e.env.tools = self.tools
        try:
            if self._reset_ids(e.env, prompt) != e.prompt_ids:
                raise ReplayMismatch("reset", 0)
            # the environment's tokens after each finished model turn: from its span's end to the next span
            nexts = [start for start, _ in e.spans[1:]] + [R]
            for turn, ((start, end), nxt) in enumerate(zip(e.spans[:len(e.spans) - e.cut], nexts)):
                # the recorded rewards, tool calls and masks stand: only the answer is compared
                if self._stepped(e, start, end, turn)[0] != e.ids[end:nxt]:
                    raise ReplayMismatch("step", turn)
        # environment code: a fault ends this episode, never the step
        except Exception as err:
            self._fault(e, err)
        return e

    def _model_turn(self, live: list[_Episode], sampling, stop: _Until | None) -> set[int]:
        """Each episode's next model turn (or the rest of a turn an abort cut): one engine call per
        distinct (turn, token budget) (the caps shorten the last turns' budgets; resumed episodes may be
        at different turns). With `stop` the engine reports each turn as it stops: its environment turn
        runs at once, and `stop` may abort the turns still running (and the calls not made yet). Returns
        the ids of the episodes whose environment turn ran here."""
        budgets: dict[tuple[int, int], list[_Episode]] = {}
        full: dict[int, int] = {}  # id(episode) → its turn's whole budget (a cut turn's included)
        # vLLM refuses a request that cannot fit
        context = self.engine.max_model_len
        for e in live:
            # where the turn began: a cut one where it was cut from
            begin = e.spans[-1][0] if e.cut else len(e.ids)
            whole = min(sampling.max_new_tokens, self.max_tokens - begin)
            if context is not None:
                whole = min(whole, context - len(e.prompt_ids) - begin)
            budget = whole - (len(e.ids) - begin)
            if budget < 1:
                # a turn cut at its last token ends as if it had run out (slime's); else no room at all
                e.end = "truncated" if e.cut and whole == sampling.max_new_tokens else "token_cap"
                e.cut = False
                continue
            full[id(e)] = whole
            budgets.setdefault((len(e.spans) - e.cut, budget), []).append(e)
        stepped: set[int] = set()
        for (turn, budget), group in budgets.items():
            if stop is not None and stop.said:  # aborted in an earlier call: at the turn boundary
                for e in group:
                    e.end = "aborted"
                continue
            # a fresh draw per turn
            seed = None if sampling.seed is None else sampling.seed + 7919 * turn + budget
            sp = replace(sampling, max_new_tokens=budget, seed=seed)
            prompts = [e.prompt_ids + e.ids for e in group]
            took: set[int] = set()  # rows the engine reported as they stopped
            if stop is None:
                out = self.engine.generate(prompts, 1, sp)
            else:
                def stopped(rows: list[Sample], group=group, took=took, turn=turn) -> bool:
                    for s in rows:  # n = 1: a row's group id is its index in the call
                        e = group[s.group_id]
                        took.add(s.group_id)
                        self._took(e, s, full[id(e)], sampling)
                        if e.end is None:
                            self._env_turn(e, turn)
                            stepped.add(id(e))
                    return stop()
                out = self.engine.generate(prompts, 1, sp, until=stopped)
            if len(out) != len(group):
                raise RuntimeError(f"engine returned {len(out)} samples for {len(group)} prompts")
            for i, (e, s) in enumerate(zip(group, out)):
                if i not in took:
                    self._took(e, s, full[id(e)], sampling)
        return stepped

    def _took(self, e: _Episode, s: Sample, whole: int, sampling) -> None:
        """A model turn's Sample into its episode (the rest of a cut turn joins it); `whole`: the turn's
        budget."""
        if s.rollout_logprobs is None:
            raise ValueError("EpisodeRunner needs rollout logprobs from the engine")
        r, was_cut = s.response_length, e.cut
        if was_cut:
            start, _ = e.spans.pop()
            e.spans.append((start, len(e.ids) + r))
        # an abort before the turn's first token leaves no turn: a resume starts it
        elif r or s.status != "aborted":
            e.spans.append((len(e.ids), len(e.ids) + r))
        e.ids += s.response_ids
        e.logps += list(s.rollout_logprobs)
        e.mask += list(s.loss_mask) if s.loss_mask is not None else [1] * r
        rows = s.sampling_support
        e.support += [None] * r if rows is None else [row for row in rows]
        e.version = s.weight_version if e.version is None else min(e.version, s.weight_version)
        if s.routed_experts is not None:
            e.experts, e.routing_version = s.routed_experts, s.routing_version
        e.cut = False
        # no stop token: cut by a cap or by max_new_tokens
        if s.status == "truncated":
            e.end = "token_cap" if whole < sampling.max_new_tokens else "truncated"
        elif s.status == "aborted":
            e.end, e.cut = "aborted", was_cut or r > 0

    def _reset_ids(self, env: Env, prompt) -> list[int]:
        """The episode's first prompt: `reset`'s text rendered, its ids, or (None) the prompt's own."""
        first = env.reset(prompt)
        if isinstance(first, str):
            if self.render is None:
                raise ValueError("reset returned text, but the runner has no render function")
            return list(self.render(first))
        return list(prompt.ids) if first is None else _ids(first, "reset")

    def _stepped(self, e: _Episode, start: int, end: int, turn: int) -> tuple:
        """The environment's step on the model turn e.ids[start:end]: (its answer's ids, None when done,
        reward, done, info)."""
        action = Action(ids=e.ids[start:end],
                        text=self.tokenizer.decode(e.ids[start:end], skip_special_tokens=True),
                        turn=turn)
        obs, reward, done, info = _checked_step(e.env.step(action))
        ids = None if done else (_ids(obs, "step") if isinstance(obs, list) else
                                 self.turns.encode(obs, e.env.role, e.ids[end - 1] if end else None))
        return ids, reward, done, info

    def _env_turn(self, e: _Episode, turn: int) -> None:
        start, end = e.spans[-1]
        try:
            ids, reward, done, info = self._stepped(e, start, end, turn)
        # a tool that raised, a ToolTimeout, an environment bug
        except Exception as err:
            return self._fault(e, err)
        e.rewards.append(reward)
        e.tool_calls += int(info.get("tool_calls", 0))
        if info.get("mask_turn"):  # the environment keeps this model turn out of the loss
            e.mask[start:end] = [0] * (end - start)
        if done:
            e.end = "done"
        elif turn + 1 == self.max_turns:
            e.end = "turn_cap"
        # no room left for a model token after it
        elif len(e.ids) + len(ids) + 1 > self.max_tokens:
            e.end = "token_cap"
        # the environment's tokens: seen by the policy, never trained on
        else:
            e.ids += ids
            e.logps += [0.0] * len(ids)
            e.mask += [0] * len(ids)
            e.support += [None] * len(ids)

    def _fault(self, e: _Episode, err: Exception) -> None:
        e.end = "tool_timeout" if isinstance(err, ToolTimeout) else "env_error"
        self.faults[e.end] += 1
        # the first traceback tells the user what is wrong; then just count
        if not self._logged:
            self._logged = True
            self.log(f"environment fault ({e.end}: {type(err).__name__}); the episode ends there, later "
                     "faults are counted in env_faults/. First "
                     f"error:\n{''.join(traceback.format_exception(err))}")

    def _sample(self, e: _Episode) -> Sample:
        # a turn without a step earned 0
        rewards = e.rewards + [0.0] * (len(e.spans) - len(e.rewards))
        total = 0.0
        for r in rewards:
            total = _add(total, r)
        s = Sample(prompt_ids=e.prompt_ids, response_ids=e.ids, rollout_logprobs=e.logps, loss_mask=e.mask,
                   reward=total, status=ENDS[e.end or "turn_cap"], weight_version=e.version or 0,
                   group_id=e.group, routed_experts=e.experts, routing_version=e.routing_version,
                   sampling_support=_support(e.support),
                   episode={"end": e.end or "turn_cap", "turns": len(e.spans), "spans": e.spans,
                            "turn_rewards": rewards, "tool_calls": e.tool_calls, "cut": e.cut})
        return s


class ReplayMismatch(RuntimeError):
    """A resumed episode's fresh environment did not answer its recorded turns as the first one did (a
    stateful or random environment): the episode cannot go on from its recorded tokens."""

    def __init__(self, where: str, turn: int):
        super().__init__(f"replaying an aborted episode: the environment's {where} of turn {turn} did not "
                         "give back the recorded tokens; --partial-rollout abort with --env needs an "
                         "environment that answers the same turns the same way (nanorl/episodes.py resume)")


def _ids(x, where: str) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
                                          for i in x):
        raise TypeError(f"{where} must return a string, a list of token ids or None, got {str(x)[:80]!r}")
    return [int(i) for i in x]


def _checked_step(out) -> tuple:
    if not isinstance(out, tuple) or len(out) != 4:
        raise TypeError(f"Env.step must return (observation, reward, done, info), got {str(out)[:80]!r}")
    obs, reward, done, info = out
    if not isinstance(done, bool) or not isinstance(info, dict):
        raise TypeError(f"Env.step: done must be a bool and info a dict, got {done!r}, {type(info).__name__}")
    if not done and not isinstance(obs, (str, list)):
        raise TypeError(f"Env.step: an episode that goes on needs an observation (text or ids), got {obs!r}")
    # type check
    _add(0.0, reward)
    return obs, reward, done, info


def _add(a, b):
    """Sum two rewards, each a number or a dict of numbers (summed per component)."""
    for x in (a, b):
        vals = x.values() if isinstance(x, dict) else [x]
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in vals):
            raise TypeError(f"a reward must be a number or a dict of numbers, got {x!r}")
    if not isinstance(a, dict) and not isinstance(b, dict):
        return float(a) + float(b)
    # 0: a turn that earned nothing
    if any(not isinstance(x, dict) and x != 0 for x in (a, b)):
        raise TypeError(f"an episode's rewards mix numbers and dicts: {a!r}, {b!r}; use one kind")
    a, b = (x if isinstance(x, dict) else {} for x in (a, b))
    return {k: float(a.get(k, 0.0)) + float(b.get(k, 0.0)) for k in dict.fromkeys([*a, *b])}


def _support(rows: list) -> torch.Tensor | None:
    """Per-token kept-id rows (None = unrestricted) → [R, K] int32, −1 padded; None if no turn had any."""
    if not rows or all(r is None for r in rows):
        return None
    K = max(int(r.shape[0]) for r in rows if r is not None)
    out = torch.full((len(rows), K), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        if r is not None:
            out[t, :r.shape[0]] = r.to(torch.int32)
    return out
