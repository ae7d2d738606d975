"""Data: loading prompt files with clear errors, skipping bad prompts, deterministic resumable order."""
import json

import pytest

from nanorl.data import DataError, PromptLoader, Prompt, build_prompts, load_rows
from nanorl.task import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: not a valid JSON line"):
        load_rows(str(f))
    f.write_text('[1, 2]\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: expected a JSON object"):
        load_rows(str(f))
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_missing_key_names_key_and_keys_present(tok):
    with pytest.raises(DataError, match=r"no key 'answer'; keys present: \['prompt', 'solution'\]"):
        build_prompts([{"prompt": "1+1=", "solution": "2"}], tok, "prompt", "answer", 64)


def test_empty_and_too_long_are_skipped_and_counted(tok):
    rows = [{"prompt": "", "answer": "0"}, {"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 100, "answer": "9"}]
    prompts, skipped = build_prompts(rows, tok, "prompt", "answer", max_prompt_len=16)
    assert [p.text for p in prompts] == ["1+1="] and skipped == {"empty": 1, "too_long": 1}
    assert tok.decode(prompts[0].ids) == "1+1="
    with pytest.raises(DataError, match="no usable prompt left"):
        build_prompts(rows[:1] + rows[2:], tok, "prompt", "answer", max_prompt_len=16)


def test_parquet_roundtrip(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"q": ["2+2="], "a": [4]}), tmp_path / "d.parquet")
    prompts, _ = build_prompts(load_rows(str(tmp_path / "d.parquet")), tok, "q", "a", 64)
    assert prompts[0].label == "4"


def test_loader_is_deterministic_disjoint_and_resumable():
    prompts = [Prompt(ids=[i], text=str(i), label="") for i in range(10)]
    a = PromptLoader(prompts, batch_size=4, seed=3)
    seq = [[p.text for p in a.next_batch()] for _ in range(6)]  # crosses epochs
    epoch0 = seq[0] + seq[1] + seq[2][:2]
    assert sorted(epoch0) == [str(i) for i in range(10)]  # each epoch is a permutation
    b = PromptLoader(prompts, batch_size=4, seed=3)
    for _ in range(3):
        b.next_batch()
    c = PromptLoader(prompts, batch_size=4, seed=3)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [[p.text for p in c.next_batch()] for _ in range(3)] == seq[3:]
    r0 = PromptLoader(prompts, 4, seed=3, rank=0, world=2).next_batch()
    r1 = PromptLoader(prompts, 4, seed=3, rank=1, world=2).next_batch()
    assert {p.text for p in r0}.isdisjoint({p.text for p in r1}) and len(r0) == len(r1) == 2
    assert sorted(p.text for p in r0 + r1) == sorted(seq[0])
