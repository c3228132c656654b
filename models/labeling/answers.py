r"""Final answers read as real datasets and models write them, for the ``verifiable`` labeler.

Formats, in the priority :func:`extract_answer` reads them (the last occurrence of each wins):

1. ``#### X`` (the rest of that line): GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
   Problems", ``openai/gsm8k``): the ``answer`` column is a worked solution whose last line is ``#### 72``.
2. ``\boxed{X}`` / ``\fbox{X}`` (balanced braces, so ``\boxed{\frac{1}{2}}`` reads whole): MATH (Hendrycks et al.
   2021, "Measuring Mathematical Problem Solving With the MATH Dataset"): the ``solution`` column ends in one.
3. "The answer is X" (case-insensitive; optional ``:``, ``**``, ``$``; X starts with a number): chain-of-thought
   few-shot prompts (Wei et al. 2022) end each exemplar with it, so prompted models answer that way.
4. Otherwise the last number in the text — but not in a response cut off by the length limit
   (``finish_reason`` ``length``): its last number is whatever the model was writing when the budget ran out, an
   intermediate step as likely as a conclusion, so crediting it would reward running out of tokens. A marker
   (1–3) counts in a cut response too: it was written before the cut.

A reference answer (:func:`parse_reference`) is either a bare value, as SVAMP / ASDiv / MATH-500's ``answer``
column write it ("150", "1,200", "$18", "3/4", "\frac{3}{4}"), or a worked solution read by the same rules.

Canonical form (:func:`normalise_answer`, shared by responses and references so equal values compare equal):
numbers are read exactly with :class:`fractions.Fraction` and written as an integer ("150", "-3") or, when the
value has a terminating decimal expansion, as that decimal ("2.5"; "6.0" -> "6", "3/4" -> "0.75"), otherwise as
a reduced fraction "a/b" ("6/9" -> "2/3"). One form per value, so "3/4", "\frac{3}{4}" and "0.75" agree. Dollar
signs, LaTeX spacing and math delimiters, units wrappers (``\text{ cm}``, ``^\circ``), thousands separators, a
trailing "." and a trailing "%" are dropped first. A marked answer that is not a number (``\boxed{\pi}``,
``#### B``) is kept as text: lowercased, whitespace removed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from fractions import Fraction

# a number as it appears in running text: -\frac{1}{2}, 1,200.5, 48/2, 2.5, .5 (a minus only where it cannot be
# a subtraction: "5-3" reads as 5 and 3)
_LATEX_FRAC = r"\\[dt]?frac\s*(?:\{\s*-?\d+(?:\.\d+)?\s*\}|\d)\s*(?:\{\s*-?\d+(?:\.\d+)?\s*\}|\d)"
_NUMBER = (r"(?:(?<![\w)])-)?(?:" + _LATEX_FRAC + r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)"
           r"|\d+(?:/\d+|\.\d+)?|\.\d+)")
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*\**\s*(?:\\?\$)?\s*(" + _NUMBER + ")", re.IGNORECASE)
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")

# LaTeX that never changes a value: $ / \$, spacing (\! \, \;), math delimiters \( \) \[ \], degrees
_NOISE_RE = re.compile(r"\\?\$|\\[!,;]|\\[()\[\]]|\^\s*\{?\s*\\circ\s*\}?")
_UNITS_RE = re.compile(r"\\(?:text|textrm|textnormal|mathrm|mbox)\s*\{([^{}]*)\}")
_TRAILING_RE = re.compile(r"(?:\s|\.|\\?%)+$")  # "50\%." -> "50"
_PLAIN_RE = re.compile(r"[+-]?(?:\d+(?:\.\d+)?|\.\d+)")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SLASH_RE = re.compile(r"([+-]?(?:\d+(?:\.\d+)?|\.\d+))\s*/\s*([+-]?(?:\d+(?:\.\d+)?|\.\d+))")
_FRAC_RE = re.compile(r"([+-]?)\\[dt]?frac\s*(?:\{\s*([+-]?\d+(?:\.\d+)?)\s*\}|(\d))"
                      r"\s*(?:\{\s*([+-]?\d+(?:\.\d+)?)\s*\}|(\d))")


def _tidy(text: str) -> str:
    return _TRAILING_RE.sub("", text.strip()).strip()


def _value(text: str) -> Fraction | None:
    """The exact value of a whole string that is one number ("1,200", "-2.5", "6/8", "\\frac{3}{4}"), else None."""
    if _PLAIN_RE.fullmatch(text):
        return Fraction(text)
    if _THOUSANDS_RE.fullmatch(text):
        return Fraction(text.replace(",", ""))
    if match := _SLASH_RE.fullmatch(text):
        numerator, denominator = (Fraction(part) for part in match.groups())
    elif match := _FRAC_RE.fullmatch(text):
        sign, braced_num, bare_num, braced_den, bare_den = match.groups()
        numerator = Fraction(braced_num or bare_num) * (-1 if sign == "-" else 1)
        denominator = Fraction(braced_den or bare_den)
    else:
        return None
    return numerator / denominator if denominator else None


def _format(value: Fraction) -> str:
    """Integer, else terminating decimal, else reduced "a/b": one string per value."""
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    if places == 0:
        return str(value.numerator)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    return f"{'-' if value < 0 else ''}{digits[:-places]}.{digits[-places:]}"


def normalise_answer(text: str) -> str:
    """The canonical form of one answer (module docstring): a number's exact canonical string, else lowercased text
    without whitespace; "" when nothing is left."""
    text = _tidy(_NOISE_RE.sub("", text.strip().replace("\u2212", "-").replace("{,}", ",")))
    without_units = _tidy(_UNITS_RE.sub("", text))
    value = _value(without_units)
    if value is None:  # not a number with units: the wrappers hold the answer itself (\text{Monday})
        text = _tidy(_UNITS_RE.sub(r"\1", text))
        value = _value(text)
    if value is not None:
        return _format(value)
    return re.sub(r"\s+", "", text).lower().replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _is_number(canonical: str) -> bool:
    return _value(canonical) is not None


def _hash_answer(text: str) -> str | None:
    """The last ``#### X``. A non-numeric one followed by more text is a Markdown heading ("#### Step 1"), which
    chat models write often, not an answer; GSM8K's marker ends the solution."""
    for match in reversed(list(_HASH_RE.finditer(text))):
        answer = normalise_answer(match.group(1))
        if answer and (_is_number(answer) or not text[match.end():].strip()):
            return answer
    return None


def _boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` whose braces close (a cut-off one is skipped)."""
    for match in reversed(list(_BOX_RE.finditer(text))):
        depth = 1
        for end in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                answer = normalise_answer(text[match.end():end])
                if answer:
                    return answer
                break
    return None


def extract_answer(text: str, truncated: bool = False) -> str | None:
    """The final answer of a response or worked solution, canonicalised: the last ``#### X``, else the last
    ``\\boxed{X}``, else the last "the answer is N", else — unless ``truncated`` (the response was cut by the length
    limit; module docstring) — the last number; None when there is none."""
    if answer := _hash_answer(text) or _boxed_answer(text):
        return answer
    found = _ANSWER_IS_RE.findall(text) or ([] if truncated else _NUMBER_RE.findall(text))
    return normalise_answer(found[-1]) if found else None


def is_missing(reference) -> bool:
    """No reference at all: None, or the NaN an empty table cell reads as."""
    return reference is None or (isinstance(reference, float) and math.isnan(reference))


def unreadable_references(references: Iterable) -> list:
    """The references given (not missing) that :func:`parse_reference` cannot read, in their order."""
    return [r for r in references if not is_missing(r) and parse_reference(r) is None]


def parse_reference(reference) -> str | None:
    """A dataset's reference answer, canonicalised: a bare number ("150", "$1,200", "3/4"), else a worked solution
    read as :func:`extract_answer` reads it. None when missing (None, NaN, empty) or unreadable: bare text without
    a marker ("Paris") is not compared, since only numbers and marked answers ("#### Paris") are."""
    if is_missing(reference):
        return None
    text = str(reference).strip()
    if not text:
        return None
    bare = normalise_answer(text)
    return bare if _is_number(bare) else extract_answer(text)


def is_correct(response: str, reference, truncated: bool = False) -> bool | None:
    """Whether the response's final answer (:func:`extract_answer`; ``truncated``: it was cut by the length limit,
    so only a marked answer counts) equals the reference's; None when the reference is missing or unreadable (the
    caller decides: the verifiable labeler raises), False when the response has no answer."""
    expected = parse_reference(reference)
    if expected is None:
        return None
    return extract_answer(response, truncated) == expected


def cut_by_length(tokens, end_token_ids, max_new_tokens: int) -> bool:
    """Whether a decoded output (new token ids, cut after its first end token) stopped at ``max_new_tokens``
    without an end token: the ``truncated`` of :func:`is_correct` for decoders that give token lists, the
    samples table's ``finish_reason == "length"``."""
    return len(tokens) >= max_new_tokens and (not tokens or tokens[-1] not in end_token_ids)
