"""--mask-think (nanorl/spans.py): the reasoning's tokens leave the loss, on the built-in character
tokenizer and on SmolLM2's BPE tokenizer (where tags split into pieces), through to the update's mask."""
import pytest
import torch

from nanorl.losses import LossConfig, total_loss
from nanorl.spans import mask_think, think_spans, token_at
from nanorl.trajectory import Sample, collate


@pytest.mark.parametrize("text, want", [
    ("<think>a b</think>42", ["<think>a b</think>"]),
    ("reason</think>42", ["reason</think>"]),  # the template opened <think> in the prompt
    ("<think>never closed", ["<think>never closed"]),  # truncated while thinking
    ("plain 42", []),
    ("<think>x</think>y<think>z</think>w", ["<think>x</think>", "<think>z</think>"]),
    ("a</think>b<think>c", ["a</think>", "<think>c"]),
])
def test_think_spans(text, want):
    assert [text[a:b] for a, b in think_spans(text)] == want


class Chars:
    """A character tokenizer: token i is character i."""
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_the_thinking_tokens_leave_the_loss_and_get_no_gradient():
    tok = Chars()
    ids = [ord(c) for c in "<think>7+5=12</think>12"]
    env = Sample(prompt_ids=[1], response_ids=[ord(c) for c in "<think>x</think>ab"],
                 loss_mask=[1] * 16 + [0, 1])  # an environment token stays masked
    plain = Sample(prompt_ids=[1], response_ids=[ord(c) for c in "12"])
    s = Sample(prompt_ids=[1], response_ids=ids)
    frac = mask_think([s, env, plain], tok)
    assert s.loss_mask == [0] * 21 + [1, 1] and env.loss_mask == [0] * 17 + [1] and plain.loss_mask is None
    assert frac == pytest.approx((21 + 16) / (23 + 18 + 2))
    batch = collate([s, env, plain], pad_id=0)
    mask = batch.response_mask.float()  # [B, T]
    logp = torch.randn(mask.shape, requires_grad=True)
    loss, _ = total_loss(LossConfig(), logp, logp.detach(), torch.ones(mask.shape), mask)
    grad, = torch.autograd.grad(loss, logp)
    assert (grad[0, :21] == 0).all() and (grad[0, 21:23] != 0).all()


def test_bpe_tags_split_into_pieces_are_found_by_their_text(smollm2):
    from nanorl.gguf_model import load_tokenizer
    tok = load_tokenizer(smollm2)
    think, answer = "<think>17 + 25 is 42, so</think>", " The answer is 42."
    ids = tok(think + answer, add_special_tokens=False)["input_ids"]
    assert len(tok(OPEN_TAG, add_special_tokens=False)["input_ids"]) > 1  # not one special token here
    s = Sample(prompt_ids=[1], response_ids=ids)
    mask_think([s], tok)
    kept = [i for i, m in zip(ids, s.loss_mask) if m]
    dropped = [i for i, m in zip(ids, s.loss_mask) if not m]
    assert tok.decode(dropped).startswith("<think>") and "</think>" in tok.decode(dropped)
    assert tok.decode(kept).strip() == answer.strip() and ids[:len(dropped)] == dropped
    # token_at: the token that holds a character
    end = len(think) - 1  # the closing ">"
    assert tok.decode(ids[:token_at(tok, ids, end) + 1]).endswith("</think>")


OPEN_TAG = "<think>"


def test_mask_think_reaches_the_update(smollm2, tmp_path, monkeypatch):
    """A run with --mask-think on a tiny random Llama with SmolLM2's tokenizer, whose engine answers
    "<think>…</think> 42": the update's mask is 0 on the thinking and 1 on the answer, and the step
    logs rollout/think_masked_frac."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    import train
    from nanorl import rounds
    from nanorl.config import Config
    from nanorl.gguf_model import load_tokenizer
    tok = load_tokenizer(smollm2)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = train.setup(Config.from_flags(model=str(tmp_path / "model"), train_data=str(data), test_data="",
                                        quiet=True,
                             out_dir=str(tmp_path / "run"), prompts_per_step=2, samples_per_prompt=2,
                             max_new_tokens=4, reward="math", reward_timeout=0, mask_think=True, kl_coef=0,
                             skip_zero_advantage=False))  # every row trains: its mask is the update's
    think = tok("<think>x is 1</think>", add_special_tokens=False)["input_ids"]
    answer = tok(" 42", add_special_tokens=False)["input_ids"]
    real = rounds.generate

    def thinking(run, prompts, n, sampling):
        out = real(run, prompts, n, sampling)
        for s in out:
            s.response_ids, s.rollout_logprobs, s.status = think + answer, None, "completed"
        return out
    monkeypatch.setattr(rounds, "generate", thinking)
    seen, update = [], train.train_on
    monkeypatch.setattr(train, "train_on", lambda run, batch: seen.append(batch.response_mask.clone())
                        or update(run, batch))
    metrics = train.rl_step(run)
    want = [0] * len(think) + [1] * len(answer)
    assert [row.tolist() for row in seen[0]] == [want] * 4
    assert metrics["rollout/think_masked_frac"] == pytest.approx(len(think) / len(want))
    run.logger.close()
