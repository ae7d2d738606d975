"""Data: the prompts RL trains on, with the label each reward checks against.

A prompt set is rows with an input (the question) and a label (the reference answer), read from
JSONL, parquet, or a Hugging Face `datasets` name (`--input-key` / `--label-key` name the columns).
When the tokenizer has a chat template, the input becomes a user message rendered with the
generation prompt, so an instruct model sees the format it was trained on; otherwise the raw text is
the prompt. Rows whose prompt is empty or longer than the context are skipped and counted, and an
error is raised when none is left. Bad files fail with the file, the line and the key named.

`PromptLoader` yields batches in a deterministic order: epoch e is a permutation seeded by
(seed, e), so a run can resume at exactly the same row (`state_dict` / `load_state_dict`).

    python -c "from nanorl.data import load_rows; print(load_rows('runs/default/train.jsonl')[:2])"
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch


class DataError(ValueError):
    """A prompt file or row that cannot be used; the message names the file, line and key."""


def load_rows(source: str, split: str = "train") -> list[dict]:
    """Rows (dicts) from a .jsonl/.json file, a .parquet file, or a `datasets` name / local dir."""
    if source.endswith((".jsonl", ".json")):
        if not os.path.isfile(source):
            raise DataError(f"{source}: no such file")
        rows = []
        with open(source, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()  # a BOM is fine
                    if not line:
                        continue
                    row = json.loads(line)
                except (ValueError, RecursionError) as e:  # bad UTF-8/JSON, 4300+ digit ints, deep nesting
                    raise DataError(f"{source}:{lineno}: not a valid JSON line ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{source}:{lineno}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    try:  # library errors (corrupt parquet, unknown dataset) become one clear DataError
        if source.endswith(".parquet"):
            import pyarrow.parquet as pq  # installed with `datasets`
            return pq.read_table(source).to_pylist()
        import datasets  # a hub name (needs network) or a local dataset directory
        return list(datasets.load_dataset(source, split=split))
    except Exception as e:
        raise DataError(f"{source}: cannot read prompts ({type(e).__name__}: {str(e)[:300]}); expected a "
                        ".jsonl / .parquet file or a `datasets` name or directory") from e


def render_prompt(text: str, tokenizer) -> list[int]:
    """Token ids of the prompt: the chat template with a generation prompt when the tokenizer has
    one, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Prompt:
    ids: list[int]
    text: str
    label: str


def build_prompts(rows: list[dict], tokenizer, input_key: str, label_key: str, max_prompt_len: int,
                  source: str = "data") -> tuple[list[Prompt], dict]:
    """Tokenised prompts and the skip counts {"empty": n, "too_long": n}."""
    prompts, skipped = [], {"empty": 0, "too_long": 0}
    for i, row in enumerate(rows):
        for key in (input_key, label_key):
            if key not in row:
                raise DataError(f"{source}: row {i + 1} has no key {key!r}; keys present: {sorted(row)} "
                                f"(set --input-key / --label-key)")
        text = row[input_key]
        if not isinstance(text, str):
            raise DataError(f"{source}: row {i + 1}: {input_key!r} must be a string, got {type(text).__name__}")
        if row[label_key] is None:
            raise DataError(f"{source}: row {i + 1}: {label_key!r} is null (every prompt needs a label)")
        if not text.strip():
            skipped["empty"] += 1
            continue
        try:
            ids = render_prompt(text, tokenizer)
        except Exception as e:  # e.g. a lone surrogate the Rust tokenizer rejects
            raise DataError(f"{source}: row {i + 1}: the tokenizer cannot encode {input_key!r} "
                            f"({type(e).__name__}: {str(e)[:200]})") from e
        if len(ids) > max_prompt_len:
            skipped["too_long"] += 1
            continue
        prompts.append(Prompt(ids=ids, text=text, label=str(row[label_key])))
    if not prompts:
        raise DataError(f"{source}: no usable prompt left (skipped {skipped}; max prompt length "
                        f"{max_prompt_len} tokens)")
    return prompts, skipped


class PromptLoader:
    """Endless batches of prompts: a fresh seeded permutation each epoch, resumable exactly.

    `rank`/`world` give each rank a disjoint shard of every batch (rank r takes rows r, r+world, ...).
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
