"""The config a newcomer scans (nanorl/config.py): `train.py --help` opens with the flags a GRPO run sets
first, then one group per `# --- section` of Config, every field exactly once; building a Config imports
no higher-level module and loads no user file (plug-ins are resolved at set-up, nanorl/plugins.py apply);
the checks moved in from tool_envs / pipeline / plugins still raise, each naming its field.

    python -m pytest tests/test_config.py -q
"""
import argparse
import os
import re
import subprocess
import sys
import textwrap

import pytest

from nanorl import plugins
from nanorl.config import (
    BOUNDED_REWARDS,
    BUILTIN_ENV_NAMES,
    CHOICES,
    GROUP_CLASSES,
    Config,
    help_layout,
    parse_args,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = list(Config().as_flags())  # every flag: the top-level fields and the groups' (by flag name)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.fixture(scope="module")
def help_lines(tmp_path_factory) -> list[str]:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path_factory.mktemp("help"),
                         env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "110"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


def defined_at(lines: list[str], name: str) -> list[int]:
    """The --help lines where the flag of field `name` is defined (not merely mentioned in a help text)."""
    pattern = re.compile(rf"^  {re.escape(flag(name))}(?=[ ,]|$)")
    return [i for i, line in enumerate(lines) if pattern.match(line)]


def test_help_opens_with_the_grpo_group(help_lines):
    (first_title, first), *rest = help_layout()
    first_names = [name for name, _ in first]
    # ~a dozen flags, the ones the README's GRPO commands and a first run set
    assert 12 <= len(first_names) <= 16
    assert {"algo", "model", "train_data", "test_data", "reward", "steps", "prompts_per_step",
            "samples_per_prompt", "max_new_tokens", "lr", "kl_coef"} <= set(first_names)
    # the usage line does not list 108 flags before the groups
    assert help_lines[0].startswith("usage:") and len(help_lines[0]) < 80
    headings = [i for i, line in enumerate(help_lines)
                if line and not line.startswith(" ") and line.endswith(":")]
    assert help_lines[headings[0]] == first_title + ":"
    last_first = max(defined_at(help_lines, n)[0] for n in first_names)
    first_other = min(defined_at(help_lines, n)[0] for _, items in rest for n, _ in items)
    assert last_first < first_other
    # and nothing of another group's heading sits between the first group's flags
    assert all(not (headings[0] < h < last_first) for h in headings[1:])


def test_every_field_appears_exactly_once_in_help(help_lines):
    for name in FIELDS:
        assert len(defined_at(help_lines, name)) == 1, name
    # a boolean keeps its --no- form
    assert any(line.startswith("  --chat-template, --no-chat-template") for line in help_lines)
    # the presets epilog stays
    epilog = help_lines.index("presets (--algo):")
    from nanorl.presets import PRESETS
    assert [line.split()[0] for line in help_lines[epilog + 1:] if line.strip()] == list(PRESETS)


def test_help_groups_are_the_sections_of_config_in_order(help_lines):
    source = open(os.path.join(ROOT, "nanorl", "config.py"), encoding="utf-8").read()
    # a `# --- title` comment, or a feature group's field (its class's TITLE), in the source's order
    found = re.findall(r"^    # --- (.+)$|^    (\w+): \w+ = field\(default_factory=", source, re.M)
    sections = [t for title, group in found
                for t in ([title] if title else [c.TITLE for c in GROUP_CLASSES[group].help_classes()])]
    layout = help_layout()
    assert [title for title, _ in layout] == sections
    # each field in exactly one group, in the class's order
    assert [name for _, items in layout for name, _ in items] == FIELDS
    headings = [line[:-1] for line in help_lines if line and not line.startswith(" ") and line.endswith(":")]
    assert [h for h in headings if h in sections] == sections
    # each algorithm's own knobs sit in a group of their own
    # (declared where the loss is registered: nanorl/losses.py), each under its loss
    own = dict(layout)
    assert [n for n, _ in own["SAPO's gate (--policy-loss sapo)"]] == ["sapo_tau_pos", "sapo_tau_neg"]
    assert [n for n, _ in own["DRO's penalty (--policy-loss dro)"]] == ["dro_beta"]
    cov = own["KL-Cov / Clip-Cov's token selection (--policy-loss kl_cov or clip_cov)"]
    assert [n for n, _ in cov] == ["cov_ratio", "cov_kl_coef"]


def test_every_flag_keeps_its_name_default_and_type():
    # no flag renamed: the parser holds exactly --<field> (and --no-<field> for booleans)
    parser_flags = set()
    original = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        parser_flags.update(s for a in self._actions for s in a.option_strings)
        return original(self, args, namespace)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("argparse.ArgumentParser.parse_args", grab)
        cfg = parse_args([])
    bools = [n for n in FIELDS if isinstance(Config.flag_default(n), bool)]
    want = {flag(n) for n in FIELDS} | {"--no-" + flag(n)[2:] for n in bools}
    assert parser_flags == want | {"-h", "--help"}
    # defaults: Config's, then the grpo preset's
    from nanorl.presets import PRESETS
    assert cfg == Config.from_flags(**PRESETS["grpo"][1])
    typed = parse_args(["--algo", "ppo", "--steps", "3", "--lr", "0.5", "--no-whiten-advantages", "--engine",
                        "hf", "--sleep-level", "1"])
    got = (typed.steps, typed.lr, typed.whiten_advantages, typed.engine, typed.vllm.sleep_level)
    assert got == (3, 0.5, False, "hf", 1)


def test_choices_are_checked_by_argparse_and_by_config(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--engine", "tpu"])
    assert e.value.code == 2 and "--engine" in capsys.readouterr().err
    for name, choices in CHOICES.items():
        with pytest.raises(ValueError, match=f"config: {name} must be one of"):
            Config.from_flags(**{name: "nope"})


def test_building_a_config_imports_no_higher_level_module_and_loads_no_user_file(tmp_path):
    # a plug-in file that leaves a mark when it is imported
    mark = tmp_path / "imported"
    user = tmp_path / "user_plugin.py"
    user.write_text(f"open({str(mark)!r}, 'w').close()\n"
                    "CONFIG = {'temperature': 0.5}\n"
                    "def reward(prompt, response, label): return 0.0\n"
                    "def reward_postprocess(samples): pass\n")
    code = textwrap.dedent(f"""
        import sys
        from nanorl.config import Config, parse_args
        Config()
        parse_args(["--algo", "ppo"])
        Config.from_flags(env="calc", max_new_tokens=12)
        Config.from_flags(async_steps=1, rollout_device="cpu", partial_rollout="abort", over_sample=2)
        c = Config.from_flags(plugin={str(user)!r}, reward={str(user)!r} + ":reward",
                   reward_postprocess={str(user)!r} + ":reward_postprocess", log_metadata="a,b/")
        assert c.sampling.temperature == 1.0, c.sampling.temperature
        Config.from_flags(reward="math")
        print(sorted(m for m in sys.modules if m.startswith("nanorl")))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    for module in ("nanorl.plugins", "nanorl.rewards", "nanorl.tool_envs", "nanorl.pipeline"):
        assert module not in loaded, (module, loaded)
    assert not mark.exists()


PLUGIN = """
    CONFIG = {"temperature": 0.9}
    LOG_METADATA = "toy/"

    def reward(prompt, response, label):
        return float(response.strip() == label)

    def advantage(*, mask, index, scores):
        return scores[:, None] * mask, scores[:, None] * mask
    """


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_plugin_is_resolved_at_setup_not_while_the_config_is_built(tmp_path):
    f = write(tmp_path, "toy.py", PLUGIN)
    parsed = parse_args(["--plugin", f])
    # the parsed config holds the flags as given
    got = (parsed.reward, parsed.advantage, parsed.sampling.temperature, parsed.log_metadata)
    assert got == ("exact", "grpo", 1.0, "")
    cfg = plugins.apply(parsed)
    assert (cfg.reward, cfg.advantage, cfg.sampling.temperature, cfg.log_metadata) == (
        f"{f}:reward", f"{f}:advantage", 0.9, "toy/")
    assert cfg.advantage_fn is plugins.load_object(f"{f}:advantage", "advantage")
    # idempotent; a config without plug-ins comes back as is
    assert plugins.apply(cfg) == cfg
    plain = Config()
    assert plugins.apply(plain) is plain
    # a flag that disagrees with the plug-in is an error at set-up, naming the field
    with pytest.raises(ValueError, match="sets temperature=0.9, but temperature is already 0.7"):
        plugins.apply(parse_args(["--plugin", f, "--temperature", "0.7"]))
    # the filled config is validated again: --env makes the plug-in's reward a flag that does nothing
    with pytest.raises(ValueError, match="--reward does nothing with --env"):
        plugins.apply(Config.from_flags(plugin=f, env="calc", max_new_tokens=12))


def test_reward_timeout_default_is_resolved_for_the_plugins_reward(tmp_path):
    assert Config.from_flags(reward="math").reward_timeout == BOUNDED_REWARDS["math"] > 0
    from nanorl import rewards
    assert rewards.BOUNDED is BOUNDED_REWARDS
    math_plugin = write(tmp_path, "m.py", "CONFIG = {'reward': 'math'}\n")
    assert Config.from_flags(plugin=math_plugin).reward_timeout == 0.0
    # -1 resolved again once the plug-in chose the math reward
    assert plugins.apply(Config.from_flags(plugin=math_plugin)).reward_timeout == BOUNDED_REWARDS["math"]
    # a plug-in's own timeout is no conflict with the resolved default, but is with a flag
    timed = write(tmp_path, "t.py", "CONFIG = {'reward_timeout': 5.0}\n")
    assert plugins.apply(Config.from_flags(plugin=timed)).reward_timeout == 5.0
    with pytest.raises(ValueError, match="reward_timeout is already 3.0"):
        plugins.apply(Config.from_flags(plugin=timed, reward_timeout=3.0))
    # the user's explicit 0 survives a plug-in that changes the reward
    assert plugins.apply(Config.from_flags(plugin=math_plugin, reward_timeout=0.0)).reward_timeout == 0.0


def test_builtin_env_names_are_the_environments_of_tool_envs():
    from nanorl.tool_envs import BUILTIN_ENVS
    assert set(BUILTIN_ENVS) == set(BUILTIN_ENV_NAMES)


MOVED_CHECKS = [
    # from tool_envs.check_config
    (dict(env_max_turns=2), "env_max_turns only shape --env episodes"),
    (dict(tool_timeout=3.0), "tool_timeout only shape --env episodes"),
    (dict(env="nope"), r"--env 'nope': expected one of \['calc', 'python_tool'\]"),
    (dict(env="calc", max_new_tokens=12, env_max_turns=0), "env_max_turns must be >= 1"),
    (dict(env="calc", max_new_tokens=12, tool_timeout=-2.0), "tool_timeout must be >= 0 or -1"),
    (dict(env="calc", max_new_tokens=12, reward="math"), "--reward does nothing with --env"),
    (dict(env="calc", max_new_tokens=12, reward_timeout=4.0), "--reward-timeout does nothing with --env"),
    (dict(env="calc", max_new_tokens=12, overlong_buffer=0.2), "--overlong-buffer measures one response"),
    (dict(env="calc"), "--env calc needs --max-new-tokens >= 12"),
    # from pipeline.check_config
    (dict(async_steps=-1), "async_steps must be >= 0"),
    (dict(partial_rollout="abort"), "--partial-rollout abort needs --over-sample >= 2"),
    (dict(async_steps=1, mask_offpolicy_in_partial_rollout=True), "needs partial_rollout"),
    (dict(rollout_device="cpu"), "rollout_device needs async_steps"),
    (dict(async_steps=1, rollout_device="tpu0"), "rollout_device 'tpu0' is not a device"),
    (dict(async_steps=1, partial_rollout="abort", over_sample=2, advantage="remax"),
     "--partial-rollout with --advantage remax"),
    # from plugins.check_config: the forms of the plug-in flags
    (dict(reward_postprocess="nope"), "reward_postprocess must be module:function"),
    (dict(reward_postprocess="m:f", advantage="remax"), "reward_postprocess with advantage remax"),
    (dict(log_metadata="a,,b"), "log_metadata: an empty name"),
    # the judge's endpoint settings
    (dict(judge="{response}", judge_model="m", judge_retries=1), "judge_retries: settings of the calls to "
     "judge_url"),
    (dict(judge="{response}", judge_model="m", judge_url="http://h/v1", judge_concurrency=0),
     "judge_concurrency must be >= 1"),
]


@pytest.mark.parametrize("kw,message", MOVED_CHECKS, ids=[m[:40] for _, m in MOVED_CHECKS])
def test_each_moved_check_still_raises_with_its_message(kw, message):
    with pytest.raises(ValueError, match="^config: .*" + message):
        Config.from_flags(**kw)


def test_the_moved_checks_pass_what_is_allowed():
    assert Config.from_flags(env="calc", max_new_tokens=12, env_max_turns=3).episode_tokens == 36
    # a reward_timeout of 0 with --env is fine (the environment scores; rewards run in-process)
    assert Config.from_flags(env="calc", max_new_tokens=12, reward_timeout=0.0).env == "calc"
    assert Config.from_flags(env="my_env.py:MyEnv").env == "my_env.py:MyEnv"
    cfg = Config.from_flags(async_steps=2, partial_rollout="abort", over_sample=2,
                 mask_offpolicy_in_partial_rollout=True, rollout_device="cpu")
    assert cfg.pipeline.async_steps == 2
    # without --async-steps: partial rollouts in the synchronous step (nanorl/sources.py Partial)
    cfg = Config.from_flags(partial_rollout="abort", over_sample=2, mask_offpolicy_in_partial_rollout=True)
    assert cfg.pipeline.async_steps == 0 and cfg.pipeline.partial_rollout == "abort"
    # --env's episodes are aborted and resumed too (nanorl/episodes.py), with or without --async-steps
    cfg = Config.from_flags(partial_rollout="abort", over_sample=2, env="calc", max_new_tokens=12)
    assert cfg.env == "calc"
    assert Config.from_flags(reward_postprocess="m:f", log_metadata="a, b/").log_metadata == "a, b/"
