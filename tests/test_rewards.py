"""Rewards: the built-ins, user functions, and the fault-tolerant runner (math grading:
test_math_grader.py)."""
import math

import pytest

from nanorl.rewards import RewardRunner, exact, exact_format, load_reward_fn, math_format, math_reward


def test_builtin_rewards():
    assert exact("3+4=", "7", "7") == 1.0 and exact("3+4=", "77", "7") == 0.0
    assert math_reward("q", "The answer is \\boxed{\\dfrac{3}{6}}", "1/2") == 1.0
    assert math_reward("q", "#### 7", "8") == 0.0
    assert math_format("q", "\\boxed{3}", "3") == {"correct": 1.0, "format": 0.2}
    assert exact_format("q", "12", "13") == {"correct": 0.0, "format": 0.1}


def test_load_user_function_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompt, response, label):\n    return float(len(response) == 2)\n")
    fn = load_reward_fn(f"{f}:score")
    assert fn("p", "ab", "x") == 1.0 and fn("p", "a", "x") == 0.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_reward_fn(f"{f}:nope")
    with pytest.raises(FileNotFoundError):
        load_reward_fn(f"{tmp_path}/missing.py:score")
    with pytest.raises(ValueError, match="expected one of"):
        load_reward_fn("not_a_builtin")
    assert load_reward_fn("nanorl.rewards:exact") is exact


def _faulty(prompt, response, label):
    if response == "raise":
        raise RuntimeError("boom")
    if response == "nan":
        return math.nan
    if response == "none":
        return None
    if response == "str":
        return "1"
    if response == "hang":
        import time
        time.sleep(60)
    if response == "die":
        import os
        os._exit(3)
    return 1.0


def test_runner_in_process_counts_faults():
    logs = []
    runner = RewardRunner(_faulty, log=logs.append)
    out = runner(["p"] * 5, ["ok", "raise", "nan", "none", "str"], ["l"] * 5)
    assert out == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert runner.faults == {"RuntimeError": 1, "ValueError": 1, "TypeError": 2}
    assert len(logs) == 1 and "boom" in logs[0]  # the first traceback, once


def test_runner_workers_survive_hang_and_crash():
    runner = RewardRunner(_faulty, timeout=1.0, workers=1, log=lambda s: None)
    try:
        out = runner(["p"] * 4, ["ok", "hang", "ok", "die"], ["l"] * 4)
        assert out == [1.0, 0.0, 1.0, 0.0]
        assert runner.faults["Timeout"] == 1 and runner.faults["WorkerCrash"] == 1
        assert runner(["p"], ["ok"], ["l"]) == [1.0]  # a fresh pool serves the next call
    finally:
        runner.close()
