"""The built-in default task and model: everything `python train.py --algo grpo` needs, made in code.

No download is possible on a fresh laptop, so the default run builds its own world:

1. A verifiable task: small-number arithmetic. A prompt is ``"3+4+9="`` and the answer is ``"16"``
   followed by the end-of-sequence token: all 1000 sums of three one-digit numbers, split
   deterministically into 800 train and 200 held-out problems. The held-out problems are never
   trained on, so "accuracy" measures whether the policy learned to add, not a lookup table (with
   one-digit ``a+b`` the tiny model memorises pairs and held-out accuracy stalls near 50%).
   The reward (nanorl/rewards.py, ``exact``) is 1 for the exact answer then EOS, else 0.
2. A character-level tokenizer (digits, ``+ - =``, <pad>, <eos>) built with the ``tokenizers``
   library and saved as a standard ``PreTrainedTokenizerFast``, so loading it is the same code path
   as any real model. A small vocabulary matters: with 45 tokens the warm-started policy sampled
   junk characters at temperature 1 and GRPO saw almost no reward.
3. A tiny Qwen2 (hidden 128, 2 layers, 2 heads of 32, ~400k parameters) with random weights — a
   real Hugging Face architecture, so the rollout engine, the logprob recompute and weight saving
   are the real ones. (Hidden 64 learned too, but plateaued near 70% held-out accuracy.)
4. A short supervised warm-start (60 steps of 128 examples, lr 1e-3) on the train problems, so the
   policy starts partially right (~27% held-out greedy accuracy), as real RL starts from an SFT model. From
   random init the policy collapses to one answer: most groups then have all-equal rewards and
   GRPO has no signal (../shared/FACTS.md).

`make_default(out_dir, seed)` writes ``train.jsonl``, ``test.jsonl`` and the model directory (model
and tokenizer, loadable by ``AutoModelForCausalLM`` / vLLM), and train.py then runs on those files
exactly as it would on a user's data and model. Run it alone:

    python -m nanorl.task runs/default
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys

import torch

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
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS] + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # every char is a token
    core.decoder = decoders.Fuse()  # decode joins characters back without spaces
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
    rows = [tokenizer(x["prompt"])["input_ids"] + tokenizer(x["answer"])["input_ids"] +
            [tokenizer.eos_token_id] for x in items]
    plen = [len(tokenizer(x["prompt"])["input_ids"]) for x in items]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)  # [N, S] right-padded
    labels = torch.full((len(rows), width), -100)  # [N, S] -100 = not trained on
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, plen[i]:len(r)] = torch.tensor(r[plen[i]:])  # the answer and its EOS only
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(rows), (batch_size,), generator=gen)
        loss = model(input_ids=ids[pick], attention_mask=(ids[pick] != tokenizer.pad_token_id).long(),
                     labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def make_default(out_dir: str, seed: int = 0, sft_steps: int = 60, hidden: int = 128,
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
    train, test = problems(seed=0)  # the split is fixed: held-out problems never change with the seed
    os.makedirs(out_dir, exist_ok=True)
    for split, items in (("train", train), ("test", test)):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in items)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), seed=seed, hidden=hidden)
        sft_items = train[: max(1, int(len(train) * sft_fraction))]
        warm_start(model, tokenizer, sft_items, steps=sft_steps, seed=seed)
        tmp = f"{model_dir}.tmp{os.getpid()}"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, model_dir)  # atomic: a half-written model dir is never picked up
        except OSError:  # another process built the same model first: use theirs
            shutil.rmtree(tmp)
            if not os.path.exists(os.path.join(model_dir, "config.json")):
                raise
    return paths


if __name__ == "__main__":
    print(make_default(sys.argv[1] if len(sys.argv) > 1 else "runs/default"))
