"""Great Expectations suites and ``validate_tables``: real GX runs on small hand-made DataFrames."""

from __future__ import annotations

import re
import subprocess
import sys

import pandas as pd
import pytest

from foresight.params import ValidateConfig
from foresight.pairs import PAIR_COLUMNS, SAMPLE_COLUMNS, SCORE_COLUMNS, make_pairs
from foresight.validation import ValidationFailed, pairs_suite, samples_suite, scores_suite, validate_tables
from models.labeling.config import LabelerSpec

MAX_NEW_TOKENS = 32
CFG = ValidateConfig()
VERIFIABLE = LabelerSpec()


def make_samples(num_prompts: int = 3, per_prompt: int = 3) -> pd.DataFrame:
    """A valid samples table: ``per_prompt`` distinct responses for each of ``num_prompts`` prompts."""
    rows = []
    for p in range(num_prompts):
        for i in range(per_prompt):
            rows.append({
                "sample_id": f"p{p}-s{i}", "prompt_id": f"p{p}", "sample_index": i,
                "question": f"What is {p} + 1?", "prompt": f"<user>What is {p} + 1?</user>", "answer": str(p + 1),
                "response": f"{p} + 1 = {p + i}. The answer is {p + i}.", "prompt_tokens": 12,
                "response_tokens": 10 + i, "finish_reason": "length" if i == per_prompt - 1 else "eos",
                "temperature": 0.8, "top_p": 1.0, "top_k": 0, "max_new_tokens": MAX_NEW_TOKENS, "seed": 0,
                "model": "tiny",
            })
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def make_scores(samples: pd.DataFrame | None = None) -> pd.DataFrame:
    """The samples with verifiable-style scores: sample 1 of each prompt is the correct one (so ``pairing: all``
    gives 2 pairs per prompt of 3 samples)."""
    scores = (make_samples() if samples is None else samples).copy()
    correct = scores["sample_index"] == 1
    scores["score"] = correct.astype(float)
    # Nullable boolean with a missing value: the dtype the labeler writes when an answer is unknown.
    scores["correct"] = pd.array(correct.tolist(), dtype="boolean")
    scores.loc[scores.index[-1], "correct"] = pd.NA
    scores["extracted_answer"] = scores["response"].str.extract(r"answer is (\d+)", expand=False)
    scores["labeler"] = "verifiable"
    return scores[SCORE_COLUMNS]


def make_pairs_table(scores: pd.DataFrame | None = None) -> pd.DataFrame:
    pairs, _ = make_pairs(make_scores() if scores is None else scores, CFG.min_score_gap)
    return pairs


def expect_failure(tables: dict, docs_dir) -> ValidationFailed:
    """Run ``validate_tables`` expecting ValidationFailed; check the Data Docs were written before raising."""
    with pytest.raises(ValidationFailed) as info:
        validate_tables(tables, docs_dir)
    err = info.value
    assert err.results["success"] is False
    assert err.docs_index == docs_dir / "index.html" and err.docs_index.is_file()
    assert str(err.docs_index) in str(err)
    return err


def failed(err: ValidationFailed, suite: str) -> list[tuple[str, str | None]]:
    return [(f["expectation"], f["column"]) for f in err.results["suites"][suite]["failed"]]


def test_good_tables_pass_and_write_data_docs(tmp_path):
    scores = make_scores()
    docs = tmp_path / "reports" / "data_docs"
    summary = validate_tables({
        "samples": (make_samples(), samples_suite(CFG, MAX_NEW_TOKENS)),
        "scores": (scores, scores_suite(CFG, VERIFIABLE)),
        "pairs": (make_pairs_table(scores), pairs_suite(CFG)),
    }, docs)

    assert summary["success"] is True
    assert summary["docs_index"] == str(docs / "index.html")
    assert set(summary["suites"]) == {"samples", "scores", "pairs"}
    for name, suite in summary["suites"].items():
        assert suite["success"] is True, name
        assert suite["evaluated"] > 0 and suite["successful"] == suite["evaluated"], name
        assert suite["failed"] == []
    index = (docs / "index.html").read_text()
    for name in ("samples", "scores", "pairs"):
        assert (docs / "expectations" / f"{name}.html").is_file()
        assert f"expectations/{name}.html" in index
    validations = list((docs / "validations").rglob("*.html"))
    assert len(validations) == 3
    for page in validations:  # the index table's (inline) rows link each validation result
        assert page.relative_to(docs).as_posix() in index
    # Offline (issue #34): every page loads its scripts, styles and logo from the site itself, and they are there.
    for page in docs.rglob("*.html"):
        html = page.read_text()
        # what a browser loads to draw the page: scripts, stylesheets, images (GX's favicon link is not among
        # them, and is one folder short on validation pages: GX's favicon.j2)
        refs = [re.search(r"\b(?:src|href)=\"([^\"]+)\"", tag).group(1)
                for tag in re.findall(r"<script\b[^>]*\bsrc=[^>]*>|<link\b[^>]*stylesheet[^>]*>|<img\b[^>]*>", html)]
        assert [r for r in refs if "://" in r] == [], page
        assert {"jquery.min.js", "bootstrap-table.min.js", "bootstrap.min.css", "all.min.css"} <= {
            r.rsplit("/", 1)[-1] for r in refs}, page
        assert [r for r in refs if not (page.parent / r).is_file()] == [], page
    # Staging folders are renamed or removed, never left next to the site.
    assert [p.name for p in docs.parent.iterdir()] == ["data_docs"]


def test_nullable_and_string_dtypes_pass(tmp_path):
    # convert_dtypes: pandas string dtype, Int64, Float64, boolean — none may trip GX up.
    samples = make_samples().convert_dtypes()
    scores = make_scores().convert_dtypes()
    summary = validate_tables({
        "samples": (samples, samples_suite(CFG, MAX_NEW_TOKENS)),
        "scores": (scores, scores_suite(CFG, VERIFIABLE)),
        "pairs": (make_pairs_table(scores).convert_dtypes(), pairs_suite(CFG)),
    }, tmp_path / "docs")
    assert summary["success"] is True


def test_empty_response_fails_samples_suite(tmp_path):
    samples = make_samples()
    samples.loc[4, "response"] = ""
    err = expect_failure({"samples": (samples, samples_suite(CFG, MAX_NEW_TOKENS))}, tmp_path / "docs")

    assert ("expect_column_value_lengths_to_be_between", "response") in failed(err, "samples")
    message = str(err)
    assert "suite 'samples'" in message
    assert "expect_column_value_lengths_to_be_between [response]" in message
    assert "1 of 9 rows unexpected, e.g. ['']" in message


@pytest.mark.parametrize("min_chars, response, ok", [
    (1, "   \n", False),   # whitespace only: long enough raw, empty after stripping
    (3, " ab  ", False),   # 2 characters after stripping
    (3, " a b ", True),    # "a b" is 3 characters after stripping
])
def test_min_response_chars_counts_stripped_text(tmp_path, min_chars, response, ok):
    cfg = ValidateConfig(min_response_chars=min_chars)
    samples = make_samples()
    samples.loc[0, "response"] = response
    tables = {"samples": (samples, samples_suite(cfg, MAX_NEW_TOKENS))}
    if ok:
        assert validate_tables(tables, tmp_path / "docs")["success"] is True
    else:
        err = expect_failure(tables, tmp_path / "docs")
        assert ("expect_column_values_to_match_regex", "response") in failed(err, "samples")
        assert f"at least {min_chars} non-blank" in str(err)


def test_token_bounds_and_finish_reason(tmp_path):
    samples = make_samples()
    samples.loc[0, "response_tokens"] = 0
    samples.loc[1, "response_tokens"] = MAX_NEW_TOKENS + 1
    samples.loc[2, "finish_reason"] = "stop"
    err = expect_failure({"samples": (samples, samples_suite(CFG, MAX_NEW_TOKENS))}, tmp_path / "docs")
    assert failed(err, "samples") == [
        ("expect_column_values_to_be_between", "response_tokens"),
        ("expect_column_values_to_be_in_set", "finish_reason"),
    ]
    assert "2 of 9 rows unexpected, e.g. [0, 33]" in str(err)
    assert "'stop'" in str(err)


@pytest.mark.parametrize("rejected_delta", [0.0, 0.5], ids=["equal", "rejected-higher"])
def test_chosen_not_above_rejected_fails_pairs_suite(tmp_path, rejected_delta):
    pairs = make_pairs_table()
    pairs.loc[1, "rejected_score"] = pairs.loc[1, "chosen_score"] + rejected_delta
    err = expect_failure({"pairs": (pairs, pairs_suite(CFG))}, tmp_path / "docs")

    pair_check = ("expect_column_pair_values_a_to_be_greater_than_b", "chosen_score, rejected_score")
    assert failed(err, "pairs") == [pair_check]
    message = str(err)
    assert "[chosen_score, rejected_score]" in message
    assert "1 of 6 rows unexpected" in message
    assert "chosen_score strictly greater than rejected_score" in message


def test_missing_score_fails_pairs_suite(tmp_path):
    # GX skips a row only when both sides are missing by default; the suite counts any gap as a failure.
    pairs = make_pairs_table()
    pairs["rejected_score"] = pairs["rejected_score"].astype(float)
    pairs.loc[0, "rejected_score"] = float("nan")
    err = expect_failure({"pairs": (pairs, pairs_suite(CFG))}, tmp_path / "docs")
    assert ("expect_column_pair_values_a_to_be_greater_than_b", "chosen_score, rejected_score") in failed(err, "pairs")


@pytest.mark.parametrize("frame", [
    pd.DataFrame(),                       # no rows, no columns
    make_samples().iloc[0:0],             # no rows, every column
], ids=["no-columns", "with-columns"])
def test_empty_table_fails_with_row_count(tmp_path, frame):
    err = expect_failure({"samples": (frame, samples_suite(CFG, MAX_NEW_TOKENS))}, tmp_path / "docs")
    assert failed(err, "samples")[0] == ("expect_table_row_count_to_be_between", None)
    message = str(err)
    assert "suite 'samples' (0 rows)" in message
    assert "expect_table_row_count_to_be_between: 0 rows (expected min_value=1)" in message
    assert "Traceback" not in message


def test_too_few_pairs_fails(tmp_path):
    pairs = make_pairs_table()
    err = expect_failure({"pairs": (pairs, pairs_suite(ValidateConfig(min_pairs=7)))}, tmp_path / "docs")
    assert failed(err, "pairs") == [("expect_table_row_count_to_be_between", None)]
    assert "6 rows (expected min_value=7)" in str(err)


def test_missing_column_is_named(tmp_path):
    samples = make_samples().drop(columns=["finish_reason"])
    err = expect_failure({"samples": (samples, samples_suite(CFG, MAX_NEW_TOKENS))}, tmp_path / "docs")
    assert failed(err, "samples") == [
        ("expect_table_columns_to_match_set", None),
        ("expect_column_values_to_be_in_set", "finish_reason"),
    ]
    message = str(err)
    assert "missing columns: finish_reason" in message
    assert 'The column "finish_reason" in BatchData does not exist' in message


def test_extra_columns_are_allowed(tmp_path):
    samples = make_samples().assign(extra="x")
    assert validate_tables({"samples": (samples, samples_suite(CFG, MAX_NEW_TOKENS))}, tmp_path / "docs")["success"]


def test_duplicate_sample_id_fails(tmp_path):
    scores = make_scores()
    scores.loc[1, "sample_id"] = scores.loc[0, "sample_id"]
    err = expect_failure({"scores": (scores, scores_suite(CFG, VERIFIABLE))}, tmp_path / "docs")
    assert failed(err, "scores") == [("expect_column_values_to_be_unique", "sample_id")]
    assert "'p0-s0'" in str(err)


def test_verifiable_scores_must_be_zero_or_one_and_present(tmp_path):
    scores = make_scores()
    scores.loc[0, "score"] = 0.5  # within [0, 1] but no verifiable score
    scores.loc[1, "score"] = float("nan")
    err = expect_failure({"scores": (scores, scores_suite(CFG, VERIFIABLE))}, tmp_path / "docs")
    assert failed(err, "scores") == [
        ("expect_column_values_to_not_be_null", "score"),
        ("expect_column_values_to_be_in_set", "score"),
    ]
    assert "e.g. [0.5]" in str(err)


def test_reward_model_scores_must_lie_in_the_configured_plausible_range(tmp_path):
    rm = LabelerSpec(labeler="armorm", model="rm", score_min=-1.0, score_max=1.0)
    scores = make_scores().assign(labeler="armorm", score=0.25)  # continuous scores pass
    validate_tables({"scores": (scores, scores_suite(CFG, rm))}, tmp_path / "ok")
    scores.loc[0, "score"] = 1.5
    err = expect_failure({"scores": (scores, scores_suite(CFG, rm))}, tmp_path / "docs")
    assert failed(err, "scores") == [("expect_column_values_to_be_between", "score")]
    assert "e.g. [1.5] (expected plausible armorm scores: -1.0 to 1.0 (label.score_min / label.score_max))" in str(err)
    # the same table under the verifiable labeler: 0.25 is no score it gives, and the labeler column disagrees
    err = expect_failure({"scores": (scores, scores_suite(CFG, VERIFIABLE))}, tmp_path / "docs2")
    assert failed(err, "scores") == [("expect_column_values_to_be_in_set", "score"),
                                     ("expect_column_values_to_be_in_set", "labeler")]


def test_only_failing_suites_are_reported(tmp_path):
    samples = make_samples()
    scores = make_scores()
    scores.loc[0, "score"] = 2.0
    err = expect_failure({
        "samples": (samples, samples_suite(CFG, MAX_NEW_TOKENS)),
        "scores": (scores, scores_suite(CFG, VERIFIABLE)),
    }, tmp_path / "docs")
    assert err.results["suites"]["samples"]["success"] is True
    assert err.results["suites"]["scores"]["success"] is False
    assert "suite 'samples'" not in str(err) and "suite 'scores'" in str(err)


def test_make_pairs_output_passes_pairs_suite(tmp_path):
    scores = make_scores(make_samples(num_prompts=4, per_prompt=3))
    # Prompt p3: every sample scores the same, so make_pairs drops it (no preference).
    scores.loc[scores["prompt_id"] == "p3", "score"] = 0.0
    for pairing, num_pairs in (("all", 6), ("best_worst", 3)):
        cfg = ValidateConfig(pairing=pairing)
        pairs, stats = make_pairs(scores, cfg.min_score_gap, cfg.pairing)
        assert stats["num_pairs"] == num_pairs and stats["dropped_no_spread"] == 1
        assert list(pairs.columns) == PAIR_COLUMNS and pairs["best_worst"].sum() == 3

        summary = validate_tables({"pairs": (pairs, pairs_suite(cfg))}, tmp_path / pairing)
        assert summary["success"] is True
        assert summary["suites"]["pairs"]["evaluated"] == len(pairs_suite(cfg).expectations)


def test_pairs_suite_checks_best_worst_and_duplicate_pairs(tmp_path):
    pairs = make_pairs_table()
    assert pairs["prompt_id"].value_counts().tolist() == [2, 2, 2]  # several pairs per prompt pass
    p0 = pairs.index[pairs["prompt_id"] == "p0"]
    broken = pairs.copy()
    broken.loc[p0, "best_worst"] = True  # two best-worst pairs for p0
    broken.loc[broken.index[-1], ["chosen_sample_id", "rejected_sample_id"]] = broken.loc[
        broken.index[-2], ["chosen_sample_id", "rejected_sample_id"]].to_numpy()  # the same pair twice
    err = expect_failure({"pairs": (broken, pairs_suite(CFG))}, tmp_path / "docs")
    assert failed(err, "pairs") == [("expect_compound_columns_to_be_unique", "chosen_sample_id, rejected_sample_id"),
                                    ("expect_column_values_to_be_unique", "prompt_id")]
    assert "at most one best–worst pair per prompt" in str(err) and "'p0'" in str(err)
    # a missing flag fails; under pairing: best_worst every row must be a best-worst pair
    missing = pairs.astype({"best_worst": "boolean"})
    missing.loc[p0[0], "best_worst"] = pd.NA
    err = expect_failure({"pairs": (missing, pairs_suite(CFG))}, tmp_path / "missing")
    assert failed(err, "pairs") == [("expect_column_values_to_not_be_null", "best_worst")]
    err = expect_failure({"pairs": (pairs, pairs_suite(ValidateConfig(pairing="best_worst")))}, tmp_path / "bw")
    assert failed(err, "pairs") == [("expect_column_values_to_be_in_set", "best_worst")]
    assert "3 of 6 rows unexpected" in str(err)


def test_rerun_replaces_previous_site(tmp_path):
    docs = tmp_path / "docs"
    validate_tables({"samples": (make_samples(), samples_suite(CFG, MAX_NEW_TOKENS))}, docs)
    validate_tables({"scores": (make_scores(), scores_suite(CFG, VERIFIABLE))}, docs)
    assert not (docs / "expectations" / "samples.html").exists()
    assert (docs / "expectations" / "scores.html").is_file()
    assert len(list((docs / "validations").rglob("*.html"))) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["docs"]


def test_import_does_not_load_great_expectations():
    code = "import sys, foresight.validation; print('great_expectations' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
