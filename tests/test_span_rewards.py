"""Token- and step-level rewards and masks from a single-turn reward (nanorl/spans.py SpanReward, S0 §5.2
and §4.5): a reward function credits spans of its response and masks spans out of the loss; the credits
reach the token-reward estimators at the right tokens, the masked tokens take no gradient.
    python -m pytest tests/test_span_rewards.py -q
"""
import json

import pytest
import torch

from nanorl.advantage import compute_advantages
from nanorl.losses import LossConfig, total_loss
from nanorl.rewards import RewardRunner, score_samples
from nanorl.spans import SpanReward, span_reward_tensor
from nanorl.trajectory import Sample, collate

TEXT = "7+5 is 12, so: 12"  # the reasoning is TEXT[:13], the answer the rest
SPECIAL = 200  # a special token (EOS): the reward function reads the text without it


class Chars:
    """A character tokenizer: token i is character i; SPECIAL decodes to '<eos>' unless skipped."""
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == SPECIAL and skip_special_tokens else "<eos>" if i == SPECIAL else chr(i)
                       for i in ids)

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(r, skip_special_tokens) for r in rows]


class Prompt:
    text, label = "7+5?", "12"


def reasoning_credit(prompt, response, label):
    """0.25 for showing the sum (the span "7+5 is 12"), 1 for the final answer; the reasoning masked."""
    cut = response.index(", so")
    return SpanReward(reward=float(response.rsplit(" ", 1)[-1] == label), credit=[(0, cut, 0.25)],
                      masked=[(0, cut + len(", so:"))])


def scored(fn, texts=(TEXT,)):
    samples = [Sample(prompt_ids=[1], response_ids=[ord(c) for c in t] + [SPECIAL]) for t in texts]
    rewards = score_samples(RewardRunner(fn), Chars(), [Prompt()], samples)
    return samples, rewards


def test_credits_land_on_their_spans_last_token_and_sum_to_the_total():
    samples, rewards = scored(lambda p, r, lab: SpanReward(1.0, credit=[(0, 9, 0.25), (15, 17, 0.5)]))
    s = samples[0]
    # the reward: the outcome as the component `correct` (rollout/accuracy reads it) plus `spans`
    assert rewards == [{"correct": 1.0, "spans": 0.75}]
    s.reward = rewards[0]
    assert s.span_credits == [((0, 9), 0.25), ((15, 17), 0.5)] and s.loss_mask is None
    R = s.response_length  # 17 characters + EOS
    tr = span_reward_tensor(samples, R + 2)  # [B, T], T past the response
    want = torch.zeros(R + 2)
    want[8], want[16], want[R - 1] = 0.25, 0.5, 1.0  # "7+5 is 12"[-1], "12"[-1], the outcome at the end
    assert torch.equal(tr[0], want) and float(tr.sum()) == s.total_reward
    # no sample credited a span: the usual placement (the score on the last token) does the job
    plain, rewards = scored(lambda p, r, lab: 1.0)
    assert rewards == [1.0] and span_reward_tensor(plain, R) is None


def test_credits_reach_a_token_reward_estimator_at_their_positions():
    """REINFORCE++ reads token rewards: with γ = 1 a token's return is the rewards at and after it, so the
    tokens up to the credited span see its 0.25 and the later ones do not."""
    samples, rewards = scored(lambda p, r, lab: SpanReward(1.0, credit=[(0, 9, 0.25)]))
    samples[0].reward = rewards[0]
    batch = collate(samples * 2, pad_id=0)
    token_rewards = span_reward_tensor(samples * 2, batch.response_ids.shape[1])  # [B, T]
    _, returns = compute_advantages("reinforce_pp", token_rewards=token_rewards, mask=batch.response_mask,
                                    gamma=1.0)
    assert torch.allclose(returns[0, :9], torch.tensor(1.25)) and torch.allclose(returns[0, 9:18],
                                                                                  torch.tensor(1.0))


def test_masked_spans_leave_the_loss_and_a_credit_inside_moves_to_a_trained_token():
    samples, rewards = scored(reasoning_credit, (TEXT, "7+5 is 11, so: 11"))
    right, wrong = samples
    assert rewards == [{"correct": 1.0, "spans": 0.25}, {"correct": 0.0, "spans": 0.25}]
    masked = len("7+5 is 12, so:")
    assert right.loss_mask == [0] * masked + [1] * (right.response_length - masked)
    for s, r in zip(samples, rewards):
        s.reward = r
    tr = span_reward_tensor(samples, right.response_length)
    # the credited span is masked: its 0.25 lands on the last trained token, with the outcome
    assert tr[0].nonzero().squeeze(1).tolist() == [right.response_length - 1]
    assert torch.allclose(tr.sum(1), torch.tensor([1.25, 0.25]))
    batch = collate(samples, pad_id=0)
    mask = batch.response_mask.float()  # [B, T]
    logp = torch.randn(mask.shape, requires_grad=True)
    loss, _ = total_loss(LossConfig(), logp, logp.detach(), torch.ones(mask.shape), mask)
    grad, = torch.autograd.grad(loss, logp)
    assert (grad[:, :masked] == 0).all() and (grad[:, masked:right.response_length] != 0).all()


@pytest.mark.parametrize("bad", [
    SpanReward(1.0, credit=[(5, 2, 0.1)]),            # end before start
    SpanReward(1.0, credit=[(0, 2, float("nan"))]),   # a credit that is not finite
    SpanReward(1.0, masked=[(0.5, 2)]),               # not a character offset
    SpanReward(SpanReward(1.0)),                      # nested
])
def test_a_malformed_span_reward_is_a_counted_fault(bad):
    samples, rewards = scored(lambda p, r, lab: bad)
    assert samples[0].status == "reward_fault" and samples[0].span_credits is None


def test_a_user_reward_file_trains_with_span_credits(tmp_path, monkeypatch):
    """train.py with a reward file returning SpanReward (run in the reward worker processes, pickled
    back) and a token-reward estimator: REINFORCE++ gets each row's credit on its first token and the
    outcome on its last, and the credits are logged as the component rollout/reward/spans."""
    import train
    from nanorl import stages
    from nanorl.task import make_default
    seen, real = [], stages.compute_advantages

    def spy(name, **inputs):
        seen.append(inputs["token_rewards"].clone())
        return real(name, **inputs)
    monkeypatch.setattr(stages, "compute_advantages", spy)
    task = make_default(str(tmp_path / "task"), seed=0)
    fn = tmp_path / "span_reward.py"
    fn.write_text("from nanorl.spans import SpanReward\n\n\n"
                  "def reward(prompt, response, label):\n"
                  "    right = float(response.strip() == label.strip())\n"
                  "    return SpanReward(right, credit=[(0, 1, 0.1)])\n")
    out = tmp_path / "run"
    train.main(["--model", task["model"], "--train-data", task["train"], "--test-data", task["test"],
                "--out-dir", str(out), "--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                "--eval-every", "0", "--eval-limit", "8", "--quiet", "--algo", "grpo",
                "--advantage", "reinforce_pp", "--kl-coef", "0", "--reward", f"{fn}:reward"])
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "rollout/reward/spans" in r]
    assert len(steps) == 2 and all(r["rollout/reward/spans"] == pytest.approx(0.1) for r in steps)
    assert all(r.get("reward_faults/error", 0) == 0 for r in steps)
    # [B, T] each (no KL term): the credit on the first token, the outcome (0 or 1) after it
    assert len(seen) == 2
    for t in seen:
        assert torch.allclose(t[:, 0], torch.tensor(0.1)), t
        outcome = t[:, 1:].sum(1)  # [B]
        assert bool(((outcome == 0) | (outcome == 1)).all()) and bool((outcome == 1).any()), t
