"""Configuration: one dataclass, a docstring per field; every flag of train.py is a field of `Config` or of
one of its feature groups.

Read the class top to bottom. Its first section holds the flags a GRPO run sets first; the most-used
flags (advantage, policy loss, ...) are top-level fields under `# --- title` comments, and each feature
(data format, reward model and judge, sampling, the vLLM engine, episodes, async rollout, KL, DAPO, ...)
is a small dataclass of its own (nanorl/config_groups.py; a loss's own settings are declared with the
loss, nanorl/losses.py). Flag names stay flat: `--lora-rank` is `cfg.lora.rank` (a group maps its fields
to flags by its PREFIX), and `Config.from_flags(lora_rank=8)` routes flat names to their groups (FLAGS).
`--help` shows one argument group per section and per group, in the class's order (`help_layout`). An
`--algo` preset (nanorl/presets.py) is a named set of flag values; flags given override it.

`__post_init__` rejects out-of-range values and flags that would do nothing, with a message naming the
flag: the top-level rules in nanorl/config_checks.py, and each group's own `check`, run only when the
group is moved from its defaults. It reads fields only: user code (--plugin, file.py:fn) is loaded and
checked at set-up, by nanorl/plugins.py `apply`, which returns the config with the plug-in's values
filled in.

    python train.py --help        # the flags by section, then every preset
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
from dataclasses import dataclass, field, fields

from nanorl import config_checks
from nanorl.config_checks import BUILTIN_ENV_NAMES, CHOICES, ConfigError  # noqa: F401 (read from here too)
from nanorl.config_groups import (
    DAPO,
    KL,
    AsyncRollout,
    Distillation,
    Episodes,
    Evaluation,
    Group,
    LoRA,
    LossParams,
    Memory,
    OffPolicy,
    Optimisation,
    Prompts,
    Sampling,
    Saving,
    Scorers,
    VLLMEngine,
)
from nanorl.presets import PRESETS, pretrained_defaults

# Rewards run in worker processes with this per-call timeout unless --reward-timeout says otherwise
# (nanorl/rewards.py reads it as BOUNDED): the math verifier (SymPy), which adversarial output can keep
# busy; the code reward, which bounds each test case itself (5 s, nanorl/code_reward.py) — 120 s per
# program, its cases run in parallel worker processes; a reasoning-gym task's checker (some parse or
# simulate the answer)
BOUNDED_REWARDS = {"math": 10.0, "math_format": 10.0, "code": 120.0, "reasoning_gym": 30.0}
# A user's reward (file.py:fn / module:fn) may hang on anything (a network call, a solver, a bug): by
# default it runs in worker processes too, and a call past this many seconds scores 0 and is counted
USER_REWARD_TIMEOUT = 60.0
# Fields with a fixed set of values: argparse offers them as choices, __post_init__ checks them


@dataclass
class Config:
    # --- start here: the flags a GRPO run sets first
    algo: str = "grpo"
    """Preset: a named set of the fields below (each listed at the end of --help; nanorl/presets.py)."""
    model: str = ""
    """Hugging Face name or local path of a causal LM, or a GGUF file (nanorl/gguf_model.py); empty = the
    built-in tiny Qwen2 (nanorl/task.py)."""
    train_data: str = ""
    """Prompts: a .jsonl / .parquet file, a `datasets` name[:config][@split] (split default train) or
    reasoning_gym:NAME?size=N&seed=S&... (nanorl/reasoning_tasks.py); empty = the built-in arithmetic
    task (nanorl/data.py)."""
    test_data: str = ""
    """Eval sets, comma-separated, each [name=]source in the same forms (split default test), logged
    as eval/<name>/...; empty = the built-in held-out split."""
    reward: str = "exact"
    """Reward: exact, math, format, math_format, exact_format, code, reasoning_gym (the task's checker),
    or module:function / file.py:function
    (fn(prompt, response, label[, sample]); dict keys starting with "_" are logged only)."""
    engine: str = "auto"
    """hf (the trainer's own module), vllm (in-process, weights hot-swapped), or auto: vllm on a GPU
    when importable, else hf (on CPU, vLLM's start-up and kernel compile cost more than a tiny run)."""
    steps: int = 800
    """Optimizer steps (one rollout batch each, times ppo_epochs × mini_batches)."""
    prompts_per_step: int = 16
    """Prompts sampled per optimizer step (over all ranks)."""
    samples_per_prompt: int = 8
    """Responses per prompt (the group size of GRPO/RLOO)."""
    max_new_tokens: int = 4
    """Longest response; longer ones are cut and marked truncated."""
    lr: float = 2e-4
    """AdamW learning rate (the built-in task's, docs/bench_results.md; pretrained models get 1e-6)."""
    kl_coef: float = 0.0
    """β of the KL to the reference policy (0 = no reference model at all; the grpo preset: 0.001)."""
    out_dir: str = "runs/nanorl"
    """Where metrics, checkpoints and the built-in task files go."""
    seed: int = 0
    """Seeds data order, sampling and the built-in model."""
    prompts: Prompts = field(default_factory=Prompts)
    """Data columns and the prompt's format (nanorl/config_groups.py Prompts)."""
    # --- reward and plug-ins (nanorl/rewards.py, nanorl/plugins.py, docs/extending.md)
    reward_timeout: float = -1.0
    """Seconds per reward call; > 0 runs rewards in worker processes and scores a hung call 0; 0 runs
    them in-process; -1 = 10 s for the math rewards, 120 s for code, 30 s for reasoning_gym
    (BOUNDED_REWARDS), 60 s for a user's file.py:fn (USER_REWARD_TIMEOUT), else 0."""
    reward_postprocess: str = ""
    """module:function / file.py:function run on the step's scored Samples (groups in order): may write
    Sample.metadata and set rewards, in place."""
    sample_filter: str = ""
    """module:function / file.py:function fn(samples) -> list[bool]: True keeps a scored sample; run after
    the rewards and before the advantages, on top of the default (failed samples never train)."""
    log_metadata: str = ""
    """Comma list of numeric Sample.metadata fields to log as step means under their own names; a name
    ending in "/" is a prefix (e.g. calib/)."""
    plugin: str = ""
    """file.py (or module) whose reward, reward_postprocess, advantage, policy_loss, LOG_METADATA, CONFIG
    (a dict of fields) and make_task(out_dir) fill the settings left at their defaults."""
    scorers: Scorers = field(default_factory=Scorers)
    """Reward model and LLM judge: reward components beside --reward."""
    sampling: Sampling = field(default_factory=Sampling)
    """Temperature, top-k, top-p."""
    vllm: VLLMEngine = field(default_factory=VLLMEngine)
    """The vLLM engine's settings (--engine vllm)."""
    # --- multi-turn environments (nanorl/env.py): the environment answers between turns, scores episodes
    env: str = ""
    """calc (the built-in task with a calculator; builds its own model without --model), python_tool
    (a Python-expression tool with ChatML tool calls, for chat models), or module:Class / file.py:Class;
    empty = single-turn responses scored by --reward."""
    agent: str = ""
    """file.py:fn or module:fn, an agent function run per episode against an OpenAI-compatible endpoint
    that serves the policy during rollouts; it returns the episode's reward (nanorl/agent.py, docs/agents.md).
    Without --model: the built-in task's calculator variant (its tokenizer has a chat template)."""
    episode: Episodes = field(default_factory=Episodes)
    """An --env episode's bounds and its tool calls' timeout."""
    pipeline: AsyncRollout = field(default_factory=AsyncRollout)
    """Asynchronous rollout (--async-steps) and partial rollouts."""
    # --- advantage estimator (nanorl/advantage.py)
    advantage: str = "grpo"
    """Advantage estimator (nanorl/advantage.py ADVANTAGE_ESTIMATORS), or a user one as file.py:fn."""
    gamma: float = 1.0
    """Discount (GAE, REINFORCE++, OTB)."""
    lam: float = 1.0
    """GAE λ."""
    vf_coef: float = 0.0
    """Value-loss coefficient; > 0 creates a critic (PPO, GAE)."""
    whiten_advantages: bool = True
    """Whiten the advantages over the batch where the estimator does (gae, reinforce_pp,
    reinforce_pp_baseline, gdpo); --no-whiten-advantages keeps them raw (slime's option)."""
    gdpo_weights: str = ""
    """GDPO: comma-separated weight per reward component, in the reward's component order (empty = all 1)."""
    # --- policy loss (nanorl/losses.py)
    policy_loss: str = "ppo"
    """Policy loss (nanorl/losses.py POLICY_LOSSES): ppo, gspo, cispo, gmpo, dppo_tv, dppo_kl, sapo,
    reinforce, gpg, dro, kl_cov, clip_cov; or a user one as file.py:fn."""
    loss_agg: str = "token-mean"
    """token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm."""
    clip_low: float = 0.2
    """Lower clip ε (ratio ≥ 1 − ε) or the loss's own lower bound."""
    clip_high: float = 0.2
    """Upper clip ε (ratio ≤ 1 + ε); DAPO's clip-higher raises it."""
    dual_clip: float = 3.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    top_entropy_quantile: float = 0.0
    """> 0: train only on the top q of the step's tokens by entropy (Wang et al. 2025, "80/20": 0.2)."""
    loss_params: LossParams = field(default_factory=LossParams)
    """Each policy loss's own settings (SAPO's, DRO's, KL-Cov / Clip-Cov's), declared with the loss."""
    kl: KL = field(default_factory=KL)
    """The KL term's estimator and placement (its β: kl_coef)."""
    distill: Distillation = field(default_factory=Distillation)
    """On-policy distillation from a --teacher."""
    dapo: DAPO = field(default_factory=DAPO)
    """DAPO's dynamic sampling and overlong handling."""
    offpolicy: OffPolicy = field(default_factory=OffPolicy)
    """Off-policy correction of π_old against the rollout policy."""
    optim: Optimisation = field(default_factory=Optimisation)
    """Epochs, mini-batches, the schedule and AdamW."""
    lora: LoRA = field(default_factory=LoRA)
    """LoRA adapters instead of full fine-tuning (--lora-rank)."""
    memory: Memory = field(default_factory=Memory)
    """Micro-batches, precision, threads, FSDP, routing replay."""
    evaluation: Evaluation = field(default_factory=Evaluation)
    """Held-out evaluation: when, how many, how sampled."""
    saving: Saving = field(default_factory=Saving)
    """Checkpoints, logs, rollout dumps."""

    def __post_init__(self):
        if self.reward_timeout == -1:
            user = USER_REWARD_TIMEOUT if ":" in self.reward else 0.0
            self.reward_timeout = BOUNDED_REWARDS.get(self.reward, user)
            # plugins.apply resolves it again when a plug-in changes the reward
            self._auto_reward_timeout = True
        config_checks.check(self)
        # a group's rules run when it is in use: moved from its defaults (which pass them)
        for name, group_class in GROUP_CLASSES.items():
            if getattr(self, name) != group_class():
                getattr(self, name).validate(self)
        # what an environment's or an agent's episodes make useless (after the groups' own rules)
        if self.env:
            config_checks.check_env(self)
        if self.agent:
            config_checks.check_agent(self)

    @classmethod
    def from_flags(cls, **flat) -> Config:
        """A Config from flat flag-name values (lora_rank=8 for --lora-rank 8): each routed to its group
        by the groups' declarations (FLAGS); the one way parse_args, presets, plug-ins and tests build
        one from flag names."""
        top, grouped = {}, {name: {} for name in GROUP_CLASSES}
        for name, value in flat.items():
            if name not in FLAGS:
                raise TypeError(f"Config.from_flags() got an unexpected keyword argument {name!r}")
            group, attr = FLAGS[name]
            (grouped[group] if group else top)[attr] = value
        return cls(**top, **{g: GROUP_CLASSES[g](**kw) for g, kw in grouped.items() if kw})

    def as_flags(self) -> dict:
        """{flag name: value} of every setting: from_flags' input, the form checkpoints save."""
        flat = {}
        for f in fields(self):
            value = getattr(self, f.name)
            flat.update(value.flags() if isinstance(value, Group) else {f.name: value})
        return flat

    def replace(self, **flat) -> Config:
        """A new, checked Config with these flag-name values changed (dataclasses.replace by flag)."""
        return Config.from_flags(**{**self.as_flags(), **flat})

    @staticmethod
    def flag_default(name: str):
        """The default of the flag `name` (a field of Config or of one of its groups)."""
        return FLAG_DEFAULTS[name]

    def check_estimator(self, fn) -> None:
        """The checks that read what a user advantage estimator `fn` declares (plugins.apply)."""
        config_checks.check_estimator(self, fn)

    @property
    def chat_template_dict(self) -> dict | None:
        """chat_template_kwargs parsed ({} when empty; None when it is not a JSON object)."""
        try:
            value = json.loads(self.prompts.chat_template_kwargs or "{}")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def episode_tokens(self) -> int:
        """--env: the most response tokens of one episode (0 without an environment)."""
        ep = self.episode
        return (ep.env_max_tokens or ep.env_max_turns * self.max_new_tokens) if self.env else 0

    @property
    def advantage_fn(self):
        """The estimator: a registry name as is, or the user function --advantage names."""
        return _user_fn(self.advantage, "advantage")

    @property
    def policy_loss_fn(self):
        """The policy loss: a registry name as is, or the user function --policy-loss names."""
        return _user_fn(self.policy_loss, "policy_loss")

    @property
    def uses_reference(self) -> bool:
        """A reference model exists only when a KL term is on, or --log-kl logs it."""
        return self.kl_coef > 0 or self.kl.log_kl


def _user_fn(spec: str, what: str):
    if ":" not in spec:
        return spec
    # user code: nanorl.plugins is imported only when a flag names a plug-in
    from nanorl.plugins import resolve
    return resolve(spec, what)


# the feature groups: Config field name -> its group class (nanorl/config_groups.py)
GROUP_CLASSES: dict[str, type] = {
    f.name: f.default_factory for f in fields(Config)
    if isinstance(f.default_factory, type) and issubclass(f.default_factory, Group)}
# flag name -> (the group's field name, or "" for a top-level field; the field's name in it)
FLAGS: dict[str, tuple[str, str]] = {
    f.name: ("", f.name) for f in fields(Config) if f.name not in GROUP_CLASSES}
FLAGS.update({cls.PREFIX + f.name: (group, f.name)
              for group, cls in GROUP_CLASSES.items() for f in fields(cls)})
FLAG_DEFAULTS: dict[str, object] = Config().as_flags()


def _documented_fields(cls) -> list[tuple[ast.AnnAssign, str]]:
    """(field node, docstring) of each field of `cls` that has one, in source order."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return [(node, doc.value.value) for node, doc in zip(body, body[1:]) if isinstance(node, ast.AnnAssign)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)]


def help_layout() -> list[tuple[str, list[tuple[str, str]]]]:
    """--help's argument groups in Config's source order, each with its (flag name, docstring) pairs: a
    top-level field goes under the `# --- title` comment above it, a feature group's fields under the
    group's TITLE (read from the sources: one source of truth for the classes and the help)."""
    source = inspect.getsource(Config)
    titles = [(i, line.strip()[6:]) for i, line in enumerate(source.splitlines(), 1)
              if line.strip().startswith("# --- ")]
    sections: list[tuple[str, list]] = []
    for node, doc in _documented_fields(Config):
        if node.target.id in GROUP_CLASSES:
            cls = GROUP_CLASSES[node.target.id]
            sections += [(shown.TITLE, [(cls.PREFIX + n.target.id, d) for n, d in _documented_fields(shown)])
                         for shown in cls.help_classes()]
            continue
        title = [t for line, t in titles if line < node.lineno][-1]
        if not sections or sections[-1][0] != title:
            sections.append((title, []))
        sections[-1][1].append((node.target.id, doc))
    return sections


def user_error_line(e: BaseException, prog: str = "train.py") -> str | None:
    """The one line the command line prints for a user's mistake, or None for anything else (a bug,
    which keeps its traceback). A mistake: a ConfigError (every `need` rule, a refused --out-dir), a
    ValueError whose message starts with "config: " (the convention of the checks outside
    config_checks, e.g. nanorl/plugins.py), or either as the cause of another rank's stop (several
    ranks: nanorl/distributed.py fail_together raises "rank R stopped because ..." from it). Field
    names in the message become the flags the user typed (lr → --lr)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConfigError) or (isinstance(e, ValueError) and str(e).startswith("config: ")):
            return f"{prog}: error: {_as_flags(str(e).removeprefix('config: '))}"
        e = e.__cause__
    return None


_FIELD_NAMES = sorted(FLAGS, key=len, reverse=True)


def _as_flags(msg: str) -> str:
    """msg on one line, its field names as flags: every name with an underscore (no English word has
    one), and a one-word name where it is a subject or an object (the message's first word, the word
    after a first "unknown", after "need(s)", or after "and" / "/" before "must" / "need(s)"):
    "gamma and lam must be ..." → "--gamma and --lam must be ..."; "a reward model" stays as it is."""
    msg = " ".join(msg.split())
    names = "|".join(re.escape(n) for n in _FIELD_NAMES if "_" in n)
    msg = re.sub(rf"(?<![-\w./:'])({names})(?![\w'])", lambda m: "--" + m.group(1).replace("_", "-"), msg)
    words = "|".join(re.escape(n) for n in _FIELD_NAMES if "_" not in n)
    msg = re.sub(rf"^({words})(?=[ :,])", r"--\1", msg)
    msg = re.sub(rf"^unknown ({words}) ", r"unknown --\1 ", msg)
    msg = re.sub(rf"\b(needs? )({words})\b(?![-\w])", r"\1--\2", msg)
    return re.sub(rf"(and |/ )({words})(?= must| need)", r"\1--\2", msg)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (its default prints the usage line first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


class _Help(argparse.Action):
    """-h / --help: the flags by section with their docstrings, read from the sources (help_layout)
    only now: a run parses its flags without them."""

    def __call__(self, parser, namespace, values, option_string=None):
        _make_parser(help_layout()).print_help()
        parser.exit()


def _make_parser(layout: list[tuple[str, list[tuple[str, str]]]]) -> _Parser:
    """The parser of every flag, in `layout`'s argument groups with its docstrings as help."""
    presets = "\n".join(f"  {k:<22} {v[0]}" for k, v in PRESETS.items())
    parser = _Parser(usage="%(prog)s [--algo PRESET] [--flag VALUE ...]", add_help=False,
                     description="nanorl: RL for language models. Every flag is a field of "
                     "nanorl/config.py; start with the first group.",
                     epilog="presets (--algo):\n" + presets,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = dict(FLAG_DEFAULTS)
    for i, (title, items) in enumerate(layout):
        group = parser.add_argument_group(title)
        if i == 0:
            group.add_argument("-h", "--help", action=_Help, nargs=0, default=argparse.SUPPRESS,
                               help="show this help message and exit")
        for name, doc in items:
            default = defaults.pop(name)
            # argparse %-formats help strings: a literal % is doubled
            kw = dict(default=argparse.SUPPRESS, help=f"{doc} (default {default!r})".replace("%", "%%"))
            if isinstance(default, bool):
                kw.update(action=argparse.BooleanOptionalAction)
            else:
                kw.update(type=type(default), choices=CHOICES.get(name),
                          metavar=None if name in CHOICES else name.upper())
            group.add_argument("--" + name.replace("_", "-"), **kw)
    # a field without a docstring, or above every section, would have no flag
    if defaults:
        raise RuntimeError(f"Config fields outside --help's groups: {sorted(defaults)}")
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Flags → Config: preset values first, then every flag the user actually gave. The flags parse
    in one undocumented group: only --help reads their sections and docstrings (_Help)."""
    parser = _make_parser([("flags", [(name, "") for name in FLAG_DEFAULTS])])
    given = vars(parser.parse_args(argv))
    algo = given.get("algo", Config.algo)
    if algo not in PRESETS:
        parser.error(f"unknown --algo {algo!r}; valid: {', '.join(PRESETS)}")
    base = pretrained_defaults(given.get("model", ""), set(given) | set(PRESETS[algo][1]))
    return Config.from_flags(**{**base, **PRESETS[algo][1], **given, "algo": algo})
