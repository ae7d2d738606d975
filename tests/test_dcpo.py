"""DCPO (examples/dcpo.py), the worked example of the plug-in points: its reward, its per-group
post-processing and its by-position advantage on hand values, and a learning test on the built-in
task against the same run without the calibration term. Nothing under nanorl/ may mention DCPO.

    python -m pytest tests/test_dcpo.py -q
"""
import json
import re
from pathlib import Path

import pytest
import torch

import train
from nanorl.plugins import load_file
from nanorl.trajectory import Sample

pytestmark = pytest.mark.slow  # the slow tier (README): CI runs it, `-m slow`

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "dcpo.py")
dcpo = load_file(EXAMPLE)  # the very module --plugin loads


def char_ids(text: str) -> list[int]:
    """`text`'s ids under the built-in character tokenizer (the one dcpo.tokenizer() has by default)."""
    return dcpo.tokenizer()(text, add_special_tokens=False)["input_ids"]


def scored(response: str, label: str, group: int = 0) -> Sample:
    """A Sample of the character task (one token per character, then EOS), scored by dcpo.reward."""
    s = Sample(prompt_ids=[2], response_ids=char_ids(response) + [1], group_id=group)
    r = dcpo.reward("1+2+3=", response, label, s)
    s.reward = {"correct": r["correct"]}
    s.metadata.update({k[1:]: v for k, v in r.items() if k.startswith("_")})
    return s


def test_nothing_under_nanorl_mentions_dcpo():
    hits = [str(p) for p in (ROOT / "nanorl").rglob("*.py") if re.search("dcpo", p.read_text(), re.I)]
    assert not hits, hits


def test_reward_parses_answer_confidence_and_position():
    assert dcpo.parse("16-7") == ("16", 7 / 9, 3)
    assert dcpo.parse("16") == ("16", None, 2)         # no confidence: it belongs after the answer
    assert dcpo.parse("16-77") == ("16", None, 3)      # malformed: after the separator
    s = scored("6-9", "6")
    assert (s.reward == {"correct": 1.0} and s.metadata["dcpo/confidence"] == 1.0
            and s.metadata["dcpo/conf_pos"] == 2)
    s = scored("5", "6")
    assert (s.reward == {"correct": 0.0} and "dcpo/confidence" not in s.metadata
            and s.metadata["dcpo/format_rate"] == 0)


def test_token_position_is_the_old_character_index_under_the_character_tokenizer():
    """The character task's positions are what the one token per character rule gave; the mapping
    (its BPE side: tests/test_real_tokenizer.py) also places a <pad> sampled mid-answer, and a piece
    that straddles the separator and the digit starts the confidence span."""
    tok = dcpo.tokenizer()
    for text in ("16-7", "6-9", "-3-4", "16", "16-", "16-77", "1-2-3", ""):
        char = dcpo.parse(text)[2]
        for eos in ([1], []):  # completed, truncated
            assert dcpo.token_position(tok, char_ids(text) + eos, char) == char, (text, eos)
    # "1", <pad>, "6-7", EOS: the <pad> decodes to nothing (the old rule gave no calibration signal)
    assert dcpo.token_position(tok, [3, 0, 8, 13, 9, 1], 3) == 4
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({"<eos>": 0, "1": 1, "16": 2, "-7": 3, "6-7": 4}, unk_token="<eos>"))
    core.decoder = decoders.Fuse()
    pieces = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    assert dcpo.token_position(pieces, [2, 3, 0], 3) == 1  # "16" "-7": the piece holding the digit
    assert dcpo.token_position(pieces, [1, 4, 0], 3) == 1  # "1" "6-7": even with the answer's last digit
    assert dcpo.token_position(pieces, [2, 0], 2) == 1     # "16": no confidence, the EOS


def test_postprocess_hand_values():
    # One group: right & sure, right & unsure, wrong & unsure, wrong without a confidence.
    group = [scored("6-9", "6"), scored("6-0", "6"), scored("5-0", "6"), scored("5", "6")]
    dcpo.reward_postprocess(group)
    # h = 0.5·acc + 0.5·mean(acc) = 0.75, 0.75, 0.25, 0.25; e = 0.5·(h − c)², and w·1 = 0.5 when none.
    errors = torch.tensor([0.5 * 0.25 ** 2, 0.5 * 0.75 ** 2, 0.5 * 0.25 ** 2, 0.5])
    want = (errors - errors.mean()) / (errors.std() + 1e-6)
    got = torch.tensor([s.metadata["dcpo/cal_adv"] for s in group])
    assert torch.allclose(got, want, atol=1e-5)
    assert [s.metadata["dcpo/cal_error"] for s in group] == pytest.approx(errors.tolist())
    acc_adv = 0.5 / torch.tensor([1.0, 1, 0, 0]).std().item()  # (acc − 0.5) / std, the two signals apart
    got = [s.metadata["dcpo/acc_adv"] for s in group]
    assert got == pytest.approx([acc_adv, acc_adv, -acc_adv, -acc_adv], abs=1e-5)
    assert [s.metadata.get("dcpo/brier") for s in group] == [0.0, 1.0, 0.0, None]
    # ECE over the three stated: bin 9 holds (1.0, right): 0; bin 0 holds (0, right), (0, wrong): |0.5 − 0|.
    assert group[0].metadata["dcpo/ece"] == pytest.approx(2 / 3 * 0.5)


def test_advantage_by_position_hand_values():
    mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # [B, T]
    meta = [{"dcpo/acc_adv": 0.5, "dcpo/cal_adv": 0.8, "dcpo/conf_pos": 3.0},   # "16-7" + EOS
            {"dcpo/acc_adv": -0.5},                                             # no position: no calibration
            {"dcpo/acc_adv": 1.0, "dcpo/cal_adv": -0.3, "dcpo/conf_pos": 2.0}]  # "6-9" + EOS
    adv, _ = dcpo.advantage(mask=mask, index=torch.tensor([0, 0, 1]), scores=torch.tensor([1.0, 0, 1]),
                            metadata=meta)
    want = torch.tensor([[0.5, 0.5, 0.5, -0.8, -0.8],      # the calibration advantage NEGATED on the
                         [-0.5, -0.5, -0.5, 0.0, 0.0],     # confidence tokens (the digit and its EOS),
                         [1.0, 1.0, 0.3, 0.3, 0.0]])       # never added to the accuracy one
    assert torch.allclose(adv, want)


# Learning test. Sizes: 100 steps of 16 prompts × 8 samples, 6 new tokens, hidden 128, one thread —
# ~30-60 s per run on the shared 2-core CI box (two runs, plus the warm start and 4 evaluations of
# 200 held-out prompts × 4 samples). Measured (seeds 0 and 1, this box, loaded): held-out sampled Brier
# 0.396 at the start, DCPO 0.305 / 0.312, without the calibration term 0.385 / 0.467; accuracy 0.314 at
# the start, DCPO 0.388 / 0.379, without 0.417 / 0.386.
def test_dcpo_improves_heldout_calibration_without_hurting_accuracy(tmp_path):
    common = ["--algo", "grpo", "--steps", "100", "--max-new-tokens", "6", "--eval-every", "0",
              "--eval-limit", "1",
              # the lr the margins were measured at
              "--pass-k", "1", "--quiet", "--threads", "1", "--lr", "3e-4"]
    # its make_task: the model
    train.main(["--plugin", EXAMPLE, "--out-dir", str(tmp_path / "dcpo"), *common])
    task = tmp_path / "dcpo" / "task"
    start = str(next(task.glob("dcpo-qwen2-*")))
    # The same run without the calibration term: DCPO's reward and post-processing, GRPO's advantage
    # on the accuracy alone (every token, confidence digit included, gets the accuracy advantage).
    train.main(["--reward", f"{EXAMPLE}:reward", "--reward-postprocess", f"{EXAMPLE}:reward_postprocess",
                "--log-metadata", "dcpo/", "--model", start, "--train-data", str(task / "train.jsonl"),
                "--test-data", str(task / "test.jsonl"), "--out-dir", str(tmp_path / "base"), *common])
    ckpt = lambda run: str(sorted((tmp_path / run / "checkpoints").glob("step_*"))[-1])  # noqa: E731
    # Calibration of the policy's own answers: temperature 1 as in training, 4 per held-out prompt.
    evals = {name: dcpo.heldout_calibration(path, str(task / "test.jsonl"), temperature=1.0, n=4)
             for name, path in (("start", start), ("dcpo", ckpt("dcpo")), ("base", ckpt("base")))}
    print(json.dumps(evals))
    logged = [json.loads(x) for x in open(tmp_path / "dcpo" / "metrics.jsonl")]
    assert any({"dcpo/brier", "dcpo/ece", "dcpo/confidence", "dcpo/cal_adv_abs"} <= set(x) for x in logged)
    d, b, s = evals["dcpo"], evals["base"], evals["start"]
    assert d["brier"] <= b["brier"] - 0.04 and d["brier"] <= s["brier"] - 0.04, evals
    assert d["accuracy"] >= b["accuracy"] - 0.06 and d["accuracy"] >= s["accuracy"], evals
