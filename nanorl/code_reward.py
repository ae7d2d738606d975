"""Code rewards (`--reward code`): the fraction of a row's tests that the response's program passes.

The program is the response's LAST fenced Python block; the tests are the row's label (`parse_tests`).
Each test case runs the program in its own process: `python -I` (isolated: no PYTHON* variables, no user
site) in a fresh temporary directory, deleted afterwards, with an environment of PATH, HOME and TMPDIR
(both the temp dir) only, under RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NPROC (processes), RLIMIT_FSIZE
(per file), no core dumps, and a wall-clock limit that kills it. Where the kernel allows (root, or
unprivileged user namespaces) it also runs in new network and PID namespaces: no network at all (not
even the host's 127.0.0.1), and every process it started dies with it. Run as root, each case drops to
a uid of its own (random, above 2^30; 65534 where the user namespace maps none): RLIMIT_NPROC then holds
per case and it can write only its temp dir and world-writable places (/tmp, /dev/shm); not as root,
it can write wherever the trainer's user can.
NOT protected: reading any world-readable file; disk filled through many files; a program that tampers
with its own test harness in-process (frame inspection, patched builtins); kernel exploits. Without
namespaces (one warning is logged) there is no network isolation and a child that calls setsid can
outlive its run. This is a resource fence for model-written code, not a security boundary.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

# a root trainer runs each case as a uid drawn from [UID_BASE, UID_BASE + UID_SPAN), owned by nobody else
# (so RLIMIT_NPROC, which counts a uid's processes, is per case), or as "nobody" where it is not mapped
UID_BASE, UID_SPAN, NOBODY = 1 << 30, 1 << 24, 65534
# exit status of the launcher when it was asked for namespaces and the kernel refused them
NO_NAMESPACE = 97
# exit status of the launcher when the program ran past its wall-clock limit
TIMED_OUT = 124

# Runs as `python -I -S -c LAUNCHER CONFIG` in the temp dir: enters the namespaces, forks the program's
# process (PID 1 of the new PID namespace: when it exits, the kernel kills all that it started), which
# sets the limits, drops root and execs Python on the case; the launcher kills it at the wall limit.
LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
root = os.geteuid() == 0
if cfg["ns"]:
    # CLONE_NEWNET | CLONE_NEWPID, and CLONE_NEWUSER where we are not root
    flags = 0x40000000 | 0x20000000 | (0 if root else 0x10000000)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags) != 0:
        sys.exit(97)
    if not root:
        maps = (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1"))
        for name, text in maps:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
pid = os.fork()
if pid == 0:
    mb = 1024 * 1024
    cpu = int(cfg["time_s"]) + 1
    for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, cfg["memory_mb"] * mb),
                       (resource.RLIMIT_FSIZE, cfg["file_mb"] * mb), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NPROC, cfg["max_procs"])):
        resource.setrlimit(res, (value, value))
    if root:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    # PR_SET_PDEATHSIG (after the uid change, which clears it): die if the launcher dies
    libc.prctl(1, signal.SIGKILL)
    os.execv(cfg["argv"][0], cfg["argv"])
timed_out = []
def stop(*_):
    timed_out.append(1)
    os.kill(pid, signal.SIGKILL)
signal.signal(signal.SIGALRM, stop)
signal.setitimer(signal.ITIMER_REAL, cfg["time_s"])
_, status = os.waitpid(pid, 0)
signal.setitimer(signal.ITIMER_REAL, 0)
sys.exit(124 if timed_out else os.waitstatus_to_exitcode(status) % 256)
"""

# Runs one assert case in the program's process: the program, then the case, then a secret line the
# program cannot print by itself (read from stdin before the program runs), so exiting early with
# status 0 or printing "ok" passes nothing.
HARNESS = r"""
import sys
def _run():
    token = sys.stdin.readline().strip()
    sys.stdin.close()
    scope = {"__name__": "solution"}
    exec(compile(open("solution.py").read(), "solution.py", "exec"), scope)
    exec(compile(open("case.py").read(), "case.py", "exec"), scope)
    sys.stdout.flush()
    sys.stdout.write("\n" + token + "\n")
_run()
"""

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_log = logging.getLogger(__name__)
# None until probed: (namespaces work here, the Python the programs run): `_sandbox`
_SANDBOX: tuple[bool, str] | None = None


def extract_program(response: str) -> str | None:
    """The last fenced block tagged python/py/python3 or untagged; None when there is none."""
    tags = ("", "python", "py", "python3")
    blocks = [body for tag, body in _FENCE.findall(response) if tag.lower() in tags]
    return blocks[-1] if blocks else None


def parse_tests(label) -> list[tuple]:
    """The row's tests as cases: ("assert", code) or ("io", stdin, expected stdout). Accepted forms:
    - Python source (MBPP / open-r1 asserts): each top-level `assert` is a case, the other statements
      (imports, helpers) run before every case; a list of such strings: each string is one case;
    - {"inputs": [...], "outputs": [...]} (APPS stdin/stdout; call-based "fn_name" is refused), or
      {"test_cases": [{"input": ..., "output": ...}, ...]} (open-r1 verification_info); an input or
      output that is a list of lines is joined with newlines;
    - a JSON string of any of these."""
    if isinstance(label, str) and label.lstrip()[:1] in ("[", "{"):
        try:
            label = json.loads(label)
        except json.JSONDecodeError:
            pass
    if isinstance(label, str):
        tree = _parse(label)
        setup = "\n".join(ast.get_source_segment(label, n) for n in tree.body
                          if not isinstance(n, ast.Assert))
        cases = [("assert", setup + "\n" + ast.get_source_segment(label, n))
                 for n in tree.body if isinstance(n, ast.Assert)]
    elif isinstance(label, list) and all(isinstance(t, str) for t in label):
        # each string is checked now: a typo in the data is an error, not a failed test
        cases = [("assert", t) for t in label if _parse(t)]
    elif isinstance(label, dict) and "fn_name" in label:
        raise ValueError("code tests: call-based APPS cases (fn_name) are not supported, only stdin/stdout")
    elif isinstance(label, dict) and "inputs" in label and "outputs" in label:
        if len(label["inputs"]) != len(label["outputs"]):
            raise ValueError(f"code tests: {len(label['inputs'])} inputs but {len(label['outputs'])} outputs")
        cases = [("io", _text(i), _text(o)) for i, o in zip(label["inputs"], label["outputs"])]
    elif isinstance(label, dict) and isinstance(label.get("test_cases"), list):
        if any(c.get("type", "stdin_stdout") != "stdin_stdout" for c in label["test_cases"]):
            raise ValueError("code tests: only test_cases of type stdin_stdout are supported")
        cases = [("io", _text(c["input"]), _text(c["output"])) for c in label["test_cases"]]
    else:
        raise ValueError(f"code tests: expected asserts (str or list of str), {{'inputs', 'outputs'}}, "
                         f"{{'test_cases'}} or JSON of one, got {type(label).__name__}: {str(label)[:80]!r}")
    if not cases:
        raise ValueError(f"code tests: no test case in {str(label)[:80]!r}")
    return cases


def _parse(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"code tests: not valid Python ({e}): {source[:80]!r}") from e


def _text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _same_output(got: str, want: str) -> bool:
    """Equal up to trailing spaces on each line and blank lines at either end (APPS's loosest rule)."""
    def lines(s):
        return [line.rstrip() for line in s.strip().splitlines()]
    return lines(got) == lines(want)


def _launch(where: tuple[str, int], argv: list[str], stdin: bytes, ns: bool, time_s: float,
            memory_mb: int, max_procs: int, file_mb: int) -> tuple[int, bytes, bytes]:
    """One sandboxed process in `where` (`_workdir`): (exit status, stdout, stderr). Output goes through files
    bounded by RLIMIT_FSIZE, so a program that prints without end cannot grow this process."""
    workdir, uid = where
    cfg = {"uid": uid, "ns": ns, "argv": argv, "time_s": time_s, "memory_mb": memory_mb,
           "max_procs": max_procs, "file_mb": file_mb}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}
    out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
    with open(out_path, "wb+") as out, open(err_path, "wb+") as err:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(cfg)],
                                stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir, env=env,
                                start_new_session=True)
        try:
            # the launcher kills at time_s; this only backs it up
            proc.communicate(stdin, timeout=time_s + 10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # whatever is left in the process group (without a PID namespace: the program's children)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(4096)


def _sandbox() -> tuple[bool, str]:
    """Probed once per process: (namespaces work here, the Python the programs run). That Python is the
    trainer's own unless the sandbox user cannot run it (a root trainer's interpreter under /root, which
    no other uid can enter): then the first of /usr/bin/python3, /usr/local/bin/python3 that works. One
    warning when there are no namespaces, one when another Python is used; an error when none runs."""
    global _SANDBOX
    if _SANDBOX is not None:
        return _SANDBOX
    pythons = list(dict.fromkeys(p for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
                                 if os.path.exists(p)))
    ns, failures = True, []
    for python in pythons:
        where = _workdir()
        try:
            rc, out, err = _launch(where, [python, "-I", "-c", "print(6 * 7)"], b"", ns, 10.0, 1024, 64, 16)
            if rc == NO_NAMESPACE and ns:
                ns = False
                _log.warning("code reward: no network/PID namespace here (unshare refused): programs run "
                             "WITHOUT network isolation, and a child that calls setsid may outlive its run")
                rc, out, err = _launch(where, [python, "-I", "-c", "print(6 * 7)"], b"", ns, 10.0, 1024,
                                       64, 16)
        finally:
            shutil.rmtree(where[0], ignore_errors=True)
        if rc == 0 and out.strip() == b"42":
            if python != sys.executable:
                _log.warning(f"code reward: programs run with {python} (the sandbox's uid cannot run "
                             f"{sys.executable})")
            _SANDBOX = (ns, python)
            return _SANDBOX
        failures.append(f"{python}: status {rc}, stderr {err.decode(errors='replace')[-300:]!r}")
    raise RuntimeError(f"code reward: the sandbox (uid {where[1]}) cannot run Python: "
                       f"{'; '.join(failures)}")


def _workdir() -> tuple[str, int]:
    """A new temp dir and the uid the case runs as, who owns it (the trainer's own when not root)."""
    workdir = tempfile.mkdtemp(prefix="nanorl_code_")
    if os.geteuid() != 0:
        return workdir, os.getuid()
    uid = UID_BASE + secrets.randbelow(UID_SPAN)
    try:
        os.chown(workdir, uid, uid)
    except OSError:
        # a user namespace that maps no such uid (a container's): the shared "nobody"
        uid = NOBODY
        os.chown(workdir, uid, uid)
    return workdir, uid


def run_tests(program: str, tests, time_s: float = 5.0, memory_mb: int = 1024, max_procs: int = 32,
              file_mb: int = 16) -> tuple[int, int, str]:
    """Runs `program` once per case of `tests` (`parse_tests`), each in a new sandbox (module
    docstring): (passed, total, reason), reason "" when all pass, else the first failure's kind
    ("timeout", "error", "wrong output", "ended before its tests", "no namespace") and a short
    message. At most total × (time_s + ~1 s) of wall time. `max_procs` counts every process of the
    case's uid (module docstring): per case as root, else all of the trainer's user's processes."""
    cases = parse_tests(tests)
    ns, python = _sandbox()
    passed, reason = 0, ""
    for case in cases:
        where = _workdir()
        workdir = where[0]
        try:
            with open(os.path.join(workdir, "solution.py"), "w") as f:
                f.write(program)
            if case[0] == "assert":
                with open(os.path.join(workdir, "harness.py"), "w") as f:
                    f.write(HARNESS)
                with open(os.path.join(workdir, "case.py"), "w") as f:
                    f.write(case[1])
                token = secrets.token_hex(16)
                rc, out, err = _launch(where, [python, "-I", "harness.py"], token.encode() + b"\n",
                                       ns, time_s, memory_mb, max_procs, file_mb)
                ok = rc == 0 and out.decode(errors="replace").rstrip("\n").endswith("\n" + token)
            else:
                rc, out, err = _launch(where, [python, "-I", "solution.py"], case[1].encode(),
                                       ns, time_s, memory_mb, max_procs, file_mb)
                ok = rc == 0 and _same_output(out.decode(errors="replace"), case[2])
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        passed += ok
        if not ok and not reason:
            kind = ("timeout" if rc == TIMED_OUT else "no namespace" if rc == NO_NAMESPACE else "error"
                    if rc != 0 else "wrong output" if case[0] == "io" else "ended before its tests")
            reason = f"{kind} (status {rc}): {err.decode(errors='replace').strip()[-200:]}"
    return passed, len(cases), reason


def code_reward(prompt: str, response: str, label) -> float:
    """`--reward code`: the fraction of the label's tests the response's last Python block passes; 0.0
    when the response has no block. Malformed tests or a sandbox that cannot run raise (a counted
    reward fault, never a silent 0)."""
    program = extract_program(response)
    if program is None:
        # the tests must still be readable: a broken label is the data's fault, not the policy's
        parse_tests(label)
        return 0.0
    passed, total, _ = run_tests(program, label)
    return passed / total

