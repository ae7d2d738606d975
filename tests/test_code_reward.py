"""--reward code (nanorl/code_reward.py): extraction, test formats, scores, and the sandbox's limits:
a loop, unbounded memory, forks, writes outside the temp dir, the network, the environment."""
import json
import os
import resource
import secrets
import socket
import threading
import time

import pytest

from nanorl import code_reward as cr, rewards

ADD = "def add(a, b):\n    return a + b\n"
ASSERTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
# generous: the machine is busy; only "it came back within its limit" is asserted, never a speed
SLACK_S = 30.0


def fenced(code: str, tag: str = "python") -> str:
    return f"Here it is:\n```{tag}\n{code}```\nDone."


def test_extract_program_takes_the_last_python_block():
    text = "```python\nx = 1\n```\nthen\n```bash\nls\n```\nand\n```\nx = 2\n```\ntail"
    assert cr.extract_program(text) == "x = 2\n"
    assert cr.extract_program(fenced("y = 3\n", "py") + "```text\nnot code\n```") == "y = 3\n"
    assert cr.extract_program("no code here") is None
    assert cr.extract_program("```bash\nls\n```") is None


def test_parse_tests_forms():
    # asserts as source: each assert is a case, the other statements run before each
    cases = cr.parse_tests("import math\n" + ASSERTS)
    assert cases == [("assert", "import math\nassert add(1, 2) == 3"),
                     ("assert", "import math\nassert add(2, 2) == 4")]
    listed = cr.parse_tests(["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    assert listed == [("assert", "assert add(1, 2) == 3"), ("assert", "assert add(0, 0) == 0")]
    io = {"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", "7"]}
    assert cr.parse_tests(io) == [("io", "1 2\n", "3\n"), ("io", "3\n4", "7")]
    assert cr.parse_tests(json.dumps(io)) == cr.parse_tests(io)
    assert cr.parse_tests(json.dumps(["assert 1"])) == [("assert", "assert 1")]
    opr1 = {"test_cases": [{"input": "1 2", "output": "3", "type": "stdin_stdout"}]}
    assert cr.parse_tests(opr1) == [("io", "1 2", "3")]
    for bad, words in [({"fn_name": "f", "inputs": [], "outputs": []}, "fn_name"),
                       ({"inputs": [1], "outputs": []}, "1 inputs but 0 outputs"), ("x = 1", "no test case"),
                       (3, "got int"), ("assert (", "not valid Python"), (["assert ("], "not valid Python"),
                       ({"test_cases": [{"input": "", "output": "", "type": "call"}]}, "stdin_stdout")]:
        with pytest.raises(ValueError, match=words):
            cr.parse_tests(bad)


def test_scores_asserts_stdin_and_json():
    assert cr.code_reward("p", fenced(ADD), ASSERTS) == 1.0
    wrong = "def add(a, b):\n    return a * b\n"
    # 1*2 != 3 but 2*2 == 4: half the cases pass
    assert cr.code_reward("p", fenced(wrong), ASSERTS) == 0.5
    passed, total, reason = cr.run_tests(wrong, ASSERTS)
    assert (passed, total) == (1, 2) and reason.startswith("error") and "AssertionError" in reason
    io = {"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10  \n\n", "1\n"]}
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    # trailing spaces and blank lines do not count; 0+0 is not 1
    assert cr.run_tests(prog, io)[:2] == (2, 3)
    assert cr.code_reward("p", fenced(prog, ""), json.dumps(io)) == pytest.approx(2 / 3)
    assert cr.code_reward("p", fenced(ADD), json.dumps(ASSERTS.splitlines())) == 1.0
    assert cr.code_reward("p", "no program", ASSERTS) == 0.0
    with pytest.raises(ValueError, match="no test case"):
        cr.code_reward("p", "no program", "x = 1")


def test_ending_early_or_printing_passes_nothing():
    # status 0 before the test ran, or a printed "ok", is not a pass: the harness's secret line is missing
    for prog in ["import os\nos._exit(0)\n", "import sys\nprint('ok')\nsys.exit(0)\n"]:
        passed, total, reason = cr.run_tests(prog, "assert False")
        assert passed == 0 and "ended before its tests" in reason


def test_infinite_loop_is_stopped_at_its_limit():
    start = time.monotonic()
    passed, total, reason = cr.run_tests("while True:\n    pass\n" + ADD, ASSERTS, time_s=1.0)
    assert (passed, total) == (0, 2) and reason.startswith("timeout")
    assert time.monotonic() - start < 2 * 1.0 + SLACK_S


def test_unbounded_memory_fails_and_leaves_the_trainer_alone():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # the limit is the one asked for: 300 MB at once fits in 1024 MB, not in 200 MB
    big = "x = bytearray(300 * 10 ** 6)\n" + ADD
    assert cr.run_tests(big, ASSERTS, memory_mb=1024)[0] == 2
    assert cr.run_tests(big, ASSERTS, memory_mb=200)[0] == 0
    prog = "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n" + ADD
    passed, _, reason = cr.run_tests(prog, ASSERTS, memory_mb=200)
    assert passed == 0 and "MemoryError" in reason
    # ru_maxrss is in KiB: this process grew by less than 50 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024


def _alive_named(name: str, wait_s: float = 10.0) -> list[int]:
    """Live (not zombie) processes called `name`, after up to `wait_s` for killed ones to go."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            # "pid (comm) state ...": a zombie is dead, only not yet reaped
            comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            if comm == name and state != "Z":
                found.append(int(pid))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.mark.parametrize("namespaces", [True, False])
def test_forks_are_bounded_and_nothing_outlives_the_run(namespaces, monkeypatch):
    if namespaces and not cr._sandbox()[0]:
        pytest.skip("no PID namespace on this machine")
    # False: the fallback, as where unshare is refused (the process group is killed instead)
    monkeypatch.setattr(cr, "_SANDBOX", (namespaces, cr._sandbox()[1]))
    tag = "h4f" + secrets.token_hex(4)
    # with a PID namespace, children leave the process group too (only the namespace can catch them)
    escape = "os.setsid()" if namespaces else "pass"
    # each child renames itself and sleeps; the parent forks until the limit refuses (or 200 times)
    prog = f"""import ctypes, os, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        ctypes.CDLL(None).prctl(15, b"{tag}")
        {escape}
        time.sleep(1000)
        os._exit(0)
    n += 1
""" + ADD
    start = time.monotonic()
    passed, total, reason = cr.run_tests(prog, "assert n < 8\nassert add(1, 2) == 3", time_s=5.0, max_procs=8)
    # the limit held (fewer than 8 children) and the program went on to pass both cases
    assert (passed, total) == (2, 2), reason
    assert time.monotonic() - start < 2 * 5.0 + SLACK_S
    assert _alive_named(tag) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="per-case uids need root; else max_procs counts the user's")
def test_a_fork_bomb_does_not_starve_another_run():
    # RLIMIT_NPROC counts a uid's processes: with one shared uid, a program holding max_procs of them
    # would make another run's forks fail (a silent 0). Each case has its own uid.
    ready = f"/tmp/h4ready_{secrets.token_hex(4)}"
    bomb = f"""import os, time
for _ in range(50):
    try:
        if os.fork() == 0:
            time.sleep(1000)
    except OSError:
        break
open({ready!r}, "w").close()
time.sleep(1000)
"""
    result = []
    thread = threading.Thread(target=lambda: result.append(cr.run_tests(bomb, "assert 1", time_s=8.0,
                                                                          max_procs=8)))
    thread.start()
    try:
        deadline = time.monotonic() + SLACK_S
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(ready), "the fork bomb never got going"
        # a program that forks once (as one using subprocess would): refused if it shared the bomb's uid
        forks_once = "import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\n" + ADD
        assert cr.run_tests(forks_once, ASSERTS, max_procs=8)[:2] == (2, 2)
    finally:
        thread.join()
        os.unlink(ready)
    assert result[0][0] == 0 and result[0][2].startswith("timeout")


def test_writes_stay_inside_and_secrets_are_not_inherited(tmp_path, monkeypatch):
    monkeypatch.setenv("NANORL_TEST_SECRET", "hunter2")
    made = []
    workdir = cr._workdir
    monkeypatch.setattr(cr, "_workdir", lambda: made.append(workdir()) or made[-1])
    target = tmp_path / "escaped.txt"
    prog = f"""import os
try:
    with open({str(target)!r}, "w") as f:
        f.write("x")
except OSError:
    pass
with open("mine.txt", "w") as f:
    f.write("y")
"""
    case = ("assert os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR']\n"
            "assert open('mine.txt').read() == 'y'\n"
            "assert 'NANORL_TEST_SECRET' not in os.environ\n"
            "assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LC_CTYPE'}\n")
    passed, total, reason = cr.run_tests(prog, case)
    assert (passed, total) == (4, 4), reason
    # every case's directory is gone afterwards
    assert len(made) == 4 and not any(os.path.exists(d) for d, _ in made)
    if os.geteuid() == 0:
        # run as nobody: this test's 0700 directory is out of reach
        assert not target.exists()
    else:
        # documented: without root the program writes wherever this user can
        assert target.read_text() == "x"


def test_network_is_unreachable():
    if not cr._sandbox()[0]:
        pytest.skip("no network namespace on this machine: programs run without network isolation")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        prog = f"""import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    reached = True
except OSError:
    reached = False
"""
        passed, _, _ = cr.run_tests(prog, "assert reached")
        assert passed == 0
        # and nothing arrived at the listener
        with pytest.raises(BlockingIOError):
            server.accept()


def test_no_namespace_is_one_warning_then_runs_without(monkeypatch, caplog):
    # as where the kernel refuses unshare: the probe says so once, and programs still run
    monkeypatch.setattr(cr, "LAUNCHER", cr.LAUNCHER.replace("if libc.unshare(flags) != 0:", "if True:"))
    monkeypatch.setattr(cr, "_SANDBOX", None)
    with caplog.at_level("WARNING", logger="nanorl.code_reward"):
        assert cr.run_tests(ADD, ASSERTS)[:2] == (2, 2)
        assert cr.run_tests(ADD, ASSERTS)[:2] == (2, 2)
    assert cr._SANDBOX[0] is False
    assert sum("WITHOUT network isolation" in r.getMessage() for r in caplog.records) == 1


def test_registered_as_reward_code():
    fn = rewards.load_reward_fn("code")
    assert fn is cr.code_reward
    logged = []
    runner = rewards.RewardRunner(fn, timeout=60.0, workers=2, log=logged.append)
    try:
        out = runner(["p"] * 3, [fenced(ADD), fenced("def add(a, b):\n    return 0\n"), fenced(ADD)],
                     [ASSERTS, ASSERTS, "not python ("])
    finally:
        runner.close()
    # a malformed label is a counted fault with its message logged, not a crash and not a silent 0
    assert out == [1.0, 0.0, 0.0] and runner.faults == {"ValueError": 1}
    assert "not valid Python" in logged[0]


def test_a_list_label_reaches_the_reward_as_json():
    """MBPP's test_list column (a list of asserts) is a label: nanorl/data.py passes it on as JSON, which
    the code reward parses back — the list column works as it is in the dataset."""
    from nanorl.data import build_prompts
    from nanorl.task import build_tokenizer
    rows = [{"prompt": "1+1=", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 1"]}]
    prompts, _ = build_prompts(rows, build_tokenizer(), "prompt", "tests", 64, source="rows")
    assert json.loads(prompts[0].label) == rows[0]["tests"]
    response = "```python\ndef add(a, b):\n    return a + b\n```"
    assert cr.code_reward(prompts[0].text, response, prompts[0].label) == 0.5
