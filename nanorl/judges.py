"""LLM judges, link 2 of the chain (reward): a generative model grades each response, its answer parsed
into a score in [0, 1] — the reward component `judge` (--judge, nanorl/rounds.py with_components).

A judge is a str.format template with {prompt}, {response} (required) and {label}, and a parse rule
(`make_parser`: "number:LO:HI" or "yesno"). It runs behind any OpenAI-compatible endpoint (`vllm serve`,
POST {url}/chat/completions, greedy: how a large judge runs on other machines) or in-process on
nanorl's engine interface (`Judge.local`). Start at `Judge.score`.
Key choices: a judge that cannot give a score gives None for that sample, never a silent 0 that
trains; each failed sample is counted in `faults` by kind and each kind logs ONE line per call, and
nothing raises but the caller's own configuration errors. The client is the standard library
(urllib.request + a thread pool, retries with backoff on 5xx, 429 and connection errors): one small
JSON POST needs no `openai`/`requests`, and every retry and fault rule is here to read (`_Endpoint`).
"""
from __future__ import annotations

import http.client
import json
import math
import os
import re
import socket
import string
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

FIELDS = ("prompt", "response", "label")
PARSE_RULES = ("number:LO:HI", "yesno")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FIRST_WORD = re.compile(r"[\W_]*([A-Za-z]+)")


def read_template(spec: str) -> str:
    """--judge's value: a template itself when it contains "{", else the path of a file holding one."""
    if "{" in spec:
        return spec
    if not os.path.isfile(spec):
        raise ValueError(f"judge template {spec!r}: neither a template (no {{response}} field) nor a file")
    with open(spec, encoding="utf-8") as f:
        return f.read()


def check_template(template: str) -> set[str]:
    """The fields `template` uses; raises naming any field other than {prompt}, {response}, {label}."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"judge template is not a valid str.format template ({e}): {template!r}") from e
    # "{prompt.x}" or "{prompt[0]}" would index into a str: only bare names are fields
    used = {name for _, name, _, _ in parsed if name is not None}
    unknown = sorted(used - set(FIELDS))
    if unknown:
        raise ValueError(f"judge template: unknown field(s) {', '.join(repr(u) for u in unknown)}; "
                         f"the fields are {{prompt}}, {{response}}, {{label}} (write {{{{ and }}}} for "
                         "literal braces)")
    if "response" not in used:
        raise ValueError("judge template has no {response} field: the judge would never see the response")
    return used


def make_parser(rule: str):
    """The parse rule `rule` as a function answer -> score in [0, 1], or None when unparsable:

    "number:LO:HI"  the first number in the answer (an optional minus sign, optional decimals: "7",
                    "Score: 7/10" → 7, "-1.5"), mapped to (x - LO) / (HI - LO); a number outside
                    [LO, HI] is unparsable, not clipped (a judge answering 12 on a 0-10 scale has not
                    answered the question asked)
    "yesno"         the first word (leading punctuation skipped, case ignored): yes → 1, no → 0"""
    if rule == "yesno":
        def yesno(answer: str) -> float | None:
            m = _FIRST_WORD.match(answer)
            word = m.group(1).lower() if m else ""
            return {"yes": 1.0, "no": 0.0}.get(word)
        return yesno
    parts = rule.split(":")
    if parts[0] == "number" and len(parts) == 3:
        try:
            lo, hi = float(parts[1]), float(parts[2])
        except ValueError:
            lo = hi = math.nan
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"judge parse rule {rule!r}: number:LO:HI needs finite numbers with LO < HI")

        def number(answer: str) -> float | None:
            m = _NUMBER.search(answer)
            x = float(m.group()) if m else math.nan
            return (x - lo) / (hi - lo) if lo <= x <= hi else None
        return number
    raise ValueError(f"judge parse rule {rule!r}: expected one of {', '.join(PARSE_RULES)}")


class _Fault(Exception):
    """A judge call that gave no answer: `kind` is counted, `detail` is logged."""

    def __init__(self, kind: str, detail: str, retry: bool = False):
        super().__init__(detail)
        self.kind, self.detail, self.retry = kind, detail, retry


class _Endpoint:
    """An OpenAI-compatible chat-completions endpoint, called from a pool of `concurrency` threads.
    Faults by kind: "unreachable", "timeout", "http_<code>", "bad_response" (and, in-process,
    "aborted", "engine_error"; any backend: "unparsable"). Each request opens its own connection (no
    keep-alive): fine for a grader whose answer takes far longer than a TCP connect."""

    def __init__(self, url, model, concurrency, timeout_s, retries, backoff_s, max_tokens):
        if concurrency < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0 or max_tokens < 1:
            raise ValueError("Judge: needs concurrency >= 1, retries >= 0, timeout_s > 0, backoff_s >= 0, "
                             f"max_tokens >= 1 (got {concurrency}, {retries}, {timeout_s}, {backoff_s}, "
                             f"{max_tokens})")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Judge: url {url!r} must start with http:// or https:// "
                             "(e.g. http://host:8000/v1)")
        if not model:
            raise ValueError("Judge: no model name: the endpoint serves models by name (`vllm serve NAME`)")
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.timeout_s, self.retries = model, timeout_s, retries
        self.backoff_s, self.max_tokens = backoff_s, max_tokens
        self.name = self.url
        # own opener: proxies from the environment as it is now (urlopen's global one is built once)
        self._opener = urllib.request.build_opener()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="judge")

    def ask(self, texts: list[str]) -> list[str | _Fault]:
        return list(self._pool.map(self._ask_one, texts))

    def _ask_one(self, text: str) -> str | _Fault:
        """Up to 1 + retries attempts, sleeping backoff_s · 2^k before retry k+1 (k = 0, 1, ...)."""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post(text)
            except _Fault as fault:
                if not fault.retry or attempt == self.retries:
                    return fault

    def _post(self, text: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": self.max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            # timeout: for the connect and for each read of the socket
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            # HTTPError first: it is a URLError too. A 4xx other than 429 will fail the same way again.
            detail = e.read(300).decode(errors="replace").strip() or e.reason
            raise _Fault(f"http_{e.code}", f"HTTP {e.code}: {detail}",
                         retry=e.code == 429 or e.code >= 500) from None
        except (TimeoutError, socket.timeout) as e:
            raise _Fault("timeout", f"no answer within {self.timeout_s}s ({e})", retry=True) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise _Fault("timeout", f"no answer within {self.timeout_s}s ({e.reason})",
                             retry=True) from None
            raise _Fault("unreachable", f"{e.reason}", retry=True) from None
        # reset, refused, closed without an answer (http.client.RemoteDisconnected), ...
        except OSError as e:
            raise _Fault("unreachable", f"{type(e).__name__}: {e}", retry=True) from None
        # a broken HTTP exchange (e.g. the body cut short): likely transient
        except http.client.HTTPException as e:
            raise _Fault("bad_response", f"{type(e).__name__}: {e}", retry=True) from None
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise _Fault("bad_response", f"not a chat completion ({type(e).__name__}: {e}): "
                         f"{raw[:200]!r}") from None
        # null content: e.g. a reasoning model that spent every token thinking
        return content if isinstance(content, str) else ""

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


class _InProcess:
    """A model in this process behind nanorl's engine interface, greedy."""

    def __init__(self, engine, tokenizer, max_tokens, stop_token_ids, chat_template):
        if max_tokens < 1:
            raise ValueError(f"Judge.local: max_tokens must be >= 1, got {max_tokens}")
        self.engine, self.tokenizer, self.max_tokens = engine, tokenizer, max_tokens
        self.stop = tuple(stop_token_ids if stop_token_ids is not None else
                          [i for i in [tokenizer.eos_token_id] if i is not None])
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.name = f"in-process {type(engine).__name__}"

    def _ids(self, text: str) -> list[int]:
        # as a chat server renders a user message; a tokenizer without a chat template gets the text
        if self.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True)
            # a BatchEncoding in transformers 5
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer(text)["input_ids"])

    def ask(self, texts: list[str]) -> list[str | _Fault]:
        from nanorl.rollout import SamplingConfig

        ids = [self._ids(t) for t in texts]
        empty = [i for i, x in enumerate(ids) if not x]
        if empty:
            raise ValueError(f"Judge.local: judge prompt {empty[0]} tokenizes to no tokens")
        # temperature 0 is greedy (nanorl/rollout.py SamplingConfig)
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=self.max_tokens, stop_token_ids=self.stop)
        try:
            samples = self.engine.generate(ids, 1, sampling)
        # the judge's engine failing must not take the run down: every sample of the batch is a fault
        except Exception as e:
            return [_Fault("engine_error", f"{type(e).__name__}: {e}")] * len(texts)
        if len(samples) != len(texts):
            return [_Fault("engine_error", f"engine returned {len(samples)} samples for {len(texts)} "
                           "prompts")] * len(texts)
        return [_Fault("aborted", "the engine aborted this request") if s.status == "aborted" else
                self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]

    def close(self):
        pass


class Judge:
    """Scores responses with an LLM judge; see the module docstring for the template and parse rules.

    `Judge(template, url, model, ...)` calls an OpenAI-compatible endpoint at `url` (e.g.
    "http://host:8000/v1") with `concurrency` requests in flight; a request is retried `retries` times,
    after backoff_s, 2·backoff_s, ..., on a connection error, a timeout (`timeout_s` per connect / read),
    HTTP 5xx or 429; any other 4xx is not retried. So one request takes at most about
    (retries + 1) · timeout_s + backoff_s · (2^retries - 1) seconds. `Judge.local(...)` runs in-process.
    """

    def __init__(self, template: str, url: str, model: str, parse: str = "number:0:10",
                 concurrency: int = 8, timeout_s: float = 60, retries: int = 2, backoff_s: float = 0.5,
                 max_tokens: int = 16, log=print):
        self._setup(template, parse, log)
        self._backend = _Endpoint(url, model, concurrency, timeout_s, retries, backoff_s, max_tokens)

    @classmethod
    def local(cls, engine, tokenizer, template: str, parse: str = "number:0:10", max_tokens: int = 16,
              stop_token_ids=None, chat_template: bool = True, log=print) -> Judge:
        """A judge on `engine` (nanorl's engine interface: `generate(prompt_ids, n, SamplingConfig)`),
        prompts made with `tokenizer` (its chat template when it has one and `chat_template`), greedy,
        stopping at `stop_token_ids` (default: the tokenizer's EOS). Same template, parse and fault
        rules; an exception from the engine is an "engine_error" fault of the whole batch."""
        self = cls.__new__(cls)
        self._setup(template, parse, log)
        self._backend = _InProcess(engine, tokenizer, max_tokens, stop_token_ids, chat_template)
        return self

    def _setup(self, template: str, parse: str, log):
        self.template, self.parse, self.log = template, parse, log
        self._fields = check_template(template)
        self._parser = make_parser(parse)
        # kind -> failed samples, over the run; last_faults: the latest score call's
        self.faults: Counter = Counter()
        self.last_faults: Counter = Counter()

    def render(self, prompt: str, response: str, label) -> str:
        """The judge's prompt for one sample."""
        return self.template.format(prompt=prompt, response=response, label="" if label is None else label)

    def score(self, prompts: list[str], responses: list[str], labels: list) -> list[float | None]:
        """One score in [0, 1] per response, or None where the judge gave none (counted in `faults`)."""
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(f"Judge.score: {len(prompts)} prompts, {len(responses)} responses, "
                             f"{len(labels)} labels")
        if "label" in self._fields:
            missing = [i for i, x in enumerate(labels) if x is None]
            if missing:
                raise ValueError(f"judge template uses {{label}} but sample {missing[0]} has no label")
        texts = [self.render(p, r, x) for p, r, x in zip(prompts, responses, labels)]
        answers = self._backend.ask(texts) if texts else []
        scores, first = [], {}
        self.last_faults = Counter()
        for answer in answers:
            if isinstance(answer, str):
                value = self._parser(answer)
                if value is None:
                    answer = _Fault("unparsable", f"answer {answer[:200]!r} does not fit rule {self.parse!r}")
            if isinstance(answer, _Fault):
                self.last_faults[answer.kind] += 1
                first.setdefault(answer.kind, answer.detail)
                value = None
            scores.append(value)
        self.faults.update(self.last_faults)
        for kind, count in self.last_faults.items():
            self.log(f"judge {self._backend.name}: {count}/{len(texts)} samples got no score ({kind}; "
                     f"{self.faults[kind]} this run). First error: {first[kind]}")
        return scores

    def close(self):
        self._backend.close()
