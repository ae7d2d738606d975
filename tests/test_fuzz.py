"""Fuzz-style tests of the data and reward paths: malformed input always ends in a clear nanorl error
(DataError naming the file and line, or the row and key) or a counted skip — never a traceback from
deep inside a library. Run: python -m pytest tests/test_fuzz.py -q
"""
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanorl import rewards
from nanorl.data import DataError, build_prompts, load_rows
from nanorl.task import build_tokenizer
from nanorl.trajectory import Sample, collate

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKENIZER = build_tokenizer()


def load(path, max_len=64):
    """The whole data path of train.py: rows, then tokenised prompts."""
    return build_prompts(load_rows(str(path)), TOKENIZER, "prompt", "answer", max_len, source=str(path))


def outcome(path, max_len=64):
    """("ok", prompts, skipped) or ("error", message); any other exception fails the test."""
    try:
        prompts, skipped = load(path, max_len)
        return "ok", prompts, skipped
    except DataError as e:
        return "error", str(e)


# ----------------------------------------------------------------------------- data


@SETTINGS
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=6))
def test_random_bytes_in_jsonl(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines))
    res = outcome(path)
    if res[0] == "error":
        assert str(path) in res[1]


scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8)
rows = st.dictionaries(st.sampled_from(["prompt", "answer", "other"]),
                       json_values | st.text(alphabet="0123456789+-=", max_size=8))


@SETTINGS
@given(st.lists(rows | json_values, min_size=1, max_size=6))
def test_wrong_types_and_missing_keys(tmp_path, items):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    res = outcome(path)
    if res[0] == "error":
        assert re.search(rf"{re.escape(str(path))}(:\d+|: row \d+|: no usable)", res[1]), res[1]
    else:
        assert all(p.ids and isinstance(p.label, str) for p in res[1])


GOOD = json.dumps({"prompt": "1+2=", "answer": "3"})
CASES = {  # name: (file content, expected error regex or None when it loads)
    "invalid_utf8": (b'{"prompt": "\xff\xfe", "answer": "1"}\n', r":1: not a valid JSON line"),
    "nul_bytes": (b'\x00\x00\x00\n', r":1: not a valid JSON line"),
    "truncated_json": (GOOD[:-3].encode() + b"\n", r":1: not a valid JSON line"),
    "second_line_bad": ((GOOD + "\n{oops\n").encode(), r":2: not a valid JSON line"),
    "deep_nesting": (b"[" * 100_000 + b"]" * 100_000 + b"\n", r":1: not a valid JSON line.*Recursion"),
    "huge_garbage_line": (b"x" * 5_000_000 + b"\n", r":1: not a valid JSON line"),
    "huge_int": (b'{"prompt": "1+1=", "answer": ' + b"9" * 5000 + b"}\n", r":1: not a valid JSON line"),
    "json_array": (b"[1, 2]\n", r":1: expected a JSON object, got list"),
    "missing_key": (b'{"question": "1+1=", "answer": "2"}\n',
                    r"row 1 has no key 'prompt'; keys present: \['answer', 'question'\]"),
    "prompt_not_str": (b'{"prompt": 12, "answer": "2"}\n',
                       r"row 1: the prompt must be a string or a non-empty list of .*messages, got '12'"),
    "null_label": (b'{"prompt": "1+1=", "answer": null}\n', r"row 1: 'answer' is null"),
    "lone_surrogate": (b'{"prompt": "\\ud800", "answer": "1"}\n',
                       r"row 1: the tokenizer cannot encode 'prompt'"),
    "only_empty_prompts": (b'{"prompt": "  ", "answer": "1"}\n',
                           r"no usable prompt left \(skipped \{'empty': 1"),
    "empty_file": (b"", r"no usable prompt left"),
    "bom_and_blank_lines": (b"\xef\xbb\xbf" + GOOD.encode() + b"\n\n  \n", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_files(tmp_path, name):
    content, expected = CASES[name]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    res = outcome(path)
    if expected is None:
        assert res[0] == "ok" and [p.label for p in res[1]] == ["3"]
    else:
        assert res[0] == "error" and str(path) in res[1] and re.search(expected, res[1]), res


def test_huge_prompt_is_skipped_and_counted(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "1+" * 200_000 + "1=", "answer": "x"}) + "\n" + GOOD + "\n")
    status, prompts, skipped = outcome(path)
    assert status == "ok" and len(prompts) == 1 and skipped == {"empty": 0, "too_long": 1}


@pytest.mark.parametrize("name", ["corrupt.parquet", "missing.parquet", "missing.jsonl", "not_a_dataset_dir"])
def test_unreadable_sources(tmp_path, name):
    path = tmp_path / name
    if name == "corrupt.parquet":
        path.write_bytes(b"PAR1 this is not parquet")
    elif name == "not_a_dataset_dir":
        path.mkdir()
        (path / "junk.bin").write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match=re.escape(str(path))):
        load(path)


# ----------------------------------------------------------------------------- rewards

NASTY = ["\\boxed{" + "1" * 5000 + "/3}", "1" * 5000 + ".5", "#### " + "9" * 4500, "\\boxed{1/0}", "\\boxed{",
         "\\frac{1}{0}", "-0.0", "1,234,567.000", "x" * 100_000 + "7", "\\boxed{\\boxed{2}}",
         "\x00\ud7ff\U0010ffff"]


def flat(v) -> list:
    return list(v.values()) if isinstance(v, dict) else [v]


# the code reward's label is a test specification and reasoning_gym's its item's JSON: a malformed one is
# a data error they raise on (a counted fault); both are fuzzed below with any response and a valid label
TEXT_REWARDS = [name for name in rewards.BUILTIN if name not in ("code", "reasoning_gym")]


@pytest.mark.parametrize("name", TEXT_REWARDS)
@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=40) | st.sampled_from(NASTY),
                          st.text(max_size=10) | st.integers().map(str) | st.sampled_from(NASTY)),
                min_size=1, max_size=6))
def test_builtin_rewards_never_fault(name, pairs):
    """Built-in rewards score any text: no exception (not even a counted one), results in [0, 1]."""
    runner = rewards.RewardRunner(rewards.BUILTIN[name], log=lambda s: None)
    out = runner([""] * len(pairs), [r for r, _ in pairs], [lab for _, lab in pairs])
    assert not runner.faults, dict(runner.faults)
    assert len(out) == len(pairs)  # one reward per response: the loop below checks each
    for v in out:
        assert all(isinstance(x, float) and 0.0 <= x <= 1.0 for x in flat(v)), v


@settings(max_examples=15, deadline=None)
@given(st.lists(st.text(max_size=60) | st.sampled_from(NASTY) | st.just("```python\nprint(2)\n```"),
                min_size=1, max_size=4))
def test_code_reward_scores_any_response_with_valid_tests(responses):
    """Any response text against a valid test label: no fault, a score in [0, 1]."""
    runner = rewards.RewardRunner(rewards.BUILTIN["code"], log=lambda s: None)
    out = runner([""] * len(responses), responses, ['{"inputs": [""], "outputs": ["2"]}'] * len(responses))
    assert not runner.faults, dict(runner.faults)
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in out), out


@settings(max_examples=15, deadline=None)
@given(st.lists(st.text(max_size=60) | st.sampled_from(NASTY) | st.just("<answer>1</answer>"),
                min_size=1, max_size=4))
def test_reasoning_gym_reward_scores_any_response_with_a_valid_label(responses):
    """Any response text against a real reasoning-gym label: no fault, a score in [0, 1]."""
    pytest.importorskip("reasoning_gym")
    from nanorl import reasoning_tasks
    rows = reasoning_tasks.load_rows("basic_arithmetic?size=1&max_terms=2&max_digits=1", "train")
    label = rows[0]["answer"]
    runner = rewards.RewardRunner(rewards.BUILTIN["reasoning_gym"], log=lambda s: None)
    out = runner([""] * len(responses), responses, [label] * len(responses))
    assert not runner.faults, dict(runner.faults)
    assert len(out) == len(responses) and all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in out), out


returned = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(),
                     st.floats(-2e9, 2e9),
                     st.text(max_size=5), st.lists(st.floats(), max_size=2), st.just(10**400),
                     st.dictionaries(st.sampled_from(["correct", "format"]),
                                     st.floats() | st.text(max_size=3) | st.none(), max_size=2))


@settings(max_examples=40, deadline=None)
@given(st.lists(returned, min_size=1, max_size=8))
def test_any_reward_return_value_is_a_valid_batch_or_a_counted_fault(values):
    """Whatever a user function returns, the batch that reaches collate() is well formed: every
    reward finite, all scalars or all dicts, and each bad value counted once."""
    it = iter(values)
    runner = rewards.RewardRunner(lambda p, r, label: next(it), log=lambda s: None)
    out = runner([""] * len(values), [""] * len(values), [""] * len(values))
    assert len({isinstance(v, dict) for v in out}) == 1
    for v in out:
        assert all(isinstance(x, float) and math.isfinite(x) for x in flat(v))

    def valid(v):
        number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
        return all(number(x) and abs(x) <= rewards.MAX_ABS_REWARD and math.isfinite(x) for x in flat(v))
    scalars_among_dicts = any(isinstance(v, dict) and valid(v) for v in values)
    expected = sum(not valid(v) or (scalars_among_dicts and not isinstance(v, dict)) for v in values)
    assert sum(runner.faults.values()) == expected, (values, dict(runner.faults))
    samples = [Sample(prompt_ids=[2], response_ids=[3], reward=v) for v in out]
    batch = collate(samples, pad_id=0)
    assert bool(batch.rewards.isfinite().all())
