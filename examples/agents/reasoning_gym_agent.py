"""A reasoning-gym task run as an agent: one chat call per item, scored by the task's own checker.

    python train.py --algo grpo --agent examples/agents/reasoning_gym_agent.py:run \\
        --train-data 'reasoning_gym:basic_arithmetic?size=1000&max_terms=2&max_digits=2' --model ...

reasoning-gym (a published environment package: ~100 procedural tasks, each with its `score_answer`)
is used as it ships; the model is reached through the plain `openai` client, so any OpenAI-compatible
server runs this file the same way. The row's label is the JSON {"task", "config", "index", "answer"}
that `reasoning_gym:` data carries: the agent rebuilds the item from it and asks the task to score the
reply's final answer (the last <answer>...</answer>, else the last number when the answer is a number,
else the last line). Leaves out: tools and several turns (examples/agents/calculator_agent.py has them).
"""
import functools
import json
import re

import reasoning_gym
from openai import OpenAI
from reasoning_gym.utils import extract_answer

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@functools.lru_cache(maxsize=16)
def task(name: str, config_json: str):
    """The task's dataset, built once per (name, config) in this process."""
    return reasoning_gym.create_dataset(name, **json.loads(config_json))


def final_answer(reply: str, answer: str) -> str | None:
    """What the task scores: the tagged answer, else the last number (numeric answers), else the last line."""
    tagged = extract_answer(reply)
    if tagged is not None:
        return tagged
    if NUMBER.fullmatch(answer.strip()):
        numbers = NUMBER.findall(reply)
        return numbers[-1] if numbers else None
    lines = [x.strip() for x in reply.strip().splitlines() if x.strip()]
    return lines[-1] if lines else None


def score(reply: str, label: str) -> float:
    """The task's own checker on the reply: 1 right, 0 wrong, or the task's partial credit."""
    item = json.loads(label)
    dataset = task(item["task"], json.dumps(item["config"], sort_keys=True))
    entry = dataset[item["index"]]
    return float(dataset.score_answer(final_answer(reply, str(entry["answer"])), entry))


def run(base_url: str, api_key: str, episode_id: str, row: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="policy", messages=messages)
    return score(reply.choices[0].message.content or "", row["label"])
