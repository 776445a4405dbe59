"""Final answers in model text: extraction (GSM8K's `#### n`, LaTeX's `\\boxed{...}`, the last number) and
equivalence (numbers by value, LaTeX after normalisation, or `math-verify` when it is installed).

Pure string work, no model and no I/O: the reward functions in `rewards/math.py` are built from these.
"""
from __future__ import annotations

import re
from fractions import Fraction

# a number as people write it: -1,234.5  or  .5  or  3/4 ; commas only between groups of three digits
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+"
NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUMBER})")
HASHES_RE = re.compile(r"####\s*(.+)")


def last_number(text: str) -> str | None:
    """The last number in `text` (commas between thousands allowed), as written; None when there is none."""
    found = NUMBER_RE.findall(text.replace("−", "-"))  # a Unicode minus counts as one
    return found[-1] if found else None


def hashes_answer(text: str) -> str | None:
    """What follows the last `####` (GSM8K's answer line), up to the end of that line; None without one."""
    found = HASHES_RE.findall(text)
    return found[-1].strip() if found else None


def to_number(text: str) -> Fraction | None:
    """`text` as an exact number when it is one, after dropping what is not part of the value: currency
    signs, thousands commas, a trailing period, units or words after it ("18 dollars", "$1,200.", "75%" ->
    75). Fractions (`3/4`, `\\frac{3}{4}`) are exact. None when `text` holds no single number."""
    t = text.strip().replace("−", "-").replace("$", "").replace("\\$", "").replace("\\%", "%")
    t = _unwrap_latex_number(t)
    t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", t)  # thousands separators only: "1,234" but not "1,2"
    t = t.rstrip(".").strip()
    m = re.fullmatch(r"(-?(?:\d+(?:\.\d+)?|\.\d+))\s*(?:/\s*(\d+))?\s*(?:%|[A-Za-z][A-Za-z .]*)?", t)
    if not m:
        return None
    value = Fraction(m.group(1))
    if m.group(2):
        if int(m.group(2)) == 0:
            return None
        value /= int(m.group(2))
    return value


def _unwrap_latex_number(t: str) -> str:
    """`\\frac{a}{b}` / `\\dfrac` / `\\tfrac` -> a/b and `-\\frac` -> -a/b, `\\text{...}` dropped, `{,}` -> ','."""
    t = re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", t)
    t = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", t)  # \frac12
    t = re.sub(r"\\text\{[^}]*\}|\\mbox\{[^}]*\}", "", t)
    return t.replace("{,}", ",").replace("\\!", "").replace("\\,", "")


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None when there is none
    or it is never closed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def normalize_latex(s: str) -> str:
    """A canonical spelling of a short LaTeX answer, for the string compare when `math-verify` is absent:
    no spaces, `$`, `\\left`/`\\right`, `\\!`; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\text{x}` -> x; degrees and
    a trailing period dropped; `0.5` and `.5` alike."""
    s = s.strip().strip("$").rstrip(".")
    s = re.sub(r"\\text\{([^}]*)\}|\\mathrm\{([^}]*)\}", lambda m: m.group(1) or m.group(2) or "", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("%", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<![\d])\.(\d)", r"0.\1", s)
    return s


def equivalent(predicted: str, truth: str) -> bool:
    """Whether two final answers are the same: by `math-verify` when it is installed (symbolic: `\\frac{1}{2}`
    = `0.5` = `1/2`, intervals, sets); else as numbers when both are one, else as normalised LaTeX strings."""
    verified = _math_verify(predicted, truth)
    if verified is not None:
        return verified
    a, b = to_number(predicted), to_number(truth)
    if a is not None and b is not None:
        return a == b
    return normalize_latex(predicted) == normalize_latex(truth)


def _math_verify(predicted: str, truth: str) -> bool | None:
    """math-verify's verdict, or None when it is not installed or cannot parse either side."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:  # its own timeouts use signal.alarm, which only the main thread may: reward calls run in threads, and
        # the reward worker's deadline (reward.timeout_s) bounds them instead
        gold, pred = parse(f"${truth}$", parsing_timeout=None), parse(f"${predicted}$", parsing_timeout=None)
        if not gold or not pred:
            return None
        return bool(verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - its parser raises many types on odd input; fall back to our compare
        return None
