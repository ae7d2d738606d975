"""Plug-ins: user code named on the command line as `package.module:name` or `path/to/file.py:name`.

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
              ^^^^^^   ^^^^^^^^^^^^^^^^^^^ (+ metrics)  ^^^^^^^^^   ^^^^
              --reward, --reward-postprocess,          --advantage, --policy-loss; --log-metadata; --env

User code is loaded only from an explicit flag, never from data. A file is imported once under a
name of its own (later loads reuse it), registered in `sys.modules` so that a worker process (a
reward or tool timeout, nanorl/rewards.py, nanorl/env.py) can find its functions again by name.
Each plug-in point has ONE documented signature, checked with `inspect.signature` when the config
is built: a function that cannot be called that way is rejected with the expected signature in the
message, before any model is loaded (the walk-through: docs/extending.md).

    --reward              fn(prompt, response, label[, sample]) -> float | dict   (nanorl/rewards.py)
    --reward-postprocess  fn(samples) -> None: the step's scored Samples, in groups of samples_per_prompt;
                          may write Sample.metadata and set Sample.reward, in place
    --advantage           fn(*, mask, index, scores, metadata, ...) -> (advantages, returns) [B, T]
                          (any input the built-in estimators get, by name: nanorl/advantage.py)
    --policy-loss         fn(logp, old_logp, advantages, mask, *, metadata, clip_low, ...) -> loss [B, T]
                          or (loss, stats) (any LossConfig field by name: nanorl/losses.py)
    --log-metadata        names or prefixes ("calib/") of numeric Sample.metadata fields, logged per step
    --plugin file.py      a module whose `reward`, `reward_postprocess`, `advantage`, `policy_loss`,
                          `LOG_METADATA`, `CONFIG` (a dict of other fields) and `make_task(out_dir)` fill
                          the settings left at their defaults

    python -c "from nanorl.plugins import load_object; print(load_object('nanorl.rewards:exact', 'reward'))"
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys

_FILES: dict[str, object] = {}  # absolute path -> the module imported from it (imported once)


def load_object(spec: str, what: str):
    """The callable `name` of `module:name` or `file.py:name`; `what` names the flag in errors."""
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected 'module:name' or 'file.py:name'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        module = load_file(where, what)
    else:
        module = importlib.import_module(where)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"{what} {spec!r}: {where} has no callable {name!r}")
    return getattr(module, name)


def load_file(path: str, what: str = "plugin"):
    """The module of a .py file, imported once per process (the config check and the trainer then
    hold the very same functions)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist")
    key = os.path.abspath(path)
    if key not in _FILES:
        module_name = f"nanorl_user_{abs(hash(key))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # registered: a worker process finds its functions by name
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        _FILES[key] = module
    return _FILES[key]


# ----------------------------------------------------------------------------- signatures

def check_call(fn, what: str, expected: str, args: int = 0, available=frozenset()) -> frozenset:
    """The parameter names `fn` takes, after checking it can be called as `expected` says: with
    `args` positional arguments, then by keyword with any of the names in `available` (what nanorl
    can feed it). A required parameter nanorl does not have raises TypeError naming both."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: cannot read the signature of {fn!r} ({e}); expected {expected}") from e
    named = [(n, p) for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [n for n, p in named[args:] if p.default is p.empty]
    name = f"{getattr(fn, '__name__', fn)}{sig}"
    missing = [n for n in required if n not in available]
    if missing:
        have = f" with inputs from: {', '.join(sorted(available))}" if available else ""
        raise TypeError(f"{what}: {name} asks for {', '.join(missing)}, which nanorl does not give; "
                        f"expected {expected}{have}")
    try:
        sig.bind(*[None] * args, **{n: None for n in required})
    except TypeError as e:
        raise TypeError(f"{what}: {name} cannot be called as {expected} ({e})") from None
    return frozenset(n for n, _ in named)


REWARD_SIGNATURE = "fn(prompt, response, label) or fn(prompt, response, label, sample)"
POSTPROCESS_SIGNATURE = "fn(samples) -> None (edits the Samples in place)"
ADVANTAGE_SIGNATURE = "fn(*, mask, index, scores, metadata, ...) -> (advantages [B, T], returns [B, T])"
POLICY_LOSS_SIGNATURE = ("fn(logp, old_logp, advantages, mask, *, metadata, <LossConfig fields>) "
                         "-> loss [B, T] or (loss [B, T], stats)")


def load_checked(spec: str, what: str):
    """`spec`'s function, its signature checked against the plug-in point `what`'s (module docstring)."""
    fn = load_object(spec, what)
    if what == "reward":
        check_call(fn, f"--reward {spec}", REWARD_SIGNATURE, args=3, available={"sample"})
    elif what == "reward_postprocess":
        check_call(fn, f"--reward-postprocess {spec}", POSTPROCESS_SIGNATURE, args=1)
    elif what == "advantage":
        from nanorl.advantage import PLUGIN_INPUTS
        check_call(fn, f"--advantage {spec}", ADVANTAGE_SIGNATURE, available=PLUGIN_INPUTS)
    elif what == "policy_loss":
        from nanorl.losses import PLUGIN_LOSS_INPUTS
        check_call(fn, f"--policy-loss {spec}", POLICY_LOSS_SIGNATURE, args=4, available=PLUGIN_LOSS_INPUTS)
    else:
        raise ValueError(f"unknown plug-in point {what!r}")
    return fn


# ----------------------------------------------------------------------------- --plugin

PLUGIN_FIELDS = {"reward": "reward", "reward_postprocess": "reward_postprocess", "advantage": "advantage",
                 "policy_loss": "policy_loss", "LOG_METADATA": "log_metadata"}  # module attribute -> Config field


def _plugin_module(path: str):
    return load_file(path, "plugin") if path.endswith(".py") else importlib.import_module(path)


def plugin_values(path: str) -> dict:
    """Config values a --plugin module supplies: its CONFIG dict, `file.py:name` for each plug-in
    function it defines, and its LOG_METADATA string."""
    module = _plugin_module(path)
    if not isinstance(getattr(module, "CONFIG", {}), dict):
        raise TypeError(f"--plugin {path}: CONFIG must be a dict of Config field values")
    out = dict(getattr(module, "CONFIG", {}))  # other Config fields the idea needs (e.g. max_new_tokens)
    for attr, name in PLUGIN_FIELDS.items():
        value = getattr(module, attr, None)
        if value is None:
            continue
        if attr == "LOG_METADATA":
            if not isinstance(value, str):
                raise TypeError(f"--plugin {path}: LOG_METADATA must be a comma-separated string, got {value!r}")
            out[name] = value
        elif callable(value):
            out[name] = f"{path}:{attr}"
        else:
            raise TypeError(f"--plugin {path}: `{attr}` must be a function, got {type(value).__name__}")
    return out


def plugin_task(path: str):
    """A --plugin module's `make_task(out_dir) -> {"model", "train", "test"}`, or None: the task
    (model and data) built in code when --model / --train-data are not given."""
    if not path:
        return None
    make = getattr(_plugin_module(path), "make_task", None)
    if make is not None:
        check_call(make, f"--plugin {path}: make_task", "make_task(out_dir) -> dict(model, train, test)", args=1)
    return make


def check_config(cfg, need, defaults: dict) -> None:
    """Config.__post_init__'s part: --plugin fills the fields left at their defaults (a field set to
    something else by a flag or the --algo preset that disagrees with the plugin is an error: drop
    one), then every user function's signature is checked, before any model is loaded."""
    if cfg.plugin:
        for name, value in plugin_values(cfg.plugin).items():
            need(name in defaults, f"--plugin {cfg.plugin}: CONFIG names {name!r}, which is not a Config field")
            mine = getattr(cfg, name)
            need(mine in (defaults[name], value), f"--plugin {cfg.plugin} sets {name}={value!r}, but {name} is "
                 f"already {mine!r} (a flag or the --algo preset): drop one of the two")
            setattr(cfg, name, value)
        plugin_task(cfg.plugin)
    for name in ("reward", "advantage", "policy_loss", "reward_postprocess"):
        if ":" in getattr(cfg, name):
            load_checked(getattr(cfg, name), name)
    need(not cfg.reward_postprocess or ":" in cfg.reward_postprocess,
         f"reward_postprocess must be module:function or file.py:function, got {cfg.reward_postprocess!r}")
    need(not (cfg.reward_postprocess and cfg.advantage == "remax"), "reward_postprocess with advantage remax is "
         "not supported: the greedy baseline response is scored by --reward alone, outside any group")
    need(all(x.strip() for x in cfg.log_metadata.split(",")) or not cfg.log_metadata,
         f"log_metadata: an empty name in {cfg.log_metadata!r}")


# ----------------------------------------------------------------------------- the step's hooks

def resolve(spec: str, what: str):
    """A built-in's name as is, or the user function `module:fn` / `file.py:fn` names (imported once,
    so resolving it every step costs a dict lookup and a signature check)."""
    return load_checked(spec, what) if ":" in spec else spec


class Hooks:
    """The run's step hooks (train.py): the reward post-processing and the metadata fields to log.
    (User advantage and policy-loss functions: Config.advantage_fn / policy_loss_fn.)"""

    def __init__(self, cfg):
        post = cfg.reward_postprocess
        self.postprocess_fn = load_checked(post, "reward_postprocess") if post else None
        self.log_metadata = [x.strip() for x in cfg.log_metadata.split(",") if x.strip()]

    def postprocess(self, samples: list) -> None:
        """--reward-postprocess on the step's scored samples (groups of samples_per_prompt, in order)."""
        if self.postprocess_fn is not None and samples:
            out = self.postprocess_fn(samples)
            if out is not None:
                raise TypeError(f"--reward-postprocess returned {type(out).__name__}; it must edit the "
                                f"Samples in place and return None ({POSTPROCESS_SIGNATURE})")

    def with_metadata(self, metrics: dict, samples: list) -> dict:
        """`metrics` plus the step's metadata metrics, logged under their own names (a name that is
        already a metric of the step raises: rename the field). Every rank calls it: the fields are
        pooled over ranks first (one all_gather_object), so all ranks log the same keys — a key only
        some ranks had would misalign the metric all-reduce (nanorl/distributed.py reduce_metrics)."""
        extra = metadata_metrics(samples, self.log_metadata, gather=_all_gather)
        clash = sorted(set(extra) & set(metrics))
        if clash:
            raise ValueError(f"Sample.metadata fields {clash} are also metric names of the step: rename them")
        return {**metrics, **extra}


def _all_gather(local: dict) -> list[dict]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def metadata_metrics(samples: list, patterns: list[str], gather=None) -> dict:
    """Mean of every numeric Sample.metadata field that a pattern names (exactly, or by prefix when
    the pattern ends in "/") or that the reward returned as log-only (listed in metadata["logged"]:
    nanorl/rewards.py), over the samples that have it, logged under the field's own name.
    Non-finite values are left out of the mean (and counted in `<name>/nonfinite`): a NaN from one
    sample never reaches a metric. `gather` pools the per-field sums over ranks (list of dicts)."""
    sums: dict[str, list] = {}
    for s in samples:
        logged = s.metadata.get("logged", ())
        for key, value in s.metadata.items():
            if not (key in logged or any(key == p or (p.endswith("/") and key.startswith(p)) for p in patterns)):
                continue
            if not isinstance(value, numbers.Real):  # bools count as 0/1
                continue  # lists, strings, nested dicts: not a per-sample scalar
            acc = sums.setdefault(key, [0.0, 0, 0])
            if math.isfinite(value):
                acc[0], acc[1] = acc[0] + float(value), acc[1] + 1
            else:
                acc[2] += 1
    if gather is not None:
        pooled: dict[str, list] = {}
        for part in gather(sums):
            for k, (total, n, bad) in part.items():
                acc = pooled.setdefault(k, [0.0, 0, 0])
                acc[0], acc[1], acc[2] = acc[0] + total, acc[1] + n, acc[2] + bad
        sums = pooled
    out = {k: total / n for k, (total, n, _) in sums.items() if n}
    out.update({f"{k}/nonfinite": bad for k, (_, _, bad) in sums.items() if bad})
    return out
