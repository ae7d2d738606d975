"""Test setup shared by every test file.

TRITON_INTERPRET must be set before triton is imported anywhere: kernels are wrapped when decorated,
so the Triton kernels in nanorl/entropy.py run in the interpreter on this GPU-less machine.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
