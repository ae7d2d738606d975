"""The built-in default task and model: everything `python train.py --algo grpo` needs, made in code.

No download is possible on a fresh laptop, so the default run builds its own world: a verifiable task
(all 1000 sums of three one-digit numbers, ``"3+4+9="`` → ``"16"`` then EOS, split into 800 train and
200 held-out problems), a character-level tokenizer saved as a standard ``PreTrainedTokenizerFast``, a
tiny Qwen2 with random weights (a real Hugging Face architecture, so rollout, recompute and saving are
the real code paths), and a short supervised warm start, as real RL starts from an SFT model. Start at
`make_default(out_dir, seed)`: it writes ``train.jsonl``, ``test.jsonl`` and the model directory, and
train.py then runs on those files exactly as on a user's data and model. `make_real_shape(out_dir,
layers)` builds the other kind of model nanorl is for, the exact shape of Qwen2.5-0.5B-Instruct with few
layers. Why these sizes, and the warm start's history: docs/from-slime-verl.md, "nanorl/task.py".

    python -m nanorl.task runs/default
    python -m nanorl.task --real-shape runs/real_shape
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil

import torch
from torch.nn.utils.rnn import pad_sequence

PAD, EOS = "<pad>", "<eos>"
# No space character: AutoTokenizer reloads a saved character-level tokenizer as the model type's
# tokenizer class, which drops spaces when encoding (../shared/FACTS.md). The task needs none.
CHARS = list("0123456789+-=")


def problems(seed: int = 0, test_fraction: float = 0.2) -> tuple[list[dict], list[dict]]:
    """All 1000 sums of three one-digit numbers, shuffled by `seed`, split into train and held-out."""
    items = [{"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c)}
             for a in range(10) for b in range(10) for c in range(10)]
    random.Random(seed).shuffle(items)
    n_test = int(len(items) * test_fraction)
    return items[n_test:], items[:n_test]


def build_tokenizer():
    """A character-level fast tokenizer: one token per character, plus <pad> and <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS] + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # every char is a token
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    # decode joins characters back without spaces
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS)


def build_model(vocab_size: int, seed: int = 0, hidden: int = 128, layers: int = 2):
    """A tiny randomly initialised Qwen2 (tied embeddings, fp32; head_dim 32, the smallest vLLM CPU runs)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    return Qwen2ForCausalLM(config)


def warm_start(model, tokenizer, items: list[dict], steps: int = 40, batch_size: int = 128,
               lr: float = 1e-3, seed: int = 0) -> None:
    """Supervised fine-tuning on (prompt, answer+EOS): cross-entropy on the answer tokens only."""
    gen = torch.Generator().manual_seed(seed)
    eos = [tokenizer.eos_token_id]
    pairs = [(tokenizer(x["prompt"])["input_ids"], tokenizer(x["answer"])["input_ids"] + eos) for x in items]
    # [N, S] right-padded
    ids = pad_sequence([torch.tensor(p + a) for p, a in pairs], batch_first=True,
                       padding_value=tokenizer.pad_token_id)
    # [N, S] the answer and its EOS only: -100 = not trained on
    labels = pad_sequence([torch.tensor([-100] * len(p) + a) for p, a in pairs], batch_first=True,
                          padding_value=-100)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(ids), (batch_size,), generator=gen)
        loss = model(input_ids=ids[pick], attention_mask=(ids[pick] != tokenizer.pad_token_id).long(),
                     labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def make_default(out_dir: str, seed: int = 0, sft_steps: int = 90, hidden: int = 128,
                 sft_fraction: float = 1.0) -> dict:
    """Write the default task (train/test JSONL) and a warm-started tiny model under `out_dir`.

    Returns the paths: {"model": dir, "train": file, "test": file}. Idempotent: a model already built
    with the same recipe is reused, so every run starts from the same SFT checkpoint — train.py always
    uses seed 0 here, and its --seed varies only the RL (sampling, data order), as in real RL runs
    that start from one fixed SFT model.
    """
    model_dir = os.path.join(out_dir, f"qwen2-h{hidden}-sft{sft_steps}-seed{seed}")
    paths = {"model": model_dir, "train": os.path.join(out_dir, "train.jsonl"),
             "test": os.path.join(out_dir, "test.jsonl")}
    # the split is fixed: held-out problems never change with the seed
    train, test = problems(seed=0)
    os.makedirs(out_dir, exist_ok=True)
    for split, items in (("train", train), ("test", test)):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in items)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), seed=seed, hidden=hidden)
        sft_items = train[: max(1, int(len(train) * sft_fraction))]
        warm_start(model, tokenizer, sft_items, steps=sft_steps, seed=seed)
        save_model_dir(model, tokenizer, model_dir)
    return paths


def save_model_dir(model, tokenizer, model_dir: str) -> None:
    """Save model + tokenizer to model_dir atomically: a half-written directory is never picked up,
    and when another process built the same model first, theirs is kept."""
    tmp = f"{model_dir}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, model_dir)
    # the directory exists: another process got there first
    except OSError:
        shutil.rmtree(tmp)
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            raise


# ----------------------------------------------------------------------------- the real-shape model

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                  # Qwen/Qwen2.5-0.5B-Instruct's config.json (24 layers)
                  rope_theta=1e6, rms_norm_eps=1e-6)
# Qwen2's special-token ids
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build_real_shape_tokenizer():
    """A byte-level BPE tokenizer laid out like Qwen2's: 151643 ordinary tokens (the 256 byte symbols,
    then two- and three-byte fillers no merge ever produces, so text round-trips byte by byte), then
    <|endoftext|>, <|im_start|>, <|im_end|> at Qwen's ids, and the ChatML template. The model's
    vocabulary (151936) is larger than the tokenizer's, as in the real checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # 256 printable stand-ins for the bytes
    symbols = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(sorted(symbols))}
    fillers = itertools.chain(itertools.product(sorted(symbols), repeat=2),
                              itertools.product(sorted(symbols), repeat=3))
    for piece in itertools.islice(fillers, ENDOFTEXT - len(vocab)):
        vocab["".join(piece)] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    # appended in this order
    core.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) != [ENDOFTEXT, IM_START,
                                                                                      IM_END]:
        raise RuntimeError("real-shape tokenizer: special tokens must sit at Qwen2's ids 151643-151645")
    tok.chat_template = CHATML
    return tok


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """GSM8K-format rows: a word problem `question` and an `answer` holding the worked solution and
    the final `#### N` line, as openai/gsm8k's parquet/JSONL files do."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randint(2, 50), rng.randint(2, 50)
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                     "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"})
    return rows


def make_real_shape(out_dir: str, layers: int = 2, seed: int = 0, n_train: int = 64, n_test: int = 8) -> dict:
    """Write a Qwen2.5-0.5B-shaped model (`layers` deep, random init, saved in bf16 like the real
    checkpoint) with its tokenizer, and GSM8K-format train/test JSONL, under `out_dir`.
    Returns {"model": dir, "train": file, "test": file}; an existing model dir is reused."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    model_dir = os.path.join(out_dir, f"qwen2.5-0.5b-shape-{layers}l-seed{seed}")
    paths = {"model": model_dir, "train": os.path.join(out_dir, "gsm8k_train.jsonl"),
             "test": os.path.join(out_dir, "gsm8k_test.jsonl")}
    os.makedirs(out_dir, exist_ok=True)
    rows = gsm8k_rows(n_train + n_test, seed)
    for split, items in (("train", rows[:n_train]), ("test", rows[n_train:])):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in items)
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return paths
    torch.manual_seed(seed)
    config = Qwen2Config(num_hidden_layers=layers, bos_token_id=ENDOFTEXT, eos_token_id=IM_END,
                         pad_token_id=ENDOFTEXT, **QWEN25_05B)
    # Qwen ships bf16 weights
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT, eos_token_id=[IM_END, ENDOFTEXT],
                                               pad_token_id=ENDOFTEXT)
    save_model_dir(model, build_real_shape_tokenizer(), model_dir)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanorl.task",
                                 description="Write the built-in task and model (or the real-shape model) to "
                                             "DIR.")
    ap.add_argument("dir", nargs="?", help="output directory (default runs/default, or runs/real_shape)")
    ap.add_argument("--real-shape", action="store_true", help="the Qwen2.5-0.5B-shaped rehearsal model")
    ap.add_argument("--layers", type=int, default=2, help="--real-shape: decoder layers (the real model: 24)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.real_shape:
        print(make_real_shape(a.dir or "runs/real_shape", layers=a.layers, seed=a.seed))
    else:
        print(make_default(a.dir or "runs/default", seed=a.seed))


if __name__ == "__main__":
    main()
