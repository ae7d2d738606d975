"""Plug-ins: user code named on the command line as `package.module:name` or `path/to/file.py:name`.

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
              ^^^^^^ (--reward)  and the environment that drives a multi-turn rollout (--env)

User code is loaded only from an explicit flag, never from data. A file is imported under a name of
its own, registered in `sys.modules` so that a worker process (a reward or tool timeout, nanorl/rewards.py,
nanorl/env.py) can find its functions again by name.

    python -c "from nanorl.plugins import load_object; print(load_object('nanorl.rewards:exact', 'reward'))"
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def load_object(spec: str, what: str):
    """The callable `name` of `module:name` or `file.py:name`; `what` names the flag in errors."""
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected 'module:name' or 'file.py:name'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise FileNotFoundError(f"{what} file {where!r} does not exist")
        module_name = f"nanorl_user_{what}_{abs(hash(os.path.abspath(where)))}"
        module_spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # registered: a worker process finds its functions by name
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{what} {spec!r}: {where} has no callable {name!r}")
    return getattr(module, name)
