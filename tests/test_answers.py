r"""Final answers as GSM8K (``#### N``), MATH (``\boxed{N}``), CoT prompts ("The answer is N") and bare values
write them. Every expected canonical string is worked by hand from the module's rule (integer, else terminating
decimal, else reduced a/b; text lowercased without whitespace), not computed by the functions under test."""

import math

import pytest

from models.labeling.answers import (
    extract_answer,
    is_correct,
    normalise_answer,
    parse_reference,
    unreadable_references,
)

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)
MATH_SOLUTION = r"Half of the $2$ pies is $\frac{2}{4} = \boxed{\frac{1}{2}}$ of $4$ quarters."


@pytest.mark.parametrize(
    "text, expected",
    [
        # the previous extractor's cases (tests/test_labelers.py), all unchanged
        ("4 + 2 = 6. The answer is 6.", "6"),
        ("The answer is N.\n\nBen has 4 + 2 = 6 apples.", "6"),  # no number after "answer is": last number
        ("So the answer is: $1,200.", "1200"),
        ("**The answer is -3**", "-3"),
        ("The answer is 7. Wait, the answer is 8.", "8"),
        ("I think 3 and then 5", "5"),
        ("The answer is 2.5.", "2.5"),
        ("The answer is 6.0", "6"),
        ("no numbers at all", None),
        # GSM8K: #### wins over every number after it in priority, and over "answer is" / \boxed
        (GSM8K_SOLUTION, "72"),
        ("The answer is 70.\n#### 72", "72"),
        ("\\boxed{70}\n#### 72", "72"),
        ("#### 1,200", "1200"),
        ("#### $18.", "18"),
        ("#### B", "b"),  # a marked non-number stays as text
        ("#### Step 1: add\n48 + 24 = 72\n#### Step 2: done\nThe answer is 72.", "72"),  # Markdown headings
        ("#### Step 1: add\n48 + 24 = 72", "72"),
        ("#### 3\n#### 4", "4"),  # the last marker
        # MATH: balanced braces, nested ones included
        (MATH_SOLUTION, "0.5"),
        (r"\boxed{\dfrac{3}{4}}", "0.75"),
        (r"\boxed{1/3}", "1/3"),
        (r"\fbox{12}", "12"),
        (r"\boxed{\pi}", r"\pi"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{10{,}000}", "10000"),
        (r"\boxed{\$18.90}", "18.9"),
        (r"\boxed{30^\circ}", "30"),
        (r"\boxed{18 \text{ dollars}}", "18"),
        (r"\boxed{\text{Monday}}", "monday"),
        (r"\boxed{5} then \boxed{6}", "6"),
        (r"\boxed{5} then \boxed{6", "5"),  # a cut-off box is skipped
        (r"-\frac{1}{2}", "-0.5"),
        # "answer is" with fractions, currency, percent
        ("The answer is 1/2.", "0.5"),
        ("The answer is $18.", "18"),
        ("The answer is 50%.", "50"),
        (r"The answer is $\frac{2}{6}$.", "1/3"),
        # the last number: thousands commas only where grouped, a minus only where it is not a subtraction
        ("So 5-3 leaves 2", "2"),
        ("The difference is 5-3", "3"),
        ("Items 1,2345", "2345"),  # 1,234 is no thousands group when a digit follows
        ("x = -4", "-4"),
        ("1, 2", "2"),
        ("We get 48/2", "24"),
        ("0.50 of it", "0.5"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("150", "150"),
        ("  6.0 ", "6"),
        ("0.50", "0.5"),
        ("-2", "-2"),
        ("1,200", "1200"),
        ("$1,200.00", "1200"),
        (r"\$18", "18"),
        ("3/4", "0.75"),
        ("6/8", "0.75"),
        (r"\frac{3}{4}", "0.75"),
        (r"\tfrac34", "0.75"),
        ("0.75", "0.75"),
        ("2/3", "2/3"),
        ("-4/6", "-2/3"),
        (r"\(\frac{1}{3}\)", "1/3"),
        ("1/8", "0.125"),
        ("25%", "25"),
        (r"25\%", "25"),
        ("\u22127", "-7"),  # Unicode minus
        (r"1\,000", "1000"),
        ("1, 2", "1,2"),  # not a thousands group: text
        ("1,2345", "1,2345"),
        ("  New York ", "newyork"),
        (r"\dfrac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}"),
        ("", ""),
    ],
)
def test_normalise_answer(text, expected):
    assert normalise_answer(text) == expected


@pytest.mark.parametrize(
    "reference, expected",
    [
        ("150", "150"),
        (150, "150"),
        (6.0, "6"),
        ("$1,200", "1200"),
        ("3/4", "0.75"),
        (GSM8K_SOLUTION, "72"),
        (MATH_SOLUTION, "0.5"),
        ("#### Paris", "paris"),
        ("x = 5", "5"),  # a worked solution without a marker: its last number
        (None, None),
        (math.nan, None),
        ("", None),
        ("   ", None),
        ("Paris", None),
        ("see the solution above", None),
    ],
)
def test_parse_reference(reference, expected):
    assert parse_reference(reference) == expected


# (reference, a correct response, an incorrect response)
FORMATS = [
    (GSM8K_SOLUTION, "48 + 24 = 72 clips.\n#### 72", "48 + 24 = 70 clips.\n#### 70"),
    (GSM8K_SOLUTION, r"So she sold \boxed{72} clips.", r"So she sold \boxed{24} clips, not 72."),
    (GSM8K_SOLUTION, "The answer is 72.", "The answer is 24. Not 72"),
    (GSM8K_SOLUTION, "24 in May, so 72", "72 in all? No: 24"),
    ("#### 1,200", "She earns $1,200.", "She earns $1,201."),
    (MATH_SOLUTION, "0.5", "0.25"),
    (MATH_SOLUTION, r"\boxed{1/2}", r"\boxed{1/3}"),
    (MATH_SOLUTION, "The answer is 1/2", "The answer is 2"),
    ("The answer is $18.", "#### 18", "#### 81"),
    ("150", "The total is 150 apples.", "The total is 15 apples."),
    ("6.0", "6", "6.5"),
    ("$1,200", "1200", "120"),
    ("3/4", r"\boxed{0.75}", r"\boxed{0.7}"),
    ("25%", "The answer is 25%.", "The answer is 0.25."),  # a percent reads as its number, not as a fraction
    ("-3", "It drops to -3.", "It drops 3."),
    ("2/3", r"\boxed{\frac{4}{6}}", "0.67"),
    ("#### B", "#### B", "#### C"),
]


@pytest.mark.parametrize("reference, correct, incorrect", FORMATS)
def test_is_correct_per_format(reference, correct, incorrect):
    assert is_correct(correct, reference) is True
    assert is_correct(incorrect, reference) is False


def test_is_correct():
    # the previous cases (tests/test_labelers.py)
    assert is_correct("The answer is 12.", "12") is True
    assert is_correct("The answer is 12.", "13") is False
    assert is_correct("The answer is 12.", None) is None
    assert is_correct("", "3") is False
    # a response without any answer is wrong, not unknown
    assert is_correct("I do not know.", "3") is False
    assert is_correct("I do not know.", GSM8K_SOLUTION) is False


@pytest.mark.parametrize("response", [
    "Ben has 4 apples and gets 2 more, so 4 + 2 = 6",  # the last number of a cut response: an intermediate step
    "First, 3 * 2 = 6. Then we add 6",
])
def test_a_response_cut_by_the_length_limit_is_not_credited_for_its_last_number(response):
    """The fallback (the last number) reads an ended response, never one cut at max_new_tokens: there the last
    number is whatever was being written when the budget ran out."""
    assert extract_answer(response) == "6" and is_correct(response, "6") is True
    assert extract_answer(response, truncated=True) is None
    assert is_correct(response, "6", truncated=True) is False


@pytest.mark.parametrize("response", [
    "4 + 2 = 6. The answer is 6. Let me double-check: 4 + 2 is 6, and 6 - 2",
    "4 + 2 = 6\n#### 6\nSo Ben has 6 and 3",
    "So $4 + 2 = \\boxed{6}$, and then 9",
])
def test_a_cut_response_still_counts_its_marked_answer(response):
    """A marker was written before the cut: ``#### X``, ``\\boxed{X}`` and "The answer is X" still count."""
    assert is_correct(response, "6", truncated=True) is True


def test_a_copied_instruction_is_never_a_marked_answer():
    """A small model copies ``prompts.instruction``'s ending verbatim (3 % of SmolLM2-135M's responses with
    ``<number>``; a concrete example, "The answer is 42.", was copied by 54 % and read as the answer 42). The default
    holds no number a copy could be credited for: a copy alone is never right, and after worked steps only their last
    number counts, and only in a response that was not cut."""
    from foresight.params import PromptsConfig

    instruction = PromptsConfig().instruction
    assert not any(ch.isdigit() for ch in instruction)
    copy = instruction[instruction.index("The answer is"):].rstrip("'\"")
    assert extract_answer(copy) is None
    work = "Ben has 4 apples and gets 2 more: 4 + 2 = 6. "
    assert is_correct(work + copy, "6") is True
    assert is_correct(work + copy, "6", truncated=True) is False


@pytest.mark.parametrize("reference", [None, math.nan, "", "Paris", "see the solution above"])
def test_unreadable_reference_is_unknown(reference):
    assert parse_reference(reference) is None
    assert is_correct("The answer is 72.", reference) is None
    assert is_correct("Paris", reference) is None


def test_unreadable_references_are_the_given_ones_no_answer_can_be_read_from():
    references = ["Natalia sold 24 clips.\n#### 72", "\\boxed{\\frac{1}{2}}", "150", None, float("nan"), "Paris",
                  "see the worked solution"]
    assert unreadable_references(references) == ["Paris", "see the worked solution"]
