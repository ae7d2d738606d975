"""Math grading: is the final answer of a response the label's answer? (inside the reward link)

    rollout → reward → logprob recompute → advantage → loss → backward → optimizer step → weight sync
              ^^^^^^

Grading a math response is two jobs, and nanorl does only the first itself:

1. Extraction: which span of the response is its final answer (nanorl's code: math-verify has no
   rule for GSM8K's "####", and it merges every \\boxed{} of a response into one set, so a response
   that boxes a wrong answer and then the right one would be graded as the set of both):
   - the last \\boxed{...} or \\fbox{...}, nested braces allowed (MATH's convention; verl's
     `last_boxed_only_string`): a later box is a correction of an earlier one;
   - else the text after the last "####" on its line (GSM8K);
   - else what follows the last "answer is" / "answer:" up to the end of that sentence;
   - else no marked answer: math-verify looks for one in the response's last `TAIL_CHARS`
     characters (the final answer sits at the end; the whole of a 100k-character response would
     only cost time).
   A label goes through the same extraction, so a GSM8K label (the worked solution, then
   "#### 72") and a MATH solution (... \\boxed{\\frac{1}{2}}) reduce to their answers, and a plain
   label ("72", "\\frac{1}{2}") is taken as it is.
2. Equivalence: `math-verify` (Hugging Face's parser and verifier, the one open-r1 and TRL's math
   recipes use) parses both spans to SymPy and compares them: 1/2 = 0.5 = \\frac12 = \\dfrac{1}{2},
   1,000 = 1000, x=5 vs 5, 10\\% vs 10, \\left(3,\\frac{\\pi}{2}\\right) = (3,\\frac{\\pi}{2}),
   intervals, sets, units in \\text{}. It is not symmetric (an equation label "x=5" accepts "5",
   not the reverse), so the label is always the gold side.

Time is bounded three ways: a span longer than `MAX_ANSWER_CHARS` is wrong without parsing (no final
answer is that long, and parse time grows with it); math-verify's own alarms stop a parse or a
comparison after `VERIFY_TIMEOUT_S` (they need the main thread, so elsewhere they are off); and the
trainer runs the math rewards in worker processes with a per-call timeout by default
(`--reward-timeout`, nanorl/rewards.py), which also stops what an alarm cannot interrupt.

    python -c "from nanorl.math_grader import grade; print(grade('so \\\\boxed{\\\\frac12}', '#### 0.5'))"
"""
from __future__ import annotations

import logging
import re
import threading

MAX_ANSWER_CHARS = 512  # longest answer span worth parsing (MATH-500's longest answer is ~60)
TAIL_CHARS = 300  # an unmarked answer is searched for in this many final characters
VERIFY_TIMEOUT_S = 2  # math-verify's alarm for one parse / one comparison (whole seconds)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} / \\fbox{...} (nested braces); None if none is closed."""
    starts = [m.end() for m in _BOX.finditer(text)]  # just after each box's "{"
    if not starts:
        return None
    close, stack = {}, []  # one pass pairs every brace: linear even for 20k unclosed boxes
    for j in range(starts[0] - 1, len(text)):
        if text[j] == "{":
            stack.append(j)
        elif text[j] == "}" and stack:
            close[stack.pop()] = j
    for start in reversed(starts):  # an unclosed last box: fall back to the one before it
        if start - 1 in close:
            return text[start:close[start - 1]]
    return None


def extract_answer(text: str) -> str | None:
    """The final-answer span: last box, else after the last "####", else after the last "answer
    is" (to the end of that sentence); None when the text marks no answer."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = text.rfind("####")
    if hashes >= 0:
        return text[hashes + 4:].split("\n", 1)[0].strip()
    marks = list(_ANSWER_IS.finditer(text))
    if marks:
        rest = text[marks[-1].end():].split("\n", 1)[0]
        return re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0].strip().strip("$ ")  # "... is $72$. So" -> 72
    return None


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the math reward needs math-verify: pip install 'math-verify==0.9.0' "
                          "(it is in requirements.txt)") from e
    for name in ("math_verify", "latex2sympy2_extended"):  # each timeout would print the whole input
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return math_verify


def _parse(span: str, marked: bool):
    """SymPy forms of an answer span (math-verify), [] when it parses to nothing."""
    mv = _math_verify()
    alarm = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    # A marked span is the answer itself: box it so math-verify reads it whole; an unmarked tail is
    # searched with its default LaTeX + plain-expression extraction.
    return mv.parse(f"\\boxed{{{span}}}" if marked else span, parsing_timeout=alarm)


def grade(response: str, label: str) -> bool:
    """True when the response's final answer is mathematically equal to the label's answer."""
    gold_span = extract_answer(str(label))
    gold_span = str(label).strip() if gold_span is None else gold_span
    pred_span = extract_answer(response)
    marked = pred_span is not None
    pred_span = response[-TAIL_CHARS:] if pred_span is None else pred_span
    if not gold_span or not pred_span or len(gold_span) > MAX_ANSWER_CHARS or (marked and len(pred_span) > MAX_ANSWER_CHARS):
        return False
    gold, pred = _parse(gold_span, marked=True), _parse(pred_span, marked)
    if not gold or not pred:
        return False
    alarm = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return bool(_math_verify().verify(gold, pred, timeout_seconds=alarm))
