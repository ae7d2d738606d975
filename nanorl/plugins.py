"""Plug-ins: user code named on the command line as `package.module:name` or `path/to/file.py:name`.

Its links of the chain: the reward (--reward, --reward-postprocess, --log-metadata), the advantage and the
loss (--advantage, --policy-loss), or all of them from one module (--plugin); the walk-through is
docs/extending.md. Start at `apply`: train.py calls it at set-up, right after parsing. It fills in what a
--plugin module supplies and loads every user function once, checking it against its plug-in point's one
signature (the *_SIGNATURE constants) before any model is loaded. Config never loads user code.

User code is loaded only from an explicit flag, never from data. A file is imported once under a name of
its own, registered in `sys.modules`, so that a worker process (a reward or tool timeout) finds its
functions again by name.

    python -c "from nanorl.plugins import load_object; print(load_object('nanorl.rewards:exact', 'reward'))"
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

# absolute path -> the module imported from it (imported once)
_FILES: dict[str, object] = {}


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
        # registered: a worker process finds its functions by name
        sys.modules[module_name] = module
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
FILTER_SIGNATURE = "fn(samples) -> list[bool] (True keeps the sample)"
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
    elif what == "sample_filter":
        check_call(fn, f"--sample-filter {spec}", FILTER_SIGNATURE, args=1)
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

# the Config fields that name a user function, each with the plug-in point it is checked against
USER_FUNCTIONS = ("reward", "advantage", "policy_loss", "reward_postprocess", "sample_filter")
# --plugin module attribute -> the Config field it fills
PLUGIN_FIELDS = {**{name: name for name in USER_FUNCTIONS}, "LOG_METADATA": "log_metadata"}


def _plugin_module(path: str):
    return load_file(path, "plugin") if path.endswith(".py") else importlib.import_module(path)


def plugin_values(path: str) -> dict:
    """Config values a --plugin module supplies: its CONFIG dict, `file.py:name` for each plug-in
    function it defines, and its LOG_METADATA string."""
    module = _plugin_module(path)
    if not isinstance(getattr(module, "CONFIG", {}), dict):
        raise TypeError(f"--plugin {path}: CONFIG must be a dict of Config field values")
    # other Config fields the idea needs (e.g. max_new_tokens)
    out = dict(getattr(module, "CONFIG", {}))
    for attr, name in PLUGIN_FIELDS.items():
        value = getattr(module, attr, None)
        if value is None:
            continue
        if attr == "LOG_METADATA":
            if not isinstance(value, str):
                raise TypeError(f"--plugin {path}: LOG_METADATA must be a comma-separated string, "
                                f"got {value!r}")
            out[name] = value
        elif callable(value):
            out[name] = f"{path}:{attr}"
        else:
            raise TypeError(f"--plugin {path}: `{attr}` must be a function, got {type(value).__name__}")
    return out


def plugin_task(path: str):
    """The --plugin module `path`'s `make_task(out_dir) -> {"model", "train", "test"}`, or None: the
    task (model and data) built in code when --model / --train-data are not given."""
    make = getattr(_plugin_module(path), "make_task", None)
    if make is not None:
        check_call(make, f"--plugin {path}: make_task", "make_task(out_dir) -> dict(model, train, test)",
                   args=1)
    return make


def with_plugin(cfg):
    """`cfg` with the fields its --plugin module supplies (the rules: `apply`), its make_task checked."""
    values = {}
    defaults, mine_all = type(cfg)().as_flags(), cfg.as_flags()
    # -1 (the default) was resolved for the reward before the plug-in's: resolve it again
    auto_timeout = getattr(cfg, "_auto_reward_timeout", False)
    for name, value in plugin_values(cfg.plugin).items():
        if name not in defaults:
            raise ValueError(f"config: --plugin {cfg.plugin}: CONFIG names {name!r}, which is not a "
                             "Config field")
        mine = mine_all[name]
        if mine not in (defaults[name], value) and not (name == "reward_timeout" and auto_timeout):
            raise ValueError(f"config: --plugin {cfg.plugin} sets {name}={value!r}, but {name} is "
                             f"already {mine!r} (a flag or the --algo preset): drop one of the two")
        values[name] = value
    if auto_timeout:
        values.setdefault("reward_timeout", -1.0)
    plugin_task(cfg.plugin)
    return cfg.replace(**values) if values else cfg


def apply(cfg):
    """`cfg` at set-up (train.py, right after parsing): the fields a --plugin module supplies filled in
    where they were left at their defaults, and every user function loaded once and its signature
    checked, before any model is loaded. A field that a flag or the --algo preset set to something else
    is an error (drop one of the two). Returns a new, validated Config where the plug-in filled fields,
    else `cfg` itself; applying it twice changes nothing."""
    if cfg.plugin:
        cfg = with_plugin(cfg)
    for name in USER_FUNCTIONS:
        if ":" in getattr(cfg, name):
            fn = load_checked(getattr(cfg, name), name)
            if name == "advantage":  # what it declares against the flags, as a built-in's at parse time
                cfg.check_estimator(fn)
    return cfg


# ----------------------------------------------------------------------------- the step's hooks

def resolve(spec: str, what: str):
    """A built-in's name as is, or the user function `module:fn` / `file.py:fn` names (imported once,
    so resolving it every step costs a dict lookup and a signature check)."""
    return load_checked(spec, what) if ":" in spec else spec


class Hooks:
    """The run's step hooks (train.py): --reward-postprocess, --sample-filter, and --log-metadata's
    patterns (logged by nanorl/metrics.py with_metadata). (User advantage and policy-loss functions:
    Config.advantage_fn / policy_loss_fn.)"""

    def __init__(self, cfg):
        post = cfg.reward_postprocess
        self.postprocess_fn = load_checked(post, "reward_postprocess") if post else None
        keep = cfg.sample_filter
        self.filter_fn = load_checked(keep, "sample_filter") if keep else None
        self.log_metadata = [x.strip() for x in cfg.log_metadata.split(",") if x.strip()]

    def postprocess(self, samples: list) -> None:
        """--reward-postprocess on the step's scored samples (groups of samples_per_prompt, in order)."""
        if self.postprocess_fn is not None and samples:
            out = self.postprocess_fn(samples)
            if out is not None:
                raise TypeError(f"--reward-postprocess returned {type(out).__name__}; it must edit the "
                                f"Samples in place and return None ({POSTPROCESS_SIGNATURE})")

    def keeps(self, samples: list) -> list[bool]:
        """--sample-filter's verdict on the step's scored samples (all True without one)."""
        if self.filter_fn is None or not samples:
            return [True] * len(samples)
        out = self.filter_fn(samples)
        if not (isinstance(out, (list, tuple)) and len(out) == len(samples)
                and all(isinstance(x, bool) for x in out)):
            raise TypeError(f"--sample-filter must return one bool per sample ({FILTER_SIGNATURE}), got "
                            f"{type(out).__name__} for {len(samples)} samples")
        return list(out)
