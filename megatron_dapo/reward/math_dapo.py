"""DAPO's rule-based math reward: +1 when the final answer matches the ground truth, -1 otherwise.

The behaviour reproduces the reference implementation that the DAPO paper was trained with,
``verl/utils/reward_score/math_dapo.py`` in volcengine/verl (itself adapted from the
Minerva / Hendrycks-MATH answer normalisation of lm-evaluation-harness). The substitution table,
the list of removed expressions and the order of the regular expressions below are what define
which answers count as equal, so they are kept exactly as the reference has them, quirks included
(for example ``"a "`` is deleted anywhere, not only as a word, and ``"sue"`` is removed
wherever it appears because of one MATH problem).

Only pure-Python string work happens here: the function is cheap, deterministic and safe to call
in worker processes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Optional

__all__ = [
    "ANSWER_PATTERN",
    "INVALID",
    "REMOVED_EXPRESSIONS",
    "SUBSTITUTIONS",
    "compute_score",
    "last_boxed_content",
    "normalize_final_answer",
]

INVALID = "[INVALID]"
"""Prediction reported when no answer could be extracted (the reference's placeholder)."""

RESPONSE_TAIL_CHARS = 300
"""Only this many trailing characters of a response are looked at (the reference's cut-off)."""

STRICT_BOX_TAIL_CHARS = 100
"""The strict boxed check looks for ``\\boxed{}`` in this many trailing characters."""

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
"""The reference's answer-line pattern. ``\\s*`` may span newlines, so ``"Answer:\\n42"`` yields ``"42"``."""

# Plain `str.replace` pairs, applied in this order (the Minerva table as verl has it).
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Deleted with `str.replace(expr, "")`, in this order, after the substitutions.
# Two entries contain a real newline character ("\\text{\ns}" and "\\text{\n}"), as in the reference.
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# Regex rewrites applied in this order after the removals (patterns and replacements as in the
# reference). Note that `.` does not cross newlines, and that `\boxed{` is unwrapped greedily
# (up to the LAST closing brace) while `\text{`, `\textbf{`, `\overline{` stop at the first one.
_TEX_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep only the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrt2 -> \sqrt{2}
)

_ANSWER_RE = re.compile(ANSWER_PATTERN)
_BOX_OPEN = "\\boxed{"


def normalize_final_answer(final_answer: str) -> str:
    """Normalise a final answer the Minerva / Hendrycks-MATH way (as verl's ``math_dapo`` does).

    Steps, in order: keep the text after the last ``=``; apply `SUBSTITUTIONS`; delete
    `REMOVED_EXPRESSIONS`; apply the TeX regex rewrites (first ``$...$`` span, unwrap
    ``\\text{}``/``\\textbf{}``/``\\overline{}``/``\\boxed{}``, expand ``\\frac12`` and ``\\sqrt2``);
    drop ``$``; drop commas from a string that is all digits once commas are removed (Python's
    Unicode-aware ``str.isdigit``); strip surrounding whitespace.
    """
    text = final_answer.split("=")[-1]
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    for expression in REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    for pattern, replacement in _TEX_REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    without_commas = text.replace(",", "")
    if without_commas.isdigit():
        text = without_commas
    return text.strip()


def last_boxed_content(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` in `text`, braces balanced; None if absent or unclosed.

    Like the reference, only the literal ``\\boxed{`` form counts (not ``\\boxed 5`` or ``\\fbox{}``),
    and the brace count starts at the box's own opening brace.
    """
    start = text.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for position in range(start + len(_BOX_OPEN) - 1, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOX_OPEN) : position]
    return None


def _strict_box_check(tail: str, ground_truth: str, pause_tokens_index: Optional[Sequence[int]]) -> tuple[bool, str]:
    """The reference's strict mode: last ``\\boxed{}`` of the final 100 characters, compared verbatim."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {len(pause_tokens_index)}")
        # Same slice as the reference: relative to the already-truncated tail; a start below zero
        # counts from the end, as Python slicing does.
        window = tail[pause_tokens_index[-1] - STRICT_BOX_TAIL_CHARS :]
    else:
        window = tail[-STRICT_BOX_TAIL_CHARS:]
    boxed = last_boxed_content(window)
    prediction = boxed if boxed is not None else INVALID
    return prediction == ground_truth, prediction


def compute_score(
    response: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Optional[Sequence[int]] = None,
    *,
    boxed_fallback: bool = True,
) -> dict:
    """Score one response against its ground truth with DAPO's rule-based math reward.

    Returns ``{"score": +1.0 or -1.0, "acc": bool, "pred": str}``.

    Where this equals the reference (verl ``math_dapo.compute_score``):

    * Always, only the last 300 characters of `response` are considered.
    * ``strict_box_verify=True``: exactly the reference's strict mode. The last ``\\boxed{...}`` in
      the final 100 characters of that tail (or from ``pause_tokens_index[-1] - 100`` when given)
      is compared verbatim, without normalisation, to the raw ground truth; ``pred`` is the boxed
      content, or ``"[INVALID]"``. `boxed_fallback` is ignored.
    * ``strict_box_verify=False`` (the reference default, used by DAPO): the answer is the last
      match of ``(?i)Answer\\s*:\\s*([^\\n]+)`` in the tail; it and the ground truth go through
      `normalize_final_answer` and are compared for equality; ``pred`` is the normalised answer.
      With ``boxed_fallback=False`` this mode is the reference, bit for bit.

    The one addition (``boxed_fallback=True``, our default): when the tail has NO ``Answer:`` match,
    the reference would score ``"[INVALID]"``; we instead apply the strict check above, i.e. the
    last ``\\boxed{}`` in the final 100 characters, compared verbatim with the raw ground truth,
    ``pred`` being the boxed content. If there is no box either, the result is the reference's
    (``pred`` ``"[INVALID]"``, compared after normalisation like any prediction, which makes it
    wrong for every real ground truth). Responses that contain an ``Answer:`` line are scored
    exactly as by the reference, whatever boxes they contain.
    """
    if not isinstance(response, str) or not isinstance(ground_truth, str):
        raise TypeError(
            f"compute_score expects str response and ground truth, got {type(response).__name__} "
            f"and {type(ground_truth).__name__}"
        )
    tail = response[-RESPONSE_TAIL_CHARS:]

    if strict_box_verify:
        correct, prediction = _strict_box_check(tail, ground_truth, pause_tokens_index)
    else:
        answers = _ANSWER_RE.findall(tail)
        boxed = None
        if not answers and boxed_fallback:
            boxed = last_boxed_content(tail[-STRICT_BOX_TAIL_CHARS:])
        if boxed is not None:
            correct, prediction = boxed == ground_truth, boxed
        else:
            prediction = normalize_final_answer(answers[-1] if answers else INVALID)
            correct = prediction == normalize_final_answer(ground_truth)

    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction}
