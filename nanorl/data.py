"""Data: the prompts RL trains on, with the label each reward checks against (feeds link 1, the rollout).

A prompt set is rows with an input (the question) and a label (the reference answer). `--train-data` and
`--test-data` name them, in the forms people train on:
- a JSONL or parquet file;
- a Hugging Face `datasets` name or local dataset directory, as `name[:config][@split]`
  (`openai/gsm8k:main@train`, `HuggingFaceH4/MATH-500@test`); the split defaults to train for training
  data and test for eval data.
`--input-key` / `--label-key` name the columns, a dotted path reaches into a nested column (verl's parquet
keeps the label in `reward_model.ground_truth`), and a comma list gives candidates, the first a set has
wins (`question,problem` reads GSM8K and MATH alike). The input is a string or a list of
`{"role", "content"}` chat messages (verl / slime parquet). A label is used as it is: the math reward
extracts GSM8K's "#### N" and MATH's \\boxed{} itself (nanorl/math_grader.py). Start at `build_prompts`
(rows → token ids, via `PromptFormat`) and `PromptLoader` (deterministic, resumable batches). Bad files
fail with the file, the line and the key. Any source to a JSONL file (e.g. where the hub is not reachable):

    python -m nanorl.data openai/gsm8k:main@train gsm8k_train.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

import torch


class DataError(ValueError):
    """A prompt file or row that cannot be used; the message names the file, line and key."""


FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def parse_source(source: str, split: str) -> tuple[str, str | None, str]:
    """`name[:config][@split]` → (name, config, split); a file path passes through whole."""
    if source.endswith(FILE_SUFFIXES) or os.path.isfile(source):
        return source, None, split
    name, _, given_split = source.partition("@")
    name, _, config = name.partition(":")
    return name, config or None, given_split or split


def load_rows(source: str, split: str = "train") -> list[dict]:
    """Rows (dicts) from a .jsonl/.json file, a .parquet file, or a `datasets` `name[:config][@split]`."""
    name, config, split = parse_source(source, split)
    if name.endswith((".jsonl", ".json")):
        if not os.path.isfile(name):
            raise DataError(f"{name}: no such file")
        rows = []
        with open(name, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    # a BOM is fine
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
                    if not line:
                        continue
                    row = json.loads(line)
                # bad UTF-8/JSON, 4300+ digit ints, deep nesting
                except (ValueError, RecursionError) as e:
                    raise DataError(f"{name}:{lineno}: not a valid JSON line ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{name}:{lineno}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    # library errors (corrupt parquet, unknown dataset) become one clear DataError
    try:
        if name.endswith(".parquet"):
            # installed with `datasets`
            import pyarrow.parquet as pq
            return pq.read_table(name).to_pylist()
        # a hub name (needs network or the local cache) or a local dataset directory
        import datasets
        return list(datasets.load_dataset(name, config, split=split))
    except Exception as e:
        raise DataError(f"{source}: cannot read prompts ({type(e).__name__}: {str(e)[:300]}); expected a "
                        ".jsonl / .parquet file or a `datasets` name[:config][@split] or directory") from e


def lookup(row: dict, key: str, source: str, i: int):
    """`row[key]`; a dotted key reaches into nested dicts and a comma list takes the first present.
    A missing key names itself and the keys that are there."""
    for candidate in key.split(","):
        value, found = row, True
        for part in candidate.strip().split("."):
            if not isinstance(value, dict) or part not in value:
                found = False
                break
            value = value[part]
        if found:
            return value
    raise DataError(f"{source}: row {i + 1} has no key {key!r}; keys present: {sorted(row)} "
                    f"(set --input-key / --label-key; a.b reads a nested column, a,b the first present)")


@dataclass
class PromptFormat:
    """How an input becomes the prompt's tokens.

    `--prompt-template` wraps the user's text (the usual "... put your final answer in \\boxed{}"),
    `--system-prompt` adds a system message, and the tokenizer's chat template renders the messages with
    the generation prompt (options via `--chat-template-kwargs`, e.g. Qwen3's `{"enable_thinking":
    false}`); `--no-chat-template`, or a tokenizer without one, gives the raw text to a base model. Rows
    whose prompt is empty or longer than the context are skipped and counted (build_prompts), and an
    error is raised when none is left."""
    system_prompt: str = ""
    # "{prompt}" is replaced by the user's text; other braces are literal
    template: str = ""
    # use the tokenizer's chat template when it has one
    chat_template: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)

    def messages(self, prompt, where: str) -> list[dict]:
        """The chat messages of one input (a string or a list of {role, content}), formatted."""
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            msgs = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise DataError(f"{where}: the prompt must be a string or a non-empty list of "
                            f"{{'role': str, 'content': str}} messages, got {str(prompt)[:120]!r}")
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise DataError(f"{where}: the messages have no 'user' turn (roles: {[m['role'] for m in msgs]})")
        # the instruction goes around the (last) user turn, as verl's preprocessing does
        if self.template:
            last = msgs[users[-1]]
            last["content"] = self.template.replace("{prompt}", last["content"])
        if self.system_prompt:
            if msgs[0]["role"] == "system":
                raise DataError(f"{where}: the row has its own system message and --system-prompt is "
                                "set too; drop one")
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, prompt, tokenizer, where: str = "prompt") -> tuple[list[int], str]:
        """(token ids, the user's text as the reward sees it) of one input."""
        msgs = self.messages(prompt, where)
        text = [m["content"] for m in msgs if m["role"] == "user"][-1]
        if self.chat_template and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                **self.chat_template_kwargs)
            # a BatchEncoding in transformers 5
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids), text
        if self.chat_template_kwargs:
            raise DataError(f"--chat-template-kwargs {self.chat_template_kwargs} given, but no chat template "
                            "is used (the tokenizer has none, or --no-chat-template)")
        if len(msgs) > 2 or (len(msgs) == 2 and msgs[0]["role"] != "system"):
            raise DataError(f"{where}: {len(msgs)} chat messages need a chat template to become one prompt "
                            "(the tokenizer has none, or --no-chat-template)")
        # a base model: [system text, blank line,] the user's text
        raw = "\n\n".join(m["content"] for m in msgs)
        return tokenizer(raw, add_special_tokens=False)["input_ids"], text


def render_prompt(text: str, tokenizer) -> list[int]:
    """Token ids of a plain-text prompt with the default format (the chat template if there is one)."""
    return PromptFormat().render(text, tokenizer)[0]


@dataclass
class Prompt:
    ids: list[int]
    text: str
    label: str


def build_prompts(rows: list[dict], tokenizer, input_key: str, label_key: str, max_prompt_len: int,
                  source: str = "data", fmt: PromptFormat | None = None) -> tuple[list[Prompt], dict]:
    """Tokenised prompts and the skip counts {"empty": n, "too_long": n}."""
    fmt = fmt or PromptFormat()
    prompts, skipped = [], {"empty": 0, "too_long": 0}
    for i, row in enumerate(rows):
        where = f"{source}: row {i + 1}"
        value, label = lookup(row, input_key, source, i), lookup(row, label_key, source, i)
        if label is None:
            raise DataError(f"{where}: {label_key!r} is null (every prompt needs a label)")
        if isinstance(label, (list, dict)):  # e.g. MBPP's test_list: the code reward reads it as JSON
            label = json.dumps(label)
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise DataError(f"{where}: the label {label_key!r} must be a string, a number, a list or a "
                            f"dict, got {type(label).__name__}")
        if isinstance(value, str) and not value.strip():
            skipped["empty"] += 1
            continue
        try:
            ids, text = fmt.render(value, tokenizer, where)
        except DataError:
            raise
        # e.g. a lone surrogate the Rust tokenizer rejects
        except Exception as e:
            raise DataError(f"{where}: the tokenizer cannot encode {input_key!r} "
                            f"({type(e).__name__}: {str(e)[:200]})") from e
        if not text.strip():
            skipped["empty"] += 1
            continue
        if len(ids) > max_prompt_len:
            skipped["too_long"] += 1
            continue
        prompts.append(Prompt(ids=ids, text=text, label=str(label)))
    if not prompts:
        raise DataError(f"{source}: no usable prompt left (skipped {skipped}; max prompt length "
                        f"{max_prompt_len} tokens)")
    return prompts, skipped


class PromptLoader:
    """Endless batches of prompts: a fresh seeded permutation each epoch, resumable exactly.

    `rank`/`world` give each rank a disjoint shard of every batch (rank r takes rows r, r+world, ...).

    Epoch e is a permutation seeded by (seed, e), so a run can resume at exactly the same row
    (`state_dict` / `load_state_dict`).
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int = 0, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise ValueError(f"prompts per step ({batch_size}) must divide evenly over {world} ranks")
        self.prompts, self.batch_size, self.seed = prompts, batch_size, seed
        self.rank, self.world = rank, world
        self.epoch, self.pos = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next_batch(self) -> list[Prompt]:
        """The next `batch_size` prompts (this rank's share), crossing epoch boundaries as needed."""
        picked = []
        while len(picked) < self.batch_size:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            picked.append(self.prompts[self._order[self.pos]])
            self.pos += 1
        return picked[self.rank::self.world]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation(self.epoch)


def main(argv: list[str] | None = None) -> None:
    """python -m nanorl.data SOURCE[:config][@split] OUT.jsonl — any source's rows to a JSONL file."""
    ap = argparse.ArgumentParser(prog="python -m nanorl.data",
                                 description="Write a prompt set's rows to JSONL.")
    ap.add_argument("source", help="a JSONL / parquet file or a datasets name[:config][@split]")
    ap.add_argument("out", help="the JSONL file to write")
    a = ap.parse_args(argv)
    rows = load_rows(a.source)
    with open(a.out, "w") as out:
        out.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
    print(f"{len(rows)} rows of {a.source} -> {a.out}")


if __name__ == "__main__":
    main()
