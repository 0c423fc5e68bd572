"""Final answers of math problems: extraction from a response and equivalence with the reference.

`extract_answer(text)` finds the final answer in this order: the last `\\boxed{...}` (or `\\fbox{...}`,
braces balanced, so `\\boxed{\\frac{1}{2}}` is whole), GSM8K's `#### 72`, a closing "the answer is X",
and failing those the last number in the text. `equivalent(reference, answer)` holds when the two are
the same after normalisation (spaces, `$`, `\\left`/`\\right`, `\\dfrac`, `\\text{}` units, a trailing
period), the same number (`1,000` = `1000`, `\\frac{3}{4}` = `3/4` = `0.75`, `50\\%` = `50`, relative
tolerance 1e-6), or, through the `math-verify` package (`pip install 'offpolicy[math]'`), the same
symbolic expression, set or interval (`(x+1)^2` = `x^2+2x+1`, `\\frac{\\sqrt 2}{2}` = `\\frac{1}{\\sqrt 2}`).
Without math-verify the symbolic step is skipped (logged once). math-verify bounds its sympy work
with SIGALRM, which only the main thread may use: elsewhere it runs without that bound.
`score(reference, response)` is the `math` reward: 1.0 or 0.0.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction

log = logging.getLogger("offpolicy.rewards")

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_GSM8K = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*([^\n]+)", re.I)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_warned = {"math_verify": False}


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (braces balanced), or of `\\boxed 5`; None if none."""
    starts = [m for m in _BOXED.finditer(text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
            continue  # unbalanced: try an earlier one
        word = re.match(r"[^\s$]+", text[i:])
        if word:
            return word.group(0)
    return None


def extract_answer(text: str) -> str | None:
    """The final answer written in `text` (see the module doc), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_GSM8K, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    """The reference itself, or its final answer when it is a worked solution (\\boxed or ####)."""
    if "\\boxed" in reference or "\\fbox" in reference or "####" in reference:
        return extract_answer(reference) or reference
    return reference.strip()


def normalize(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}"):
        s = s.replace(token, "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("\\%", "%").rstrip(".").strip()
    return re.sub(r"\s+", "", s)


def to_number(answer: str) -> Fraction | None:
    """`answer` as an exact number when it is one: integers, decimals, thousands commas, a/b, \\frac{a}{b},
    a sign, a leading currency sign, a trailing % (50% = 50, as GSM8K writes percentages); else None."""
    s = normalize(answer)
    s = re.sub(r"^\\?\$|^(?:usd|eur|€|£)", "", s, flags=re.I)
    s = s.rstrip("%")
    frac = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if frac:
        num, den = _decimal(frac.group(2)), _decimal(frac.group(3))
        if num is None or not den:
            return None
        return -num / den if frac.group(1) else num / den
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = _decimal(num_s), _decimal(den_s)
        return num / den if num is not None and den else None
    return _decimal(s)


def _decimal(s: str) -> Fraction | None:
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", s, re.I):
        return None
    return Fraction(s)


def _close(a: Fraction, b: Fraction, rel: float = 1e-6) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


def symbolic_equal(reference: str, answer: str) -> bool:
    """Equivalence through math-verify (sympy); False when it is not installed (logged once)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        if not _warned["math_verify"]:
            _warned["math_verify"] = True
            log.warning("math-verify is not installed: the math reward compares strings and numbers only "
                        "(pip install 'offpolicy[math]' for symbolic equivalence)")
        return False
    bound = 5 if threading.current_thread() is threading.main_thread() else None  # SIGALRM: main thread only
    gold = parse(f"${reference}$", parsing_timeout=bound)
    pred = parse(f"${answer}$", parsing_timeout=bound)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=bound))


def equivalent(reference: str, answer: str) -> bool:
    if normalize(reference) == normalize(answer):
        return True
    ref_n, ans_n = to_number(reference), to_number(answer)
    if ref_n is not None and ans_n is not None:
        return _close(ref_n, ans_n)
    return symbolic_equal(reference, answer)


def score(reference: str, response: str) -> float:
    """The `math` reward: 1.0 when the response's final answer equals the reference's, else 0.0."""
    answer = extract_answer(response)
    if answer is None or not answer.strip():
        return 0.0
    return float(equivalent(reference_answer(reference), answer))
