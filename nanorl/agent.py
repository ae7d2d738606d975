"""--agent: train any agent. The policy answers behind an OpenAI-compatible endpoint during rollouts,
and every token it samples there is recorded.

Link 1 (rollout) and link 2 (reward) as a user's program: `AgentRunner.rollout` serves the run's rollout
engine (only `engine.generate` is called) on 127.0.0.1 and runs the user's function once per episode, in
threads; the function talks to the model as to any OpenAI server and returns the episode's reward. Start
at `AgentRunner` (the episode → Sample rule), then `_Server` (the requests) and `_dispatch` (batching).
Key choices: the standard library's ThreadingHTTPServer, because no HTTP server library is a dependency
(requests are few and short next to a forward; a thread per connection is enough); sampling settings
are the run's, never the request's (the logprobs must be the trainer's distribution), a request's
smaller max_tokens aside; token-in/token-out (TITO): the server keeps the ids it sampled per episode and
re-uses them when the agent sends the same text back, so nothing the policy wrote is ever re-tokenised;
a failed episode (it raised, ran past `timeout`, sent a malformed request) is counted, never trains.
Test: python -m pytest tests/test_agent.py -q
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import re
import secrets
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from nanorl.episodes import _add, _support
from nanorl.trajectory import Sample

# seconds an episode may run (a function attribute `timeout` overrides it)
TIMEOUT = 600.0
# the dispatcher waits this long for more requests while some running episodes have none pending
GATHER_S = 0.02
# a private-use placeholder: never in real text
A = "\ue011"
ROUTE = re.compile(r"^(?:/e/([\w.-]+))?/v1/(models|chat/completions|completions)/?$")


def loopback(host: str) -> bool:
    """Whether a client address is this machine (127.0.0.0/8, ::1, ::ffff:127.x)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def authorized(header: str | None, token: str) -> bool:
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


class BadRequest(ValueError):
    """A request the server cannot serve: answered 400, and its episode fails."""


@dataclass
class _Call:
    ids: list[int]
    budget: int
    done: threading.Event = field(default_factory=threading.Event)
    sample: Sample | None = None
    error: str | None = None


@dataclass
class _Episode:
    id: str
    prompt: object
    group: int
    # the engine's weight version when the episode started: a failed episode's Sample carries it (the
    # async trainer checks every sample's version against its staleness bound)
    version: int
    # (prompt ids, Sample) per model call, in order
    calls: list = field(default_factory=list)
    # what the last call was, for TITO: (kind, messages or prompt text, prompt ids, sampled ids, text)
    last: tuple | None = None
    end: str | None = None
    reward: object = 0.0


class AgentRunner:
    """Episodes of a user's agent function over `engine`: `fn(base_url=, api_key=, episode_id=, row=)` →
    reward (a number or a dict of named components); row = {"prompt": the user's text, "label", "ids"}.

    The Sample of an episode (`_samples`). Its calls' token ids chain when call k+1's prompt ids start with
    call k's prompt + sampled ids (TITO makes them: the server re-uses its ids); then ONE Sample: prompt =
    call 1's prompt, response = sampled 1 + the in-between ids + sampled 2 + ..., loss_mask 1 on sampled
    ids, 0 on the in-between ones (tool results, user turns: the environment's). An agent that rewrote
    history (edited a reply, dropped a turn) breaks the chain: one Sample per call, each with the episode's
    reward, all in the prompt's group (Sample.episode["split"]). Status: the last call's (truncated when it
    ran out of tokens); a failed episode: one empty Sample, env_error (it raised, a malformed request, no
    model call) or tool_timeout (past `timeout`), counted in `faults`, dropped by the step.
    `generate` (evaluation) keeps one Sample per episode: the last call of a split one."""

    def __init__(self, engine, fn, tokenizer, *, template_kwargs: dict | None = None, timeout=None,
                 log=print):
        self.engine, self.fn, self.tokenizer, self.log = engine, fn, tokenizer, log
        self.kwargs = dict(template_kwargs or {})
        self.timeout = float(timeout or getattr(fn, "timeout", TIMEOUT))
        self.token, self.faults, self._logged = secrets.token_urlsafe(24), Counter(), False
        self._cond, self._pending, self._live, self._running = threading.Condition(), [], {}, 0
        self._sampling, self._engine_calls, self._round, self._server, self._closed = None, 0, 0, None, False

    # -- rollouts
    def rollout(self, prompts, n: int, sampling) -> list[Sample]:
        """n episodes per prompt, run together; their Samples, group_id = the prompt's index."""
        self._serve()
        self._round += 1
        v = self.engine.version  # loaded before the rollout, unchanged through it
        eps = [_Episode(f"{self._round}-{g}-{i}", p, g, v) for g, p in enumerate(prompts) for i in range(n)]
        with self._cond:
            self._sampling, self._engine_calls = sampling, 0
            self._live, self._running = {e.id: e for e in eps}, len(eps)
        threads = [threading.Thread(target=self._episode, args=(e,), daemon=True) for e in eps]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            for e, t in zip(eps, threads):
                if t.is_alive():
                    e.end = "timeout"
            # a late request of this round is refused (404)
            self._live, self._running = {}, 0
        samples = [s for e in eps for s in self._samples(e)]
        names = list(dict.fromkeys(k for s in samples if isinstance(s.reward, dict) for k in s.reward))
        # one reward kind per batch (collate): a failed episode's 0 becomes zeros
        for s in samples if names else []:
            s.reward = s.reward if isinstance(s.reward, dict) else dict.fromkeys(names, 0.0)
        return samples

    def generate(self, prompts, n: int, sampling) -> list[Sample]:
        """One Sample per episode (evaluation reads n per prompt): a split episode's last call."""
        last = {}
        for s in self.rollout(prompts, n, sampling):
            last[s.episode["episode"]] = s
        return list(last.values())

    def url(self, episode_id: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/e/{episode_id}/v1"

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _episode(self, e: _Episode) -> None:
        row = {"prompt": e.prompt.text, "label": e.prompt.label, "ids": list(e.prompt.ids)}
        try:
            reward = self.fn(base_url=self.url(e.id), api_key=self.token, episode_id=e.id, row=row)
            # a number or a dict of numbers
            e.reward = _add(0.0, reward) if not isinstance(reward, dict) else _add({}, reward)
            e.end = e.end or "done"
        # user code: a fault ends this episode, never the step
        except Exception as err:
            e.end = e.end or "error"
            self._fault_log(e, "".join(traceback.format_exception(err)))
        finally:
            with self._cond:
                if e.id in self._live:
                    self._running -= 1
                self._cond.notify_all()

    def _fault_log(self, e: _Episode, text: str) -> None:
        # the first traceback tells the user what is wrong; then just count
        if not self._logged:
            self._logged = True
            self.log(f"agent episode {e.id} failed ({e.end}); later failures are counted in agent_faults/. "
                     f"First error:\n{text}")

    def _samples(self, e: _Episode) -> list[Sample]:
        meta = {"episode": e.id, "calls": len(e.calls), "end": e.end, "split": False}
        if e.end != "done" or not e.calls:
            end = e.end if e.end != "done" else "no_calls"
            self.faults[end] += 1
            status = "tool_timeout" if end == "timeout" else "env_error"
            return [Sample(prompt_ids=list(e.prompt.ids), response_ids=[], rollout_logprobs=[], reward=0.0,
                           status=status, weight_version=e.version, group_id=e.group,
                           episode=dict(meta, end=end))]
        chained = all(b[0][:len(a[0]) + a[1].response_length] == a[0] + a[1].response_ids
                      for a, b in zip(e.calls, e.calls[1:]))
        if not chained:
            meta["split"] = True
            return [replace(s, prompt_ids=p, reward=e.reward, group_id=e.group,
                            episode=dict(meta, call=k)) for k, (p, s) in enumerate(e.calls)]
        ids, logps, mask, support, spans, at = [], [], [], [], [], len(e.calls[0][0])
        for p, s in e.calls:
            # the in-between ids: a tool's answer, a user turn (seen, never trained on)
            between = p[at:]
            ids += between
            logps += [0.0] * len(between)
            mask += [0] * len(between)
            support += [None] * len(between)
            spans.append((len(ids), len(ids) + s.response_length))
            ids += s.response_ids
            logps += list(s.rollout_logprobs)
            mask += list(s.loss_mask) if s.loss_mask is not None else [1] * s.response_length
            support += [None] * s.response_length if s.sampling_support is None else list(s.sampling_support)
            at = len(p) + s.response_length
        last = e.calls[-1][1]
        return [Sample(prompt_ids=list(e.calls[0][0]), response_ids=ids, rollout_logprobs=logps,
                       loss_mask=mask, reward=e.reward, status=last.status,
                       weight_version=min(s.weight_version for _, s in e.calls), group_id=e.group,
                       sampling_support=_support(support), episode=dict(meta, spans=spans))]

    # -- the server's side
    def _serve(self) -> None:
        if self._server is None:
            self._closed = False
            self._server = _Server(("127.0.0.1", 0), _Handler)
            self._server.runner = self
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
            threading.Thread(target=self._dispatch, daemon=True).start()

    def complete(self, episode_id: str, kind: str, body: dict) -> dict:
        """One /v1/chat/completions (kind "chat") or /v1/completions ("text") request → its response."""
        with self._cond:
            e, sampling = self._live.get(episode_id), self._sampling
        if e is None:
            raise LookupError(f"episode {episode_id!r} is not running")
        try:
            ids, seen, budget = self._request(e, kind, body, sampling)
        except (BadRequest, KeyError, TypeError, ValueError) as err:
            e.end = "malformed"
            raise BadRequest(f"{type(err).__name__}: {err}") from None
        call = _Call(ids, budget)
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
        call.done.wait()
        if call.error is not None:
            raise RuntimeError(call.error)
        s = call.sample
        text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        e.calls.append((ids, s))
        e.last = (kind, seen, ids, list(s.response_ids), text)
        finish = "stop" if s.status == "completed" else "length"
        usage = {"prompt_tokens": len(ids), "completion_tokens": s.response_length,
                 "total_tokens": len(ids) + s.response_length}
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                   "logprobs": None} if kind == "chat" else
                  {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
        return {"id": f"nanorl-{episode_id}-{len(e.calls)}", "created": int(time.time()), "model": "policy",
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "choices": [choice], "usage": usage}

    def _request(self, e: _Episode, kind: str, body: dict, sampling) -> tuple[list[int], object, int]:
        """(prompt ids, what TITO compares next time, token budget) of one request."""
        if body.get("stream") or int(body.get("n") or 1) != 1:
            raise BadRequest("stream and n > 1 are not supported")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        budget = min(sampling.max_new_tokens, int(asked)) if asked else sampling.max_new_tokens
        ids, seen = self._chat_ids(e, body) if kind == "chat" else self._text_ids(e, body)
        if self.engine.max_model_len is not None:
            budget = min(budget, self.engine.max_model_len - len(ids))
        if budget < 1 or not ids:
            raise BadRequest(f"no room to sample: {len(ids)} prompt tokens, budget {budget}")
        return ids, seen, budget

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict], tools) -> str:
        kw = dict(self.kwargs, **({"tools": tools} if tools else {}))
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)

    def _chat_ids(self, e: _Episode, body: dict) -> tuple[list[int], list[dict]]:
        msgs, tools = [_message(m) for m in body["messages"]], body.get("tools")
        if not msgs:
            raise BadRequest("messages is empty")
        kind, seen, prompt, sampled, text = e.last or (None,) * 5
        k = len(seen or [])
        # TITO: the same conversation + the reply as it was sent + new messages: the ids, not a re-encoding
        if (kind == "chat" and len(msgs) > k and msgs[:k] == seen and msgs[k].get("role") == "assistant"
                and msgs[k].get("content") == text):
            full = self._render(msgs[:k] + [dict(msgs[k], content=A)] + msgs[k + 1:], tools)
            if full.count(A) == 1:
                # what the template writes after the reply: its end of turn, the new messages, the
                # next generation prompt; the end-of-turn token the model sampled is already there
                tail = full[full.index(A) + 1:]
                stop = self.tokenizer.convert_ids_to_tokens(sampled[-1]) if sampled else None
                if stop and sampled[-1] in self._sampling.stop_token_ids and tail.startswith(stop):
                    tail = tail[len(stop):]
                return prompt + sampled + self._encode(tail), msgs
        return self._encode(self._render(msgs, tools)), msgs

    def _text_ids(self, e: _Episode, body: dict) -> tuple[list[int], str | None]:
        p = body["prompt"]
        p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str) else p
        if isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
            return list(p), None
        if not isinstance(p, str):
            raise BadRequest("prompt must be a string or a list of token ids")
        kind, seen, prompt, sampled, text = e.last or (None,) * 5
        # TITO: the last prompt + the completion as it was sent, continued
        if kind == "text" and seen is not None and p.startswith(seen + text):
            return prompt + sampled + self._encode(p[len(seen + text):]), p
        return self._encode(p), p

    def _dispatch(self) -> None:
        """Batches the pending requests into engine.generate calls, one per token budget."""
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    for c in self._pending:
                        c.error = "the run is over"
                        c.done.set()
                    return
                # gather: until every running episode waits on a call, or a quiet GATHER_S
                while len(self._pending) < self._running:
                    before = len(self._pending)
                    self._cond.wait(GATHER_S)
                    if len(self._pending) == before:
                        break
                batch, self._pending = self._pending, []
                sampling = self._sampling
            groups: dict[int, list[_Call]] = {}
            for c in batch:
                groups.setdefault(c.budget, []).append(c)
            for budget, calls in groups.items():
                # a fresh stream per engine call (SamplingConfig.call)
                sp = replace(sampling.call(self._engine_calls), max_new_tokens=budget)
                self._engine_calls += 1
                try:
                    out = self.engine.generate([c.ids for c in calls], 1, sp)
                    if len(out) != len(calls) or any(s.rollout_logprobs is None for s in out):
                        raise RuntimeError("the engine must return one sample with logprobs per prompt")
                    for c, s in zip(calls, out):
                        c.sample = s
                # the engine failed: these calls fail (their episodes), the run goes on
                except Exception as err:
                    for c in calls:
                        c.error = f"engine: {type(err).__name__}: {err}"
                for c in calls:
                    c.done.set()


def _message(m) -> dict:
    """A request message, None fields dropped, a list of text parts joined into one string."""
    if not isinstance(m, dict) or "role" not in m:
        raise BadRequest(f"a message must be an object with a role, got {str(m)[:80]!r}")
    m = {k: v for k, v in m.items() if v is not None}
    if isinstance(m.get("content"), list):
        m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
    return m


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # every episode of a step connects at once (the default backlog, 5, refuses some)
    request_queue_size = 1024
    runner: AgentRunner


class _Handler(BaseHTTPRequestHandler):
    """Loopback only (403), the run's token only (401); /e/<episode>/v1/... routes to the episode."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        runner = self.server.runner
        size = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(size) if size else b""
        if not loopback(self.client_address[0]):
            return self._send(403, "only this machine may call the endpoint")
        if not authorized(self.headers.get("Authorization"), runner.token):
            return self._send(401, "missing or wrong api key (Authorization: Bearer <the run's token>)")
        route = ROUTE.match(self.path.split("?")[0])
        if route is None:
            return self._send(404, f"no route {self.path}")
        episode, what = route.groups()
        if what == "models":
            return self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model",
                                                                "created": 0, "owned_by": "nanorl"}]})
        if self.command != "POST" or episode is None:
            return self._send(404, "POST /e/<episode>/v1/" + what)
        try:
            request = json.loads(body or b"{}")
            if not isinstance(request, dict):
                raise BadRequest("the body must be a JSON object")
            self._send(200, runner.complete(episode, "chat" if what.startswith("chat") else "text", request))
        except LookupError as err:
            self._send(404, str(err))
        except (BadRequest, json.JSONDecodeError) as err:
            if (e := runner._live.get(episode)) is not None:
                e.end = "malformed"
            self._send(400, str(err))
        except RuntimeError as err:
            self._send(500, str(err))

    def _send(self, code: int, payload) -> None:
        if code != 200:
            payload = {"error": {"message": payload, "type": "invalid_request_error", "code": code}}
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
