"""reasoning-gym tasks as prompts and a reward: `--train-data reasoning_gym:NAME`, `--reward reasoning_gym`.

reasoning-gym (`pip install reasoning-gym`) generates ~100 procedural tasks offline, each with its own
answer checker. A source is data.py's `name[:config][@split]` with the task's options as a URL query:

    reasoning_gym:basic_arithmetic?size=2000&seed=1&min_terms=2&max_terms=2&max_digits=2
    reasoning_gym:basic_arithmetic?operators=+|-@test    (a list joins items with "|", not ",")

`size` and `seed` pick the items (`DEFAULTS` by split), the rest is the task's config. Start at
`load_rows` (rows: "prompt" the question as is, "answer" a JSON label) and `reward`. Key choices: item i
comes from seed + i, so near seeds share items: the default test seed is a billion away, and
`drop_seen` removes from eval sets every train question (the run prints how many). The label holds
task, config and index: the reward worker rebuilds the item (its metadata need not be JSON) and runs
the task's `score_answer(answer, entry)` on the last <answer>...</answer> of the response (the tags
reasoning-gym's prompts ask for: add them with --prompt-template), else on its last number when the
task's answer is a number, else on its last non-empty line (`final_answer`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re

PREFIX = "reasoning_gym"
PIP = "pip install reasoning-gym"
# (size, seed) when the source does not say: held-out items from seeds a billion away from training's
DEFAULTS = {"train": (1000, 0), "test": (200, 1_000_000_000)}
# a whole number or decimal, signed
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def is_source(source: str) -> bool:
    """Whether a --train-data / --test-data source names a reasoning-gym task."""
    return source.startswith(PREFIX + ":")


def _value(text: str):
    """An option's value: a number, true / false, a "|"-joined list (a tuple), else the text."""
    if "|" in text:
        return tuple(_value(x) for x in text.split("|"))
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse(spec: str, split: str) -> tuple[str, dict]:
    """`NAME?k=v&k=v` (the part after "reasoning_gym:") → (task name, its full config: size and seed
    filled in from DEFAULTS[split])."""
    name, _, query = spec.partition("?")
    size, seed = DEFAULTS["test" if split == "test" else "train"]
    config = {"size": size, "seed": seed}
    for item in filter(None, query.split("&")):
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{PREFIX}:{spec}: option {item!r} is not key=value")
        config[key] = _value(text)
    if not isinstance(config["size"], int) or isinstance(config["size"], bool) or config["size"] < 1:
        raise ValueError(f"{PREFIX}:{spec}: size must be a positive integer, got {config['size']!r}")
    return name.strip(), config


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str):
    """The task's dataset object (cached: a reward worker scores many items of one set)."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ImportError(f"{PREFIX}:{name} needs the reasoning-gym package ({PIP})") from None
    if name not in DATASETS:
        raise ValueError(f"{PREFIX}: no task {name!r}; tasks: {', '.join(sorted(DATASETS))}")
    config = json.loads(config_json)
    fields = {f.name for f in dataclasses.fields(DATASETS[name][1])}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"{PREFIX}:{name}: no option {', '.join(unknown)}; options: "
                         f"{', '.join(sorted(fields))}")
    # JSON has no tuples: lists go back to what the task's config dataclass expects
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        return reasoning_gym.create_dataset(name, **config)
    # the task's own checks (asserts, mostly) on its options
    except Exception as e:
        raise ValueError(f"{PREFIX}:{name}: invalid options {config} ({type(e).__name__}: {e})") from None


def load_rows(spec: str, split: str) -> list[dict]:
    """The task's items as rows {"prompt": question, "answer": label}; the label is JSON {"task",
    "config", "index", "answer"} (the answer for people reading a dump; the reward rebuilds the item)."""
    name, config = parse(spec, split)
    config_json = json.dumps(config, sort_keys=True)
    dataset = _dataset(name, config_json)
    rows = []
    for i in range(config["size"]):
        entry = dataset[i]
        label = {"task": name, "config": config, "index": i, "answer": str(entry["answer"])}
        rows.append({"prompt": entry["question"], "answer": json.dumps(label, sort_keys=True)})
    return rows


def drop_seen(prompts: list, seen: set[str], name: str, log=print) -> list:
    """The eval set's prompts (nanorl/data.py Prompt) whose text is not in `seen` (the train set's);
    says how many were dropped."""
    kept = [p for p in prompts if p.text not in seen]
    if not kept:
        raise ValueError(f"eval set {name}: all {len(prompts)} questions are in the train set; draw it from "
                         "a seed far from the train set's (seed=...)")
    log(f"nanorl: eval set {name}: dropped {len(prompts) - len(kept)} of {len(prompts)} questions that "
        "are in the train set")
    return kept


def final_answer(response: str, answer: str) -> str | None:
    """The text of the response's last <answer>...</answer>; else, when the task's answer is a number,
    the response's last number ("32 + 59 = 91." -> "91": lm-evaluation-harness's "flexible extract"
    for GSM8K, as the math reward's unmarked tail); else its last non-empty line (None: empty)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response)
    if tagged is not None:
        return tagged
    if _NUMBER.fullmatch(answer.strip()):
        numbers = _NUMBER.findall(response)
        return numbers[-1] if numbers else None
    lines = [x.strip() for x in response.strip().splitlines() if x.strip()]
    return lines[-1] if lines else None


def reward(prompt: str, response: str, label: str) -> float:
    """The task's own checker on the response's final answer (`final_answer`): 1 right, 0 wrong, and
    whatever partial credit the task gives. The label is the JSON `load_rows` wrote."""
    try:
        info = json.loads(label)
        name, config, index = info["task"], info["config"], info["index"]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"reward reasoning_gym: the label {str(label)[:80]!r} is not a reasoning-gym "
                         "label (use --train-data reasoning_gym:NAME)") from None
    dataset = _dataset(name, json.dumps(config, sort_keys=True))
    entry = dataset[index]
    if str(entry["answer"]) != info.get("answer", str(entry["answer"])):
        raise ValueError(f"reward reasoning_gym: item {index} of {name} rebuilt with another answer "
                         "(a different reasoning-gym version?)")
    return float(dataset.score_answer(final_answer(response, str(entry["answer"])), entry))
