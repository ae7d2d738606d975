"""Math grading: is the final answer of a response the label's answer? (inside link 2, the reward)

Two jobs, and nanorl does only the first itself. 1. Extraction (`extract_answer`): the last \\boxed{...}
or \\fbox{...}, else the text after the last "####" (GSM8K), else after the last "answer is" /
"answer:", else math-verify looks in the last `TAIL_CHARS` characters; a label goes through the same
extraction, so a GSM8K or MATH solution reduces to its answer. 2. Equivalence: `math-verify` (Hugging
Face's parser and verifier) parses both spans to SymPy and compares them, the label always the gold
side. Start at `grade`. Key choices: nanorl's own extraction (math-verify has no "####" rule and merges
every box of a response), time bounded three ways (`MAX_ANSWER_CHARS`, `VERIFY_TIMEOUT_S`, worker
processes). The rules in full and why: docs/from-slime-verl.md, "nanorl/math_grader.py".

    python -c "from nanorl.math_grader import grade; print(grade('so \\\\boxed{\\\\frac12}', '#### 0.5'))"
"""
from __future__ import annotations

import logging
import re
import threading

# longest answer span worth parsing (MATH-500's longest answer is ~60)
MAX_ANSWER_CHARS = 512
# an unmarked answer is searched for in this many final characters
TAIL_CHARS = 300
# math-verify's alarm for one parse / one comparison (whole seconds)
VERIFY_TIMEOUT_S = 2

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} / \\fbox{...} (nested braces); None if none is closed."""
    # just after each box's "{"
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    # one pass pairs every brace: linear even for 20k unclosed boxes
    close, stack = {}, []
    for j in range(starts[0] - 1, len(text)):
        if text[j] == "{":
            stack.append(j)
        elif text[j] == "}" and stack:
            close[stack.pop()] = j
    # an unclosed last box: fall back to the one before it
    for start in reversed(starts):
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
        # "... is $72$. So" -> 72
        return re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0].strip().strip("$ ")
    return None


def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the math reward needs math-verify: pip install 'math-verify==0.9.0' "
                          "(it is in requirements.txt)") from e
    # each timeout would print the whole input
    for name in ("math_verify", "latex2sympy2_extended"):
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
    if not gold_span or not pred_span or len(gold_span) > MAX_ANSWER_CHARS or (marked and len(pred_span) >
                                                                               MAX_ANSWER_CHARS):
        return False
    gold, pred = _parse(gold_span, marked=True), _parse(pred_span, marked)
    if not gold or not pred:
        return False
    alarm = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return bool(_math_verify().verify(gold, pred, timeout_seconds=alarm))
