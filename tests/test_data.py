"""Data: loading prompt files with clear errors, skipping bad prompts, deterministic resumable order."""
import json

import pytest

from nanorl.data import DataError, Prompt, PromptLoader, build_prompts, load_rows
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
    rows = [{"prompt": "", "answer": "0"}, {"prompt": "1+1=", "answer": "2"},
            {"prompt": "9" * 100, "answer": "9"}]
    prompts, skipped = build_prompts(rows, tok, "prompt", "answer", max_prompt_len=16)
    assert [p.text for p in prompts] == ["1+1="] and skipped == {"empty": 1, "too_long": 1}
    assert tok.decode(prompts[0].ids) == "1+1="
    with pytest.raises(DataError, match="no usable prompt left"):
        build_prompts(rows[:1] + rows[2:], tok, "prompt", "answer", max_prompt_len=16)


def test_dropped_prompts_are_said_at_start_up(tok, capsys):
    rows = [{"prompt": "9" * 100, "answer": "9"}, {"prompt": "1+1=", "answer": "2"},
            {"prompt": "8" * 30, "answer": "8"}, {"prompt": " ", "answer": "0"}]
    lines = []
    build_prompts(rows, tok, "prompt", "answer", max_prompt_len=16, source="gsm8k.jsonl", log=lines.append)
    assert lines == ["gsm8k.jsonl: dropped 2 longer than --max-prompt-len 16 tokens and 1 empty of 4 prompts"]
    build_prompts(rows[:3], tok, "prompt", "answer", max_prompt_len=16, source="eval")  # printed by default
    assert capsys.readouterr().out == "eval: dropped 2 longer than --max-prompt-len 16 tokens of 3 prompts\n"
    build_prompts(rows[1:2], tok, "prompt", "answer", max_prompt_len=16)  # nothing dropped: nothing said
    assert capsys.readouterr().out == ""


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


# ----------------------------------------------------------------------------- real data layouts (issue 17)

GSM8K_ROW = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                         "clips in May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                       "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"}
MATH_ROW = {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
            "solution": "We have $\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."}
MATH500_ROW = {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
               "solution": "... so the polar coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
               "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
               "unique_id": "test/precalculus/807.json"}
# verl's examples/data_preprocess/gsm8k.py layout
VERL_ROW = {"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": GSM8K_ROW["question"] + " Let's think step by step and "
                        "output the final answer after \"####\"."}],
            "reward_model": {"style": "rule", "ground_truth": "72"},
            "extra_info": {"split": "train", "index": 0, "answer": GSM8K_ROW["answer"],
                           "question": GSM8K_ROW["question"]}}
THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
         "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")  # Qwen3's switch, cut down


@pytest.fixture(scope="module")
def chat_tok():
    from nanorl.task import build_real_shape_tokenizer  # byte-level: any text round-trips
    tok = build_real_shape_tokenizer()
    tok.chat_template = THINK
    return tok


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_hub_dir(root, config: str, splits: dict[str, list[dict]]):
    """A dataset directory laid out as a Hub repo (openai/gsm8k: main/train-00000-of-00001.parquet and a
    README whose YAML lists the configs), which `datasets.load_dataset(dir, config, split=...)` reads."""
    (root / config).mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        write_parquet(root / config / f"{split}-00000-of-00001.parquet", rows)
    files = "".join(f"  - split: {s}\n    path: {config}/{s}-*\n" for s in splits)
    (root / "README.md").write_text(f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{files}---\n")
    return str(root)


def test_gsm8k_jsonl_keeps_the_solution_label_for_the_math_reward(tmp_path, chat_tok):
    from nanorl.rewards import math_reward
    src = write_jsonl(tmp_path / "gsm8k_train.jsonl", [GSM8K_ROW])
    (p,), _ = build_prompts(load_rows(src), chat_tok, "question", "answer", 512, source=src)
    assert p.label == GSM8K_ROW["answer"] and p.text == GSM8K_ROW["question"]
    assert chat_tok.decode(p.ids) == (f"<|im_start|>user\n{GSM8K_ROW['question']}<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    assert math_reward(p.text, "So 72 in all. The answer is \\boxed{72}", p.label) == 1.0
    assert math_reward(p.text, "The answer is \\boxed{71}", p.label) == 0.0


def test_math_parquet_with_candidate_keys(tmp_path, chat_tok):
    """MATH's columns are problem/solution, MATH-500 adds answer: `a,b` keys read both layouts."""
    from nanorl.rewards import math_reward
    math = write_parquet(tmp_path / "math.parquet", [MATH_ROW])
    m500 = write_jsonl(tmp_path / "math500.jsonl", [MATH500_ROW])
    (p,), _ = build_prompts(load_rows(math), chat_tok, "question,problem", "answer,solution", 512,
                            source=math)
    assert p.text == MATH_ROW["problem"] and math_reward("", "\\boxed{0.75}", p.label) == 1.0
    (q,), _ = build_prompts(load_rows(m500), chat_tok, "question,problem", "answer,solution", 512,
                            source=m500)
    assert q.label == MATH500_ROW["answer"] and math_reward("", "$\\boxed{(3,\\frac{\\pi}{2})}$",
                                                            q.label) == 1.0
    with pytest.raises(DataError, match=r"row 1 has no key 'question,query'; keys present: \['level', "
                                        r"'problem'"):
        build_prompts(load_rows(math), chat_tok, "question,query", "solution", 512, source=math)


def test_verl_parquet_chat_messages_and_nested_label(tmp_path, chat_tok):
    src = write_parquet(tmp_path / "train.parquet", [VERL_ROW])
    (p,), _ = build_prompts(load_rows(src), chat_tok, "prompt", "reward_model.ground_truth", 512, source=src)
    assert p.label == "72" and p.text == VERL_ROW["prompt"][0]["content"]
    assert chat_tok.decode(p.ids).startswith("<|im_start|>user\nNatalia sold") and "step by step" in p.text
    with pytest.raises(DataError, match=r"no key 'reward_model.answer'; keys present: \['ability', "
                                        r"'data_source', "
                                        r"'extra_info', 'prompt', 'reward_model'\]"):
        build_prompts(load_rows(src), chat_tok, "prompt", "reward_model.answer", 512, source=src)
    with pytest.raises(DataError, match=r"row 1: the prompt must be a string or a non-empty list"):
        build_prompts([{"prompt": [{"role": "user"}], "answer": "1"}], chat_tok, "prompt", "answer", 512)
    with pytest.raises(DataError, match=r"row 1: the messages have no 'user' turn"):
        build_prompts([{"prompt": [{"role": "system", "content": "x"}], "answer": "1"}], chat_tok, "prompt",
                      "answer", 512)


def test_datasets_name_config_and_split(tmp_path, chat_tok):
    """`name[:config][@split]` reaches `datasets.load_dataset(name, config, split=split)` (a Hub name
    there; a directory in the Hub layout here), and eval data defaults to the test split."""
    from nanorl.data import parse_source
    assert parse_source("openai/gsm8k:main@train", "test") == ("openai/gsm8k", "main", "train")
    assert parse_source("HuggingFaceH4/MATH-500", "test") == ("HuggingFaceH4/MATH-500", None, "test")
    assert parse_source(str(tmp_path / "a.jsonl"), "test") == (str(tmp_path / "a.jsonl"), None, "test")
    hub = write_hub_dir(tmp_path / "gsm8k", "main",
                        {"train": [GSM8K_ROW] * 3, "test": [dict(GSM8K_ROW, question="t")]})
    assert len(load_rows(f"{hub}:main")) == 3 and load_rows(f"{hub}:main", split="test")[0]["question"] == "t"
    assert load_rows(f"{hub}:main@test", split="train")[0]["question"] == "t"  # an explicit split wins
    with pytest.raises(DataError, match=r"gsm8k:nope@train: cannot read prompts"):
        load_rows(f"{hub}:nope@train")


def test_prompt_format_template_system_and_chat_kwargs(chat_tok):
    from nanorl.data import PromptFormat
    tmpl = "{prompt} Put your final answer in \\boxed{}."  # the braces of \boxed{} stay literal
    fmt = PromptFormat(system_prompt="You are a careful solver.", template=tmpl,
                       chat_template_kwargs={"enable_thinking": False})
    ids, text = fmt.render("What is 2+2?", chat_tok)
    assert text == "What is 2+2? Put your final answer in \\boxed{}."
    assert chat_tok.decode(ids) == ("<|im_start|>system\nYou are a careful "
                                    "solver.<|im_end|>\n<|im_start|>user\n"
                                    f"{text}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msgs = [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]
    with pytest.raises(DataError, match="its own system message and --system-prompt"):
        fmt.render(msgs, chat_tok)
    base = PromptFormat(template=tmpl, chat_template=False)  # a base model: raw text, no template
    ids, _ = base.render("What is 2+2?", chat_tok)
    assert chat_tok.decode(ids) == "What is 2+2? Put your final answer in \\boxed{}."
    assert chat_tok.decode(PromptFormat(system_prompt="S", chat_template=False)
                           .render("q", chat_tok)[0]) == "S\n\nq"
    with pytest.raises(DataError, match="--chat-template-kwargs .* no chat template is used"):
        PromptFormat(chat_template=False, chat_template_kwargs={"enable_thinking": False}).render("q",
                                                                                                  chat_tok)
    with pytest.raises(DataError, match="3 chat messages need a chat template"):
        PromptFormat(chat_template=False).render(msgs + [{"role": "user", "content": "again"}], chat_tok)
    # several turns: the template wraps the LAST user turn only, and that turn is the reward's prompt
    # text even when another role follows it (an assistant turn to continue)
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    ids, text = PromptFormat(template="T:{prompt}").render(turns, chat_tok)
    assert text == "T:c" and turns[2]["content"] == "c"  # the row's own messages are not edited
    assert "user\na<|im_end|>" in chat_tok.decode(ids) and "user\nT:c<|im_end|>" in chat_tok.decode(ids)


def test_prompt_flags_reach_the_config():
    from nanorl.config import parse_args
    cfg = parse_args(["--prompt-template", "{prompt} Box it: \\boxed{}", "--system-prompt", "S",
                      "--no-chat-template",
                      "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert cfg.prompts.chat_template is False and cfg.chat_template_dict == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"prompt_template must contain \{prompt\}"):
        parse_args(["--prompt-template", "Solve it."])
    with pytest.raises(ValueError, match="chat_template_kwargs must be a JSON object"):
        parse_args(["--chat-template-kwargs", "[1]"])


def test_any_source_to_jsonl_command(tmp_path):
    from nanorl.data import main
    hub = write_hub_dir(tmp_path / "gsm8k_cli", "main", {"train": [GSM8K_ROW], "test": [GSM8K_ROW]})
    main([f"{hub}:main@test", str(tmp_path / "gsm8k_test.jsonl")])
    assert load_rows(str(tmp_path / "gsm8k_test.jsonl")) == [GSM8K_ROW]


def test_a_run_logs_its_dropped_training_prompts_once(tmp_path, capsys):
    """The start-up line on the console, and the counts in metrics.jsonl's first row (not later ones)."""
    import train
    from nanorl.task import make_default
    task = make_default(str(tmp_path / "task"), seed=0, sft_steps=0)
    rows = [json.loads(line) for line in open(task["train"])][:20]
    rows[3]["prompt"] = "9" * 200  # longer than --max-prompt-len 64
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    train.main(["--model", task["model"], "--train-data", str(tmp_path / "train.jsonl"), "--test-data",
                task["test"], "--max-prompt-len", "64", "--steps", "2", "--prompts-per-step", "2",
                "--samples-per-prompt", "2", "--eval-limit", "2", "--eval-every", "0", "--quiet",
                "--threads", "1", "--out-dir", str(out)])
    assert "dropped 1 longer than --max-prompt-len 64 tokens of 20 prompts" in capsys.readouterr().out
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert logged[0]["data/prompts_skipped_too_long"] == 1 and "data/prompts_skipped_empty" not in logged[0]
    assert not any(k.startswith("data/") for row in logged[1:] for k in row)
