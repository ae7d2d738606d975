"""Dropout is off in every RL forward: a checkpoint that trains with dropout (GPT-2's family: 0.1) would
otherwise score every logprob through a fresh random mask while the engine sampled with none."""
import json

import pytest
import torch

from nanorl.policy import load_model
from nanorl.task import build_tokenizer, make_default


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny random GPT-2 (attn/resid/embd dropout 0.1, its config's default) on the built-in tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                       eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.pad_token_id))
    assert model.config.attn_pdrop == model.config.resid_pdrop == 0.1
    d = tmp_path_factory.mktemp("gpt2") / "gpt2"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_a_dropout_checkpoint_loads_with_dropout_off_and_says_so(gpt2_dir, capsys):
    model, _ = load_model(gpt2_dir)
    assert "has dropout on (attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1" in capsys.readouterr().out
    model.train()  # as the trainer holds it
    ids = torch.randint(2, 15, (4, 12))
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert torch.equal(a, b)  # with dropout on: two draws of the mask differ
    assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.0


def test_the_first_epochs_ratio_is_one_with_a_dropout_checkpoint(gpt2_dir, tmp_path):
    """π_old recomputed in its own forward, then the update's forward with gradient: the same weights,
    so the same logprobs up to float order (1e-6), as the sampling engine's; with dropout on they are
    ~0.1 apart and the ratio spreads around 1."""
    import train
    task = make_default(str(tmp_path / "task"), seed=0, sft_steps=0)
    res = train.main(["--model", gpt2_dir, "--train-data", task["train"], "--test-data", task["test"],
                      "--steps", "1", "--prompts-per-step", "4", "--samples-per-prompt", "4", "--eval-limit",
                      "2", "--eval-every", "0", "--old-logprobs", "recompute", "--kl-coef", "0", "--quiet",
                      "--no-skip-zero-advantage",  # a random model scores 0: train every row anyway
                      "--threads", "1", "--max-new-tokens", "8", "--out-dir", str(tmp_path / "run")])
    row = next(r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "train/loss" in r)
    assert res["step"] == 1 and row["train/num_tokens"] > 0
    assert abs(row["train/ratio_max"] - 1) < 1e-5 and abs(row["train/ratio_mean"] - 1) < 1e-5
    # the engine's logprobs (eval mode) against the trainer's π_old recompute
    assert row["train/logprob_diff_abs_max"] < 1e-4 and abs(row["train/mismatch/ratio_max"] - 1) < 1e-5
