"""The math reward on math-verify: a table of (response, label, expected) across GSM8K labels, number
formats, intervals and tuples, LaTeX wrappers, several boxed answers, look-alikes, and adversarial
inputs that must come back, scored, inside the runner's timeout."""
import time

import pytest

from nanorl.math_grader import extract_answer, last_boxed
from nanorl.rewards import BOUNDED, RewardRunner, format_reward, math_format, math_reward

GSM = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
       "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
CASES = [
 # GSM8K labels: worked solution, then #### N
 ("The answer is \\boxed{72}", GSM, 1), ("So she sold 72 clips.\n#### 72", GSM, 1), ("#### 71", GSM, 0),
 ("The answer is 72.", GSM, 1), ("She sold 48 + 24 = 72 clips in total.", GSM, 1), ("\\boxed{7.2}", GSM, 0),
 ("The answer is: 72", GSM, 1), ("the final answer is $72$. Done.", GSM, 1),
    ("#### 72", "Total 1,000 apples.\n#### 1000", 0),
 ("#### 72\nThat took 3 steps.", GSM, 1), ("I get 71 at first.\n#### 72\n", "#### 72", 1),
 ("#### 1,000", "He has 1000.\n#### 1000", 1), ("\\boxed{\\$1,000}", "#### 1000", 1),
    ("\\boxed{1000.00}", "#### 1000", 1),
 # fractions, decimals, percent, thousands separators
 ("\\boxed{\\frac{1}{2}}", "0.5", 1), ("\\boxed{\\frac12}", "0.5", 1), ("\\boxed{\\dfrac{3}{6}}", "1/2", 1),
 ("\\boxed{0.5}", "\\frac{1}{2}", 1), ("\\boxed{\\tfrac{3}{4}}", "0.75", 1),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0),
 ("\\boxed{\\frac{4}{3}}", "\\frac{3}{4}", 0), ("\\boxed{10\\%}", "10", 1), ("\\boxed{50\\%}", "50", 1),
 ("\\boxed{1,000}", "1000", 1), ("\\boxed{1{,}000}", "1000", 1), ("\\boxed{1,234,567}", "1234567", 1),
 ("\\boxed{100}", "1000", 0), ("\\boxed{-3}", "3", 0), ("\\boxed{3}", "-3", 0), ("\\boxed{12.0}", "12", 1),
 ("\\boxed{12.5}", "12", 0), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1), ("\\boxed{\\sqrt{2}}", "2", 0),
 ("\\boxed{10^3}", "1000", 1), ("\\boxed{10^4}", "1000", 0),
 # intervals and tuples
 ("\\boxed{(3,\\frac{\\pi}{2})}", "\\left(3,\\frac{\\pi}{2}\\right)", 1),
    ("\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}", "(3,\\frac{\\pi}{2})", 1),
 ("\\boxed{(3,\\pi)}", "\\left(3,\\frac{\\pi}{2}\\right)", 0), ("\\boxed{[1,2)}", "[1,2)", 1),
    ("\\boxed{(1,2]}", "[1,2)", 0),
 ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", 1), ("\\boxed{(2,1)}", "(1,2)", 0),
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1),
 # LaTeX wrappers, units, equations
 ("\\boxed{5\\text{ cm}}", "5", 1), ("\\boxed{5 \\text{ meters}}", "5", 1), ("\\boxed{90^\\circ}", "90", 1),
 ("\\boxed{x=5}", "5", 1), ("\\boxed{x = -5}", "5", 0), ("\\boxed{\\mathrm{18}}", "18", 1),
    ("\\boxed{\\left( 1 \\right)}", "1", 1),
 ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0),
 ("\\boxed{\\pi}", "\\pi", 1), ("\\boxed{2\\pi}", "\\pi", 0), ("\\fbox{42}", "42", 1),
 # MATH solutions as labels
 ("\\boxed{\\frac{1}{2}}", "We find $x = \\boxed{\\frac{1}{2}}$.", 1),
    ("\\boxed{\\frac{1}{3}}", "We find $x = \\boxed{\\frac{1}{2}}$.", 0),
 # several boxed answers: the last box is the final one
 ("First \\boxed{3}, no wait, \\boxed{5}", "5", 1), ("First \\boxed{5}, no wait, \\boxed{3}", "5", 0),
 ("\\boxed{\\frac{1}{\\frac{1}{2}}}", "2", 1), ("\\boxed{7} and then \\boxed{unclosed", "7", 1),
 # no answer / look-alikes
 ("I don't know.", "5", 0), ("", "5", 0), ("\\boxed{}", "5", 0), ("The answer is 15.", "5", 0),
 ("The answer is 5 apples.", "5", 1), ("so the answer is 5, not 6", "6", 0),
]
ADVERSARIAL = [  # (response, label, expected): huge nesting, huge numbers, 100k characters
    ("\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}", "5", 0),  # longer than any answer: not parsed
    ("\\boxed{" + "\\frac{1}{" * 50 + "2" + "}" * 50 + "}", "5", 0),    # parse stopped by its alarm
    ("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1", 0),
    ("\\boxed{" + "(" * 250 + "1" + ")" * 250 + "}", "5", 0),
    ("\\boxed{" + "(" * 3000 + ")" * 3000 + "}", "5", 0),
    ("\\boxed{" + "\\sqrt{" * 80 + "2" + "}" * 80 + "}", "5", 0),
    ("\\boxed{" + "x^" * 200 + "2}", "5", 0),
    ("\\boxed{" + "9" * 5000 + "}", "5", 0),
    ("\\boxed{9^{9^{9^{9^{9}}}}}", "5", 0),                             # comparison stopped by its alarm
    ("\\boxed{(10^{10})!}", "5", 0),
    ("\\boxed{" * 20_000, "5", 0),                                      # 20k unclosed boxes: one linear pass
    # 100k characters, the answer at the end
    ("x" * 100_000 + " so 5", "5", 1),
    ("\\boxed{1}" * 10_000, "1", 1),
    ("The answer is " + "1+" * 50_000 + "1", "5", 0),
    ("#### " + "1," * 250, "5", 0),
]


def test_table_is_large_and_covers_both_outcomes():
    assert len(CASES) >= 60 and {e for *_, e in CASES} == {0, 1}


@pytest.mark.parametrize("response,label,expected", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_math_reward_table(response, label, expected):
    assert math_reward("q", response, label) == float(expected)


@pytest.mark.parametrize("text,span", [
    ("so \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, nested braces
    ("work...\n#### 1,234\nmore", "1,234"),                             # GSM8K: to the end of that line
    ("Thus the final answer is $\\frac{3}{4}$. Check: ok", "\\frac{3}{4}"),
    ("The answer: 12", "12"),
    ("it is 3 then 7.5 and finally -12", None),                        # unmarked: math-verify's job
    ("\\boxed{7} then \\boxed{unclosed", "7"),                          # an unclosed box is skipped
])
def test_extract_answer(text, span):
    assert extract_answer(text) == span


def test_format_reward_needs_a_closed_box():
    assert format_reward("q", "\\boxed{\\frac{1}{2}}", "") == 1.0 and format_reward("q", "\\boxed{1",
                                                                                    "") == 0.0
    assert math_format("q", "\\boxed{3}", "3") == {"correct": 1.0, "format": 0.2}
    assert last_boxed("\\boxed{" * 20_000) is None


@pytest.fixture(scope="module")
def runner():
    r = RewardRunner(math_reward, timeout=BOUNDED["math"], log=lambda text: None)  # the trainer's default
    yield r
    r.close()


@pytest.mark.parametrize("response,label,expected", ADVERSARIAL,
                         ids=[f"adv{i}" for i in range(len(ADVERSARIAL))])
def test_adversarial_inputs_are_scored_within_the_timeout(runner, response, label, expected):
    """Bounded, whatever the load: math-verify's own alarms answer on a quiet machine; on a busy one the
    runner's timeout may kill the call first — a counted Timeout scoring 0, an accepted outcome. A hang,
    a crash or a wrong score is not."""
    before = dict(runner.faults)
    start = time.perf_counter()
    score = runner(["q"], [response], [label])
    # the call's bound plus pool start-up, with room for a machine 3x as loaded
    assert time.perf_counter() - start < 3 * (BOUNDED["math"] + 5)
    new = {k: v - before.get(k, 0) for k, v in runner.faults.items() if v != before.get(k, 0)}
    assert (score, new) in (([float(expected)], {}), ([0.0], {"Timeout": 1})), (score, new)


def test_a_hung_verifier_is_killed_by_the_runner_and_scores_zero(monkeypatch):
    import nanorl.math_grader as mg
    monkeypatch.setattr(mg, "grade", lambda response, label: time.sleep(60))  # a parse that never returns
    r = RewardRunner(math_reward, timeout=1.0, log=lambda text: None)
    start = time.perf_counter()
    try:
        assert r(["q"], ["\\boxed{1}"], ["1"]) == [0.0] and r.faults["Timeout"] == 1
    finally:
        r.close()
    assert time.perf_counter() - start < 10


def test_math_rewards_get_a_timeout_by_default():
    from nanorl.config import Config
    assert Config.from_flags(reward="math").reward_timeout == BOUNDED["math"] > 0
    assert Config.from_flags(reward="exact").reward_timeout == 0.0 and Config.from_flags(reward="math",
                                                                   reward_timeout=0).reward_timeout == 0
