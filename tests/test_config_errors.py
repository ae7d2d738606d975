"""A user's mistake in the flags gets one line and exit status 2, a bug its traceback (issue 47).

Every `need(...)` rule of nanorl/config_checks.py is tripped by one case below (the cases are checked
to reach every rule, found in the file's source: a new rule needs a new case), and each case goes
through train.py's command-line entry (`train.cli`) in-process; one real `python train.py` run checks
the process itself. Programmatic callers (Config.from_flags(...), train.main) still get the exception.

    python -m pytest tests/test_config_errors.py -q
"""
import ast
import math
import os
import subprocess
import sys
import traceback

import pytest

import train
from nanorl import config_checks, config_groups
from nanorl.config import Config, parse_args, user_error_line
from nanorl.config_checks import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN, INF = math.nan, math.inf


# user advantage estimators, for the rules only a user estimator reaches (plugins.apply checks them)
def reads_teacher_only(teacher_logprobs, mask):
    return teacher_logprobs, teacher_logprobs


def reads_no_reward(mask):
    return mask, mask


USER = "user.py:fn"  # a user estimator's spec: the Config leaves it to check_estimator
CALC = dict(env="calc", max_new_tokens=12)
JUDGE = dict(judge="{response}", judge_model="m")
# (Config fields, a user estimator to check against them or None); each trips one rule first
CASES = [
    (dict(algo="nope"), None),
    # the feature groups' shared rules (nanorl/config_groups.py Group): finite numbers, choices, ranges
    (dict(tis_cap=NAN), None),
    (dict(schedule="linear"), None),
    (dict(ppo_epochs=0), None),
    (dict(entropy_coef=-1.0), None),
    (dict(sync_check_every=-1), None),
    (dict(kl_target=-1.0), None),
    (dict(opsm_delta=-1.0), None),
    (dict(async_steps=1, partial_rollout="abort"), None),
    (dict(clip_low=NAN), None),
    (dict(judge="{response}"), None),
    (dict(judge_model="m"), None),
    (dict(JUDGE, judge_url="ftp://h"), None),
    (dict(JUDGE, judge_url="http://h/v1", judge_concurrency=0), None),
    (dict(JUDGE, judge_retries=1), None),
    (dict(JUDGE, judge_parse="maybe"), None),
    (dict(reward_weights="correct"), None),
    (dict(reward_weights="correct=0"), None),
    (dict(reward_model="rm", env="calc", max_new_tokens=16), None),
    (dict(reward_postprocess="nope"), None),
    (dict(train_data="reasoning_gym:leg_counting"), None),
    (dict(reward="reasoning_gym"), None),
    (dict(log_metadata="a,,b"), None),
    (dict(advantage="nope"), None),
    (dict(loss_agg="nope"), None),
    (dict(engine="tpu"), None),
    (dict(gpu_memory_utilization=1.5), None),
    (dict(kv_cache_gb=-1.0), None),
    (dict(max_model_len=2), None),
    (dict(steps=0), None),
    (dict(prompt_template="no placeholder"), None),
    (dict(chat_template_kwargs="[1]"), None),
    (dict(top_k=-1), None),
    (dict(top_p=0.0), None),
    (dict(adam_beta2=1.0), None),
    (dict(adam_eps=0.0), None),
    (dict(dump_rollouts_mb=0.0), None),
    (dict(debug_rollout_only=True, async_steps=1), None),
    (dict(temperature=0.0), None),
    (dict(lr=0.0), None),
    (dict(dual_clip=0.5), None),
    (dict(gamma=2.0), None),
    (dict(routing_replay=True, old_logprobs="rollout"), None),
    (dict(overwrite=True, resume="latest"), None),
    (dict(fsdp=True, routing_replay=True), None),
    (dict(mini_batches=1000), None),
    (dict(advantage="gdpo", gdpo_weights="a"), None),
    (dict(distill_coef=-1.0), None),
    (dict(distill_coef=0.5), None),
    (dict(kl_in_reward=True), None),
    (dict(unbiased_kl=True), None),
    (dict(kl_target=0.1), None),
    (dict(log_kl=True, kl_coef=0.1), None),
    (dict(sapo_tau_pos=0.0), None),
    (dict(sapo_tau_pos=2.0), None),
    (dict(cov_ratio=0.5), None),
    (dict(policy_loss="kl_cov", cov_ratio=2.0), None),
    (dict(top_entropy_quantile=2.0), None),
    (dict(tis_cap=0.5), None),
    (dict(tis_low=0.5), None),
    (dict(mis_high=0.5), None),
    (dict(is_level="x"), None),
    (dict(is_level="sequence"), None),
    (dict(max_gen_batches=0), None),
    (dict(max_gen_batches=5), None),
    (dict(over_sample=0), None),
    (dict(over_sample=2), None),
    (dict(partial_rollout="abort"), None),
    (dict(over_sample=2, filter_groups=True, routing_replay=True), None),
    (dict(over_sample=2, partial_rollout="abort", routing_replay=True), None),
    (dict(CALC, over_sample=2, filter_groups=True), None),
    (dict(overlong_buffer=1.0), None),
    (dict(overlong_penalty=0.0), None),
    (dict(overlong_penalty=2.0), None),
    (dict(env_max_turns=2), None),
    (dict(env="nope"), None),
    (dict(CALC, env_max_turns=0), None),
    (dict(CALC, tool_timeout=-2.0), None),
    (dict(CALC, reward="math"), None),
    (dict(CALC, overlong_buffer=0.2), None),
    (dict(env="calc"), None),
    (dict(async_steps=-1), None),
    (dict(async_steps=1, mask_offpolicy_in_partial_rollout=True), None),
    (dict(rollout_device="cpu"), None),
    (dict(async_steps=1, rollout_device="tpu0"), None),
    (dict(advantage="opd"), None),
    (dict(advantage="opd", teacher="t", distill_coef=0.5), None),
    (dict(teacher="t"), None),
    (dict(teacher="t", distill_coef=0.5, async_steps=1), None),
    (dict(advantage=USER, teacher="t", kl_in_reward=True, kl_coef=0.1), reads_teacher_only),
    (dict(advantage=USER), reads_no_reward),
    (dict(advantage="gae"), None),
    (dict(gamma=0.9), None),
    (dict(lam=0.9), None),
    (dict(whiten_advantages=False), None),
    (dict(gdpo_weights="1"), None),
    (dict(advantage="grpo_passk", kl_in_reward=True, kl_coef=0.1), None),
    (dict(advantage="gdpo", reward_weights="correct=0", reward_model="rm"), None),
    (dict(advantage="remax", filter_groups=True), None),
    (dict(advantage="remax", reward_postprocess="m:f"), None),
    (dict(advantage="remax", partial_rollout="abort", over_sample=2, async_steps=1), None),
    (dict(lora_rank=-1), None),
    (dict(lora_alpha=0.0), None),
    (dict(lora_dropout=1.0), None),
    (dict(lora_target_modules="a,,b"), None),
    (dict(lora_sync="adapter"), None),
    (dict(lora_sync="adapter", lora_rank=1024, engine="vllm"), None),
    (dict(lora_alpha=16.0), None),
    (dict(lora_rank=8, fsdp=True), None),
    (dict(agent="agent.py"), None),  # --agent: no function named
    (dict(agent="agent.py:fn", env="calc", max_new_tokens=16), None),
    (dict(agent="agent.py:fn", reward="math"), None),
    (dict(agent="agent.py:fn", filter_groups=True), None),
]


def case_id(case) -> str:
    kw, fn = case
    return ",".join(f"{k}={v}" for k, v in kw.items()) + (f"+{fn.__name__}" if fn else "")


def trip(kw: dict, fn) -> ConfigError:
    """The ConfigError the case raises: building the Config, or checking the user estimator on it."""
    with pytest.raises(ConfigError) as e:
        cfg = Config.from_flags(**kw)
        if fn is not None:
            config_checks.check_estimator(cfg, fn)
    return e.value


# the files of the rules: the top-level ones and the feature groups' own checks
RULE_FILES = (config_checks.__file__, config_groups.__file__)


def need_sites() -> list[tuple[str, int, int]]:
    """(file, first, last source line) of every need(...) call in the rule files."""
    return sorted((path, n.lineno, n.end_lineno) for path in RULE_FILES
                  for n in ast.walk(ast.parse(open(path).read()))
                  if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "need")


def site_of(e: ConfigError) -> tuple[str, int, int]:
    """The need(...) call that raised e (the frame below need itself)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename in RULE_FILES]
    assert frames[-1].name == "need"
    path, line = frames[-2].filename, frames[-2].lineno
    return next(s for s in need_sites() if s[0] == path and s[1] <= line <= s[2])


def test_the_cases_trip_every_need_rule():
    tripped = {site_of(trip(kw, fn)) for kw, fn in CASES}
    missing = [s for s in need_sites() if s not in tripped]
    assert not missing, f"need(...) rules at lines {missing} of config_checks.py: add a case that trips each"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_each_rule_is_one_line_and_exit_2_on_the_command_line(case, monkeypatch, capsys):
    kw, fn = case
    error = trip(kw, fn)
    assert isinstance(error, ValueError) and str(error).startswith("config: ")  # programmatic callers

    def main(argv):
        raise error
    monkeypatch.setattr(train, "main", main)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        train.cli([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("train.py: error: ") and "--" in err and "Traceback" not in err, err


def test_field_names_become_flags_in_the_line():
    line = user_error_line(trip(dict(judge="{response}"), None))
    assert line == "train.py: error: --judge needs --judge-model (the served or the local model)"
    line = user_error_line(trip(dict(gamma=2.0), None))
    assert line == "train.py: error: --gamma and --lam must be in [0, 1]"
    # a word that is also a field stays a word where it is not the subject
    assert "a --reward" not in user_error_line(ConfigError("config: x needs a reward model"))


def test_a_bug_keeps_its_traceback(monkeypatch):
    for bug in (KeyError("k"), ValueError("not a config message"), RuntimeError("boom")):
        assert user_error_line(bug) is None

        def main(argv, bug=bug):
            raise bug
        monkeypatch.setattr(train, "main", main)
        with pytest.raises(type(bug)):
            train.cli([])


def test_another_ranks_stop_caused_by_a_user_mistake_is_one_line():
    # several ranks: fail_together raises "rank R stopped because ..." from the rank's own error
    try:
        try:
            raise trip(dict(lr=0.0), None)
        except ConfigError as e:
            raise RuntimeError("rank 1 stopped because rank 0 failed: ConfigError: ...") from e
    except RuntimeError as stopped:
        assert user_error_line(stopped) == "train.py: error: --lr must be > 0, got 0.0"


def test_argparse_errors_are_one_line_too(capsys):
    for argv in (["--lr", "x"], ["--engine", "tpu"], ["--no-such-flag"], ["--algo", "nope"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and ": error: " in err, (argv, err)


def test_train_py_prints_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--clip-low", "nan"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == "train.py: error: --clip-low must be a finite number, got nan\n"
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- the rules of issue 47


FLOAT_FIELDS = [name for name, value in Config().as_flags().items() if isinstance(value, float)]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_flag_must_be_finite(name):
    for bad in (NAN, INF, -INF):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be a finite number"):
            Config.from_flags(**{name: bad})


def test_weights_in_strings_must_be_finite_too():
    with pytest.raises(ConfigError, match="reward_weights must be name=number pairs"):
        Config.from_flags(reward_model="rm", reward_weights="correct=nan")
    with pytest.raises(ConfigError, match="gdpo_weights must be comma-separated numbers"):
        Config.from_flags(advantage="gdpo", gdpo_weights="1,inf")


def test_routing_replay_refuses_rollout_logprobs():
    with pytest.raises(ConfigError, match="--routing-replay computes π_old .* --old-logprobs rollout"):
        Config.from_flags(routing_replay=True, old_logprobs="rollout")
    for mode in ("auto", "recompute"):
        assert Config.from_flags(routing_replay=True, old_logprobs=mode).memory.routing_replay


def test_fsdp_with_async_steps_is_built_not_refused():
    # no longer a refusal: each version is gathered from the shards (nanorl/pipeline.py,
    # tests/test_async_fsdp.py)
    cfg = Config.from_flags(fsdp=True, async_steps=1)
    assert cfg.memory.fsdp and cfg.pipeline.async_steps == 1
    assert Config.from_flags(fsdp=True, async_steps=2, engine="vllm").pipeline.async_steps == 2


def test_reward_weights_need_a_reward_model_or_judge():
    with pytest.raises(ConfigError, match="--reward-weights weighs --reward against"):
        Config.from_flags(reward_weights="correct=0,other=0")
    assert Config.from_flags(reward_model="rm", reward_weights="correct=0,rm=1").scorers.reward_weights
    assert Config.from_flags(reward_weights="correct=0", **JUDGE).scorers.reward_weights


def test_partial_rollout_without_async_steps_is_built_not_refused():
    """--partial-rollout abort without --async-steps once needed an async worker; the synchronous step
    now over-samples and buffers itself (nanorl/sources.py Partial, tests/test_sync_partial.py)."""
    cfg = Config.from_flags(partial_rollout="abort", over_sample=2)
    assert cfg.pipeline.partial_rollout == "abort" and cfg.pipeline.async_steps == 0
