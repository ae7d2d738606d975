"""DCPO — Decoupled Calibration Policy Optimization (arXiv 2603.09117) — as ONE nanorl plug-in file.

Fills link 2 of the chain (reward + reward_postprocess) and link 4 (advantage); the loss is nanorl's PPO,
unchanged. The model answers, then states how sure it is; training must make it more accurate AND better
calibrated, without the two signals interfering. Here on nanorl's built-in task (sums of three digits,
nanorl/task.py) with one confidence digit after the answer:

    prompt "3+4+9="   response "16-7<eos>"   answer 16, confidence c = 7/9

Everything goes through nanorl's plug-in points (nanorl/plugins.py); nothing under nanorl/ knows DCPO.
The five steps, in file order (the walk-through, with why: docs/extending.md): 1. `reward` (accuracy,
trained; confidence and its token position, log-only), 2. `reward_postprocess` (per group: hybrid
accuracy, calibration error, each GRPO-normalised), 3. `advantage` (by token position, never added), 4. the
loss: nanorl's PPO/GRPO policy loss on that [B, T] tensor (no `policy_loss` here), 5. logs (`LOG_METADATA`,
under dcpo/) and `heldout_calibration`. Each function's docstring gives its rule. Another model: set
$DCPO_TOKENIZER to its --model (`tokenizer`).

    python train.py --algo grpo --plugin examples/dcpo.py --threads 1   # 800 steps, ~3 min on a laptop CPU
    python train.py --algo grpo --plugin examples/dcpo.py --steps 100  # the learning test's length
    # held-out calibration:
    python -m examples.dcpo runs/nanorl/checkpoints/step_000800 runs/nanorl/task/test.jsonl
    python -m pytest tests/test_dcpo.py -q
"""
from __future__ import annotations

import bisect
import functools
import json
import os
import random
import re

import torch

from nanorl.advantage import grpo

# between the answer and the confidence digit (the task's tokenizer has "-")
SEP = "-"
# α, the hybrid accuracy's mix, and w, the calibration weight
ALPHA, W = 0.5, 0.5
# ECE bins over [0, 1]
BINS = 10
LOG_METADATA = "dcpo/"
# "16-7" + EOS is 5 tokens; the built-in task's default is 4
CONFIG = {"max_new_tokens": 6}
FORMAT = re.compile(r"(-?\d+)" + re.escape(SEP) + r"(\d)")
# the run's --model (a directory or .gguf file), whose tokenizer maps the confidence onto the tokens
TOKENIZER_ENV = "DCPO_TOKENIZER"


def parse(response: str) -> tuple[str, float | None, int]:
    """→ (answer text, confidence in [0, 1] or None, character index where the confidence starts —
    or, without one, where it should have: after the answer and its separator). `token_position`
    turns the character index into a token index."""
    m = FORMAT.fullmatch(response)
    if m is not None:
        return m.group(1), int(m.group(2)) / 9, m.start(2)
    # no (or a malformed) confidence: the answer ends at the separator
    cut = response.find(SEP, 1)
    return (response, None, len(response)) if cut < 0 else (response[:cut], None, cut + 1)


@functools.cache
def tokenizer():
    """The run's tokenizer, loaded once per process: $DCPO_TOKENIZER's, else nanorl's character
    tokenizer (the one make_task's model has). No plug-in point is handed the trainer's tokenizer."""
    from nanorl.gguf_model import load_tokenizer
    from nanorl.task import build_tokenizer

    path = os.environ.get(TOKENIZER_ENV)
    return load_tokenizer(path) if path else build_tokenizer()


def token_position(tok, ids: list[int], char: int) -> int:
    """The index in `ids` (a response's token ids, EOS included) of the token that holds character
    `char` of the response text; `char` at the text's end: the first token after the text (the EOS).

    The token whose decoded prefix first reaches past `char` holds it. A token that straddles the
    boundary (a BPE piece "-7" holding the separator and the digit, or "6-7") holds the confidence's
    first character, so it starts the confidence span: the calibration advantage is the one it gets.
    A token with no text (a special sampled mid-answer) never holds a character. Prefixes are decoded
    as the reward's text was (score_samples: skip_special_tokens), so any tokenizer maps alike, even
    a sampled tokenization its encoder would never produce (offsets would need that re-encoding).
    """
    def reach(k):  # characters the first k tokens decode to; grows with k, hence the bisections
        return len(tok.decode(ids[:k], skip_special_tokens=True))

    # the first prefix reaching past `char`, its last token holding it (log R decodes, not R: a long
    # reasoning response before the confidence stays cheap)
    prefixes = range(len(ids) + 1)
    k = bisect.bisect_right(prefixes, char, key=reach)
    if k <= len(ids):
        return k - 1
    # `char` is the text's end (nothing after the answer): the token after the first prefix holding it all
    return bisect.bisect_left(prefixes, char, key=reach)


# ----------------------------------------------------------------------------- 1. reward
def reward(prompt: str, response: str, label: str, sample) -> dict:
    """{"correct": 0/1} trained; "_dcpo/confidence", "_dcpo/conf_pos" logged only (→ metadata).

    Accuracy (0/1, the only trained field) and, log-only ("_" keys → Sample.metadata), the stated confidence
    c and the token position where it starts (`token_position`: the text meets sample.response_ids here).
    No parsable confidence → the documented fallback: the worst calibration error, w·1, on the tokens where
    the confidence belongs (after the answer and separator). The other fallback, no calibration signal, was
    tried first: the negated calibration advantage then pushed mass off the digits onto EOS and the format
    decayed (held-out format rate 0.93 → 0.84 in 60 steps). Both count in `dcpo/format_rate`. Ids that
    `tokenizer()` does not decode to `response` raise (the reward faults): another model's tokenizer.
    """
    answer, conf, char = parse(response)
    out = {"correct": float(answer == str(label).strip()), "_dcpo/format_rate": float(conf is not None)}
    tok, ids = tokenizer(), sample.response_ids
    if tok.decode(ids, skip_special_tokens=True) != response:
        raise ValueError(f"examples/dcpo.py: the ids do not decode to the response {response!r} with "
                         f"{type(tok).__name__}: set ${TOKENIZER_ENV} to the run's --model")
    if conf is not None:
        out["_dcpo/confidence"] = conf
    out["_dcpo/conf_pos"] = float(token_position(tok, ids, char))
    return out


# ----------------------------------------------------------------------------- 2. reward post-processing
def normalised(x: list[float]) -> list[float]:
    """GRPO's within-group normalisation (r − mean)/(std + ε) of one group: nanorl.advantage.grpo."""
    if len(x) < 2:
        # no peer: no signal (nanorl's group-of-one rule)
        return [0.0] * len(x)
    adv, _ = grpo(mask=torch.ones(len(x), 1), index=torch.zeros(len(x), dtype=torch.long),
                  scores=torch.tensor(x))
    return adv[:, 0].tolist()


def ece(conf: list[float], right: list[float], bins: int = BINS) -> float:
    """Expected calibration error: Σ_bins (n_b / N)·|accuracy_b − mean confidence_b|."""
    total, n = 0.0, len(conf)
    for b in range(bins):
        rows = [i for i, c in enumerate(conf) if min(int(c * bins), bins - 1) == b]
        if rows:
            gap = sum(right[i] for i in rows) / len(rows) - sum(conf[i] for i in rows) / len(rows)
            total += len(rows) / n * abs(gap)
    return total


def reward_postprocess(samples: list) -> None:
    """Per group (consecutive samples sharing group_id): hybrid accuracy, calibration error, and the
    two GRPO-normalised advantages, written into each sample's metadata.

    Hybrid accuracy h = α·acc + (1 − α)·group_mean(acc) (α = 0.5); calibration error e = w·(h − c)² (w =
    0.5); acc and e are each normalised GRPO-style within the group, separately (nanorl.advantage.grpo),
    into metadata "dcpo/acc_adv" and "dcpo/cal_adv".
    """
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    for group in groups.values():
        acc = [float(s.reward["correct"]) for s in group]
        mean_acc = sum(acc) / len(acc)
        for s, a in zip(group, normalised(acc)):
            s.metadata.update({"dcpo/accuracy": s.reward["correct"], "dcpo/acc_adv": a})
        # where a confidence is (or belongs)
        placed = [s for s in group if "dcpo/conf_pos" in s.metadata]
        errors = []
        for s in placed:
            h = ALPHA * s.reward["correct"] + (1 - ALPHA) * mean_acc
            c = s.metadata.get("dcpo/confidence")
            # none stated: the worst error, w·1
            errors.append(W * (h - c) ** 2 if c is not None else W)
        for s, e, a in zip(placed, errors, normalised(errors)):
            s.metadata.update({"dcpo/cal_error": e, "dcpo/cal_adv": a})
            if "dcpo/confidence" in s.metadata:
                s.metadata["dcpo/brier"] = (s.metadata["dcpo/confidence"] - s.reward["correct"]) ** 2
    stated = [s for s in samples if "dcpo/confidence" in s.metadata]
    # a batch statistic: every stated sample carries it, so its logged mean is the value
    if stated:
        value = ece([s.metadata["dcpo/confidence"] for s in stated], [s.reward["correct"] for s in stated])
        for s in stated:
            s.metadata["dcpo/ece"] = value


# ----------------------------------------------------------------------------- 3. advantage
def advantage(*, mask, index, scores, metadata):
    """[B, T]: dcpo/acc_adv on tokens before dcpo/conf_pos, −dcpo/cal_adv from it on (assigned by
    position, never summed); a sample without a confidence gets acc_adv everywhere.

    Per token, by position, never added: acc_adv on every token before the confidence, −cal_adv on the
    confidence tokens (the digit and the EOS after it): a larger error must LOWER the probability of the
    digit that made it.
    """
    B, T = mask.shape
    acc = torch.tensor([m.get("dcpo/acc_adv", 0.0) for m in metadata], dtype=torch.float32)   # [B]
    cal = torch.tensor([m.get("dcpo/cal_adv", 0.0) for m in metadata], dtype=torch.float32)   # [B]
    pos = torch.tensor([int(m.get("dcpo/conf_pos", T)) for m in metadata])                    # [B], T: none
    before = torch.arange(T)[None, :] < pos[:, None]                                         # [B, T]
    adv = torch.where(before, acc[:, None], -cal[:, None])                                   # [B, T]
    adv = torch.where(mask > 0, adv, 0.0)                                                    # [B, T]
    # Statistics of the two advantages, per sample, for the logs (metadata is logged after this).
    for m, a in zip(metadata, acc.tolist()):
        m["dcpo/acc_adv_abs"] = abs(a)
    for m in metadata:
        if "dcpo/cal_adv" in m:
            m["dcpo/cal_adv_abs"] = abs(m["dcpo/cal_adv"])
    returns = torch.where(mask > 0, scores[:, None].float().expand(B, T), 0.0)               # [B, T]
    return adv, returns


# ----------------------------------------------------------------------------- the task and its warm start
def make_task(out_dir: str, seed: int = 0, sft_steps: int = 80, hidden: int = 128) -> dict:
    """nanorl's built-in sums, with a warm start that teaches "answer-digit": the SFT targets carry
    a uniformly random confidence digit, so the policy starts with the format and no calibration."""
    from nanorl.task import build_model, build_tokenizer, problems, save_model_dir, warm_start

    model_dir = os.path.join(out_dir, f"dcpo-qwen2-h{hidden}-sft{sft_steps}-seed{seed}")
    paths = {"model": model_dir, "train": os.path.join(out_dir, "train.jsonl"),
             "test": os.path.join(out_dir, "test.jsonl")}
    # the built-in split: the held-out sums are never trained on
    train, test = problems(seed=0)
    os.makedirs(out_dir, exist_ok=True)
    for split, items in (("train", train), ("test", test)):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in items)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        rng = random.Random(seed)
        sft = [{"prompt": x["prompt"], "answer": f"{x['answer']}{SEP}{rng.randrange(10)}"} for x in train]
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), seed=seed, hidden=hidden)
        warm_start(model, tokenizer, sft, steps=sft_steps, seed=seed)
        save_model_dir(model, tokenizer, model_dir)
    return paths


# ----------------------------------------------------------------------------- held-out calibration
def heldout_calibration(model_dir: str, test_file: str, limit: int = 0, max_new_tokens: int = 6,
                        temperature: float = 0.0, n: int = 1, seed: int = 0) -> dict:
    """Answers + stated confidence on the held-out prompts (greedy, or `n` samples per prompt at
    `temperature`): accuracy, Brier, ECE, format rate, mean confidence. A missing confidence is
    scored as the worst forecast (c = 1 − correct).

    The run's logs (`LOG_METADATA`): dcpo/accuracy, dcpo/confidence, dcpo/brier, dcpo/ece, the two
    advantages' statistics — under dcpo/. This function scores the policy's answers on the held-out split,
    greedy or sampled (Brier, ECE, accuracy, format rate).
    """
    from nanorl.policy import load_model
    from nanorl.rollout import HFEngine, SamplingConfig, stop_token_ids

    model, tok = load_model(model_dir)
    rows = [json.loads(line) for line in open(test_file)][: limit or None]
    engine = HFEngine(model, pad_id=tok.pad_token_id)
    engine.generator.manual_seed(seed)
    with torch.no_grad():
        samples = engine.generate([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows], n,
                                  SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens,
                                                 stop_token_ids=stop_token_ids(model, tok)))
    texts = tok.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    right, conf, stated = [], [], 0
    for s, text in zip(samples, texts):
        answer, c, _ = parse(text)
        y = float(answer == rows[s.group_id]["answer"])
        stated += c is not None
        right.append(y)
        conf.append(c if c is not None else 1.0 - y)
    k = len(samples)
    return {"accuracy": sum(right) / k, "brier": sum((c - y) ** 2 for c, y in zip(conf, right)) / k,
            "ece": ece(conf, right), "format_rate": stated / k, "confidence_mean": sum(conf) / k}


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(prog="python -m examples.dcpo",
                                 description="Held-out calibration of a policy.")
    ap.add_argument("model", help="a model or checkpoint directory")
    ap.add_argument("test_jsonl", help="the held-out prompts (the built-in task's test.jsonl)")
    a = ap.parse_args()
    for name, kw in (("greedy", {}), ("sampled (temperature 1, 4 per prompt)", {"temperature": 1.0, "n": 4})):
        print(name, json.dumps(heldout_calibration(a.model, a.test_jsonl, **kw)))
