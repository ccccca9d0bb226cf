"""math_dapo.compute_score against a hand-written table.

Every expected value below was derived by applying the reference rules (verl
`verl/utils/reward_score/math_dapo.py`) by hand, step by step: keep the last 300 characters, take
the last `(?i)Answer\\s*:\\s*([^\\n]+)` match, normalise prediction and ground truth (text after
the last '=', the substitution table, the removed expressions, then the TeX regexes, '$' dropped,
commas dropped from all-digit strings, strip), compare. Comments spell out the non-obvious steps.
"""

from __future__ import annotations

import pytest

from megatron_dapo.reward.math_dapo import INVALID, compute_score, last_boxed_content, normalize_final_answer

# (id, response, ground truth, expected score, expected pred)
CASES = [
    # --- extraction of the Answer line -------------------------------------------------------
    ("plain", "The sum is 12.\nAnswer: 12", "12", 1.0, "12"),
    ("plain-wrong", "Answer: 13", "12", -1.0, "13"),
    ("lowercase", "so we get\nanswer: 7", "7", 1.0, "7"),
    ("uppercase-space-before-colon", "ANSWER : 7", "7", 1.0, "7"),  # \s* allowed before ':'
    ("final-answer", "Final Answer: 7", "7", 1.0, "7"),  # no word boundary: matches inside 'Final Answer'
    ("several-lines-last-wins", "Answer: 3\nWait, no.\nAnswer: 5", "5", 1.0, "5"),
    ("several-lines-earlier-ignored", "Answer: 3\nWait, no.\nAnswer: 5", "3", -1.0, "5"),
    # `\s*` after the colon also eats the newline, so the value is taken from the next line.
    ("value-on-next-line", "Answer:\n42", "42", 1.0, "42"),
    # Nothing after 'Answer: ': \s* backtracks and [^\n]+ captures the single space -> '' after normalisation.
    ("empty-answer", "Answer: ", "5", -1.0, ""),
    ("carriage-return", "Answer: 5  \r", "5", 1.0, "5"),  # '\r' is kept by [^\n]+, then stripped
    # --- units and words ---------------------------------------------------------------------
    ("unit-inches", "Answer: 12 inches", "12", 1.0, "12"),  # ' ' removed -> '12inches' -> 'inches' removed
    ("unit-dollars", "Answer: 5 dollars", "5", 1.0, "5"),
    ("unit-degrees", "Answer: 90 degrees", "90", 1.0, "90"),
    ("unit-circ", "Answer: 90^\\circ", "90", 1.0, "90"),  # '^\circ' is a removed expression
    ("unit-in-text", "Answer: 5\\text{ cm}", "5", 1.0, "5"),  # -> '5\text{cm}' -> '5\text{}' -> '5'
    ("mbox", "Answer: 5\\mbox{ cm}", "5", 1.0, "5"),  # 'mbox' -> 'text', then as above
    ("article-a-deleted", "Answer: a triangle", "triangle", 1.0, "triangle"),  # 'a ' is deleted anywhere
    ("percent-not-normalised", "Answer: 5%", "5", -1.0, "5%"),
    ("unit-in-ground-truth", "Answer: 5", "5 \\text{ cm}", 1.0, "5"),  # the ground truth is normalised too
    # --- TeX wrappers ----------------------------------------------------------------------------
    ("text-unwrapped", "Answer: \\text{(B)}", "(B)", 1.0, "(B)"),
    ("textbf-unwrapped", "Answer: \\textbf{(C)}", "(C)", 1.0, "(C)"),
    ("textbf-vs-letter", "Answer: \\textbf{(C)}", "C", -1.0, "(C)"),
    ("overline", "Answer: 0.\\overline{3}", "0.3", 1.0, "0.3"),
    ("boxed-in-dollars", "Answer: $\\boxed{42}$", "42", 1.0, "42"),  # '$\boxed{42}$' -> '$42$' -> '42'
    ("boxed-nested-greedy", "Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("dfrac-not-normalised", "Answer: \\dfrac{1}{2}", "\\frac{1}{2}", -1.0, "\\dfrac{1}{2}"),
    # --- shorthand fractions and roots ----------------------------------------------------------
    ("frac12", "Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    # (frac)([^{])(.) also fires on '\frac1{2}': 'frac' '1' '{' -> '\frac{1}{{}2}', not equal.
    ("frac-half-shorthand", "Answer: \\frac1{2}", "\\frac{1}{2}", -1.0, "\\frac{1}{{}2}"),
    ("sqrt2", "Answer: 3\\sqrt2", "3\\sqrt{2}", 1.0, "3\\sqrt{2}"),
    ("sqrt-braced-untouched", "Answer: \\sqrt{12}", "\\sqrt{12}", 1.0, "\\sqrt{12}"),
    # --- numbers ---------------------------------------------------------------------------------
    ("comma-thousands", "Answer: 1,000", "1000", 1.0, "1000"),
    ("comma-millions", "Answer: 1,000,000", "1000000", 1.0, "1000000"),
    ("comma-tuple-kept", "Answer: (1,2)", "(1, 2)", 1.0, "(1,2)"),  # not all digits: commas stay
    ("comma-decimal-kept", "Answer: 1,000.5", "1000.5", -1.0, "1,000.5"),  # '1000.5'.isdigit() is False
    ("comma-bang", "Answer: 10,\\!000", "10000", 1.0, "10000"),  # ',\!' removed
    ("comma-braced", "Answer: 10{,}000", "10000", 1.0, "10000"),  # '{,}' removed
    # '2 \text{ and } 3' -> '2\text{and}3' -> '2,3' -> all digits once commas go -> '23'; the ground
    # truth '2,3' becomes '23' as well, so they match.
    ("text-and-list", "Answer: 2 \\text{ and } 3", "2,3", 1.0, "23"),
    ("no-numeric-equivalence", "Answer: 3.0", "3", -1.0, "3.0"),
    ("negative", "Answer: -5", "-5", 1.0, "-5"),
    ("unicode-minus", "Answer: \u2212 5", "-5", -1.0, "\u22125"),
    # --- '=' and '$' -----------------------------------------------------------------------------
    ("equals", "Answer: x = 5", "5", 1.0, "5"),  # text after the last '='
    ("equals-chain", "Answer: x=y=7", "7", 1.0, "7"),
    ("dollars-in-sentence", "Answer: The answer is $7$.", "7", 1.0, "7"),  # only the first $...$ span is kept
    ("single-dollar", "Answer: $x = 7$", "7", 1.0, "7"),  # split at '=' leaves ' 7$'; the lone '$' is dropped
    ("dot-dollar", "Answer: $7.$", "7", 1.0, "7"),  # '.$' -> '$'
    ("escaped-dollar", "Answer: \\$5", "5", 1.0, "5"),  # '\$' deleted
    # --- the 300-character window ------------------------------------------------------------------
    ("answer-before-window", "Answer: 5\n" + "x" * 300, "5", -1.0, INVALID),
    ("long-response-answer-at-end", "z" * 1000 + "\nAnswer: 7", "7", 1.0, "7"),
    # 'Answer: 5\n' + 290 'é' is exactly 300 code points (not bytes: 'é' is 2 bytes in UTF-8): still seen.
    ("window-300-codepoints", "Answer: 5\n" + "\u00e9" * 290, "5", 1.0, "5"),
    # One more character pushes the 'A' out of the window: 'nswer: 5' no longer matches.
    ("window-301-codepoints", "Answer: 5\n" + "\u00e9" * 291, "5", -1.0, INVALID),
    # --- no Answer line: the boxed fallback (our addition) --------------------------------------------
    ("no-answer", "I think it is 5.", "5", -1.0, INVALID),
    ("empty-response", "", "5", -1.0, INVALID),
    ("boxed-fallback", "So the result is $\\boxed{5}$.", "5", 1.0, "5"),
    ("boxed-fallback-wrong", "So the result is $\\boxed{6}$.", "5", -1.0, "6"),
    ("boxed-fallback-verbatim", "Thus \\boxed{1,000}", "1000", -1.0, "1,000"),  # no normalisation in this path
    ("boxed-fallback-nested", "Thus \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("boxed-fallback-last-box", "First \\boxed{4}, then \\boxed{5}", "5", 1.0, "5"),
    ("boxed-outside-last-100", "Thus \\boxed{5}" + "." * 100, "5", -1.0, INVALID),
    ("boxed-unclosed", "Thus \\boxed{5", "5", -1.0, INVALID),
    ("answer-line-beats-box", "\\boxed{5}\nAnswer: 6", "5", -1.0, "6"),
    # --- unicode -----------------------------------------------------------------------------------
    ("unicode-pi", "R\u00e9sultat\u2026 Answer: \u03c0/2", "\u03c0/2", 1.0, "\u03c0/2"),
    # str.isdigit() is Unicode-aware: Arabic-Indic digits with a comma lose the comma.
    ("unicode-digits", "Answer: \u0661,\u0662\u0663\u0664", "\u0661\u0662\u0663\u0664", 1.0, "\u0661\u0662\u0663\u0664"),
]


@pytest.mark.parametrize("case_id, response, ground_truth, score, pred", CASES, ids=[c[0] for c in CASES])
def test_table(case_id, response, ground_truth, score, pred):
    result = compute_score(response, ground_truth)
    assert result == {"score": score, "acc": score > 0, "pred": pred}
    assert type(result["acc"]) is bool


def test_table_is_large_and_covers_both_outcomes():
    assert len(CASES) >= 40
    assert {c[3] for c in CASES} == {1.0, -1.0}
    assert len({c[0] for c in CASES}) == len(CASES)


# The reference without our fallback: a response with only a box is invalid.
@pytest.mark.parametrize(
    "response, ground_truth, score, pred",
    [
        ("So the result is $\\boxed{5}$.", "5", -1.0, INVALID),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
        ("", "5", -1.0, INVALID),
    ],
)
def test_without_boxed_fallback_is_the_reference_minerva_mode(response, ground_truth, score, pred):
    assert compute_score(response, ground_truth, boxed_fallback=False) == {"score": score, "acc": score > 0, "pred": pred}


def test_invalid_placeholder_quirk_is_kept():
    # The reference normalises the '[INVALID]' placeholder and compares it like any prediction.
    assert compute_score("no answer here", "[INVALID]", boxed_fallback=False)["acc"] is True


@pytest.mark.parametrize(
    "response, ground_truth, score, pred",
    [
        ("Answer: 5", "5", -1.0, INVALID),  # strict mode ignores Answer lines
        ("... so \\boxed{5}", "5", 1.0, "5"),
        ("... so \\boxed{ 5}", "5", -1.0, " 5"),  # verbatim, no normalisation
        ("\\boxed{5}" + "." * 100, "5", -1.0, INVALID),  # only the last 100 characters
        ("\\boxed{5}" + "." * 91, "5", 1.0, "5"),  # exactly 100 characters: still inside
        ("\\boxed{4} \\boxed{5}", "5", 1.0, "5"),
    ],
)
def test_strict_box_verify_mode(response, ground_truth, score, pred):
    assert compute_score(response, ground_truth, strict_box_verify=True) == {"score": score, "acc": score > 0, "pred": pred}


def test_strict_box_with_pause_tokens_index():
    # Window = tail[pause[-1] - 100:]. With the box at characters 0..8 of a 200-character
    # response, pause index 150 starts the window at 50 (box excluded), 100 starts it at 0.
    response = "\\boxed{5}" + "." * 191
    assert len(response) == 200
    assert compute_score(response, "5", True, [0, 0, 0, 100])["acc"] is True
    assert compute_score(response, "5", True, [0, 0, 0, 150])["acc"] is False
    with pytest.raises(ValueError, match="4 indices"):
        compute_score(response, "5", True, [1, 2])


def test_rejects_non_string_inputs():
    with pytest.raises(TypeError):
        compute_score("Answer: 5", 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        compute_score(None, "5")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("x = \\frac{3}{4}", "\\frac{3}{4}"),
        ("10 square units", "10"),  # 'square' and 'units' removed after the spaces go
        ("\\text{Sue}", "Sue"),  # capital S: 'sue' is case-sensitive
        ("\\text{sue}", ""),  # 'sue' removed, then '\text{}' removed
        ("3\\;4", "34"),
        ('"hello"', "hello"),
        ("1, 2, 3\\ldots", "123"),  # spaces and '\ldots' go, then only digits and commas remain
        ("an 8", "8"),
        ("\\sqrt3x", "\\sqrt{3}x"),
        ("\\frac123", "\\frac{1}{2}3"),
        ("  7  ", "7"),
    ],
)
def test_normalize_final_answer(raw, normalised):
    assert normalize_final_answer(raw) == normalised


@pytest.mark.parametrize(
    "text, content",
    [
        ("\\boxed{5}", "5"),
        ("a \\boxed{1} b \\boxed{2} c", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{}", ""),
        ("\\boxed{5", None),
        ("\\boxed 5", None),  # only the braced form counts
        ("\\fbox{5}", None),
        ("no box", None),
    ],
)
def test_last_boxed_content(text, content):
    assert last_boxed_content(text) == content
