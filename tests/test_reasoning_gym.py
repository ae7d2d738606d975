"""reasoning-gym tasks as data and reward (nanorl/reasoning_tasks.py): the spec's options and defaults,
rows equal to reasoning-gym's own items, the task's own checker scoring right and wrong answers in
the reward worker processes, eval sets that never hold a train question, and one-line mistakes."""
import ast
import json

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from nanorl import reasoning_tasks  # noqa: E402
from nanorl.config import Config  # noqa: E402
from nanorl.data import PromptFormat, load_rows  # noqa: E402
from nanorl.evaluation import load_eval_sets, set_name  # noqa: E402
from nanorl.rewards import RewardRunner, load_reward_fn  # noqa: E402

ARITH = "reasoning_gym:basic_arithmetic?min_terms=2&max_terms=2&max_digits=2"


class CharTokenizer:
    """Just enough tokenizer for build_prompts without a chat template: one id per character."""
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_spec_options_and_split_defaults():
    name, cfg = reasoning_tasks.parse("basic_arithmetic?size=5&operators=+|-&allow_negation=false", "train")
    assert name == "basic_arithmetic"
    assert cfg == {"size": 5, "seed": 0, "operators": ("+", "-"), "allow_negation": False}
    # held-out data defaults to a seed a billion items away from any train seed
    assert reasoning_tasks.parse("chain_sum", "test")[1] == {"size": 200, "seed": 1_000_000_000}
    assert reasoning_tasks.parse("chain_sum?seed=-3&x=1.5", "train")[1]["seed"] == -3


def test_rows_are_the_tasks_own_items():
    rows = load_rows(f"{ARITH}&size=6&seed=7")
    items = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=7, min_terms=2, max_terms=2,
                                         max_digits=2)
    assert [r["prompt"] for r in rows] == [e["question"] for e in items]
    label = json.loads(rows[2]["answer"])
    assert label == {"task": "basic_arithmetic", "index": 2, "answer": items[2]["answer"],
                     "config": {"size": 6, "seed": 7, "min_terms": 2, "max_terms": 2, "max_digits": 2}}
    # the split picks the default seed: train and test rows differ
    assert load_rows(f"{ARITH}&size=3")[0] != load_rows(f"{ARITH}&size=3@test")[0]


def test_the_tasks_checker_scores_in_the_reward_workers():
    fn = load_reward_fn("reasoning_gym")
    arith = load_rows(f"{ARITH}&size=3&seed=1")[0]
    # number_sorting has its own checker (it parses the list)
    sort = load_rows("reasoning_gym:number_sorting?size=2&seed=1")[0]
    right = json.loads(sort["answer"])["answer"]
    wrong = str(list(reversed(ast.literal_eval(right))))
    answer = json.loads(arith["answer"])["answer"]
    cases = [(arith, f"Let me think.\n<answer>{answer}</answer>", 1.0),
             (arith, f"The sum is\n{answer}", 1.0),                    # no tags: the last number
             (arith, f"3 + 4 = 7, so {answer}.", 1.0),
             (arith, f"{answer} is what 3 + 4 is", 0.0),
             (arith, f"<answer>{int(answer) + 1}</answer>", 0.0),
             (arith, "", 0.0),
             (sort, f"<answer>{right}</answer>", 1.0),
             (sort, f"<answer>{wrong}</answer>", 0.0),
             # not a number: the last line, as the task's checker parses it
             (sort, f"Sorted:\n{right}", 1.0)]
    runner = RewardRunner(fn, timeout=30, workers=2)
    try:
        # timeout > 0: every call runs in a worker process
        scores = runner([r["prompt"] for r, _, _ in cases], [resp for _, resp, _ in cases],
                        [r["answer"] for r, _, _ in cases])
    finally:
        runner.close()
    assert scores == [want for _, _, want in cases] and not runner.faults
    assert Config.from_flags(train_data=ARITH, reward="reasoning_gym").reward_timeout == 30.0


def test_eval_sets_drop_train_questions(capsys):
    tok = CharTokenizer()
    train = {r["prompt"] for r in load_rows(f"{ARITH}&size=50&seed=1")}
    # seed 2 is seed 1 shifted by one item: 49 of its 50 items are train items
    sets = load_eval_sets(f"near={ARITH}&size=50&seed=2,{ARITH}&size=20", tok, "prompt", "answer", 512,
                          PromptFormat(), seen=train)
    assert [s.name for s in sets] == ["near", "reasoning_gym_basic_arithmetic"]
    assert not any(p.text in train for s in sets for p in s.prompts) and len(sets[0].prompts) == 1
    out = capsys.readouterr().out
    assert "eval set near: dropped 49 of 50 questions that are in the train set" in out, out
    assert set_name(f"{ARITH}&size=20@test") == "reasoning_gym_basic_arithmetic_test"


def test_mistakes_are_one_line():
    with pytest.raises(ValueError) as e:
        load_rows("reasoning_gym:basic_arithmetc")
    msg = str(e.value)
    assert "no task 'basic_arithmetc'; tasks: " in msg and "basic_arithmetic, " in msg and "\n" not in msg
    assert len(msg.split(", ")) == len(reasoning_gym.factory.DATASETS)
    with pytest.raises(ValueError, match=r"no option colour; options: allow_negation, allow_parentheses"):
        load_rows(f"{ARITH}&colour=red")
    with pytest.raises(ValueError, match=r"invalid options .*max_terms must be >= min_terms"):
        load_rows("reasoning_gym:basic_arithmetic?min_terms=3&max_terms=2")
    with pytest.raises(ValueError, match=r"size must be a positive integer, got 0"):
        load_rows(f"{ARITH}&size=0")
    with pytest.raises(ValueError, match=r"all 5 questions are in the train set"):
        reasoning_tasks.drop_seen([type("P", (), {"text": "q"})()] * 5, {"q"}, "x")
    # the labels are task items: only the task's checker reads them, and it reads nothing else
    with pytest.raises(ValueError, match="needs --reward reasoning_gym"):
        Config.from_flags(train_data=ARITH)
    with pytest.raises(ValueError, match="needs --train-data reasoning_gym:NAME"):
        Config.from_flags(reward="reasoning_gym")
    with pytest.raises(ValueError, match="the label '2' is not a reasoning-gym label"):
        reasoning_tasks.reward("1+1=", "2", "2")
