"""Data-quality gates for the pipeline's tables, run with Great Expectations (GX Core 1.x).

Three expectation suites describe what a good table looks like:

* ``samples`` (:func:`samples_suite`): generated responses, one row per (prompt, sample);
* ``scores`` (:func:`scores_suite`): the samples with their reward score;
* ``pairs`` (:func:`pairs_suite`): (chosen, rejected) preference pairs, one or several per prompt.

:func:`validate_tables` runs each suite on its DataFrame in one in-memory (ephemeral) GX context:
a pandas data source with one DataFrame asset per table, a whole-DataFrame batch definition, a
validation definition and a checkpoint whose ``UpdateDataDocsAction`` renders HTML Data Docs into a
filesystem site. It returns a plain-dict summary, and when any suite fails it raises
:class:`ValidationFailed` *after* the Data Docs are written, so the report can be opened to see
which rows broke which expectation. The pages load their scripts and styles from copies inside the site
(:func:`foresight.offline.localize_data_docs`), not from GX's CDNs, so they render on an offline machine.

Great Expectations takes several seconds to import, so it is imported inside the functions that
need it: importing this module stays cheap (about 0.1 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from foresight.offline import localize_data_docs
from foresight.params import ValidateConfig
from foresight.pairs import PAIR_COLUMNS, SAMPLE_COLUMNS, SCORE_COLUMNS
from foresight.storage import atomic_path
from models.labeling.config import LabelerSpec

if TYPE_CHECKING:
    import great_expectations as gx
    import pandas as pd

FINISH_REASONS = ["eos", "length"]
"""Allowed ``finish_reason`` values: the model ended the answer, or it hit ``max_new_tokens``."""

_EXAMPLES = 3
"""Unexpected values quoted per failed expectation in the error message (Data Docs show more)."""

_DOCS_SITE = "foresight"


class ValidationFailed(RuntimeError):
    """At least one suite failed.

    ``str(err)`` lists every failed expectation: suite, expectation type, column(s), and the observed
    value or the unexpected count with a few unexpected examples. ``results`` is the summary that
    :func:`validate_tables` would have returned; ``docs_index`` is the Data Docs ``index.html``.
    """

    def __init__(self, message: str, results: dict, docs_index: Path | None = None):
        super().__init__(message)
        self.results = results
        self.docs_index = docs_index


# --------------------------------------------------------------------------------------------------
# Suites


def _suite(name: str, expectations: list) -> gx.ExpectationSuite:
    import great_expectations as gx

    return gx.ExpectationSuite(name=name, expectations=expectations)


def _text_checks(column: str, min_chars: int, max_chars: int) -> list:
    """Length bounds on a text column, where ``min_chars`` counts characters after stripping.

    GX's length expectation counts raw characters, so a whitespace-only response would satisfy it;
    ``ValidateConfig.min_response_chars`` is defined on the stripped text, which a regex over the
    span from the first to the last non-blank character enforces (GX searches, not full-matches).
    """
    import great_expectations.expectations as gxe

    checks = [gxe.ExpectColumnValueLengthsToBeBetween(column=column, min_value=min_chars, max_value=max_chars)]
    if min_chars >= 1:
        regex = r"\S" if min_chars == 1 else rf"\S[\s\S]{{{min_chars - 2},}}\S"
        checks.append(gxe.ExpectColumnValuesToMatchRegex(
            column=column, regex=regex, description=f"at least {min_chars} non-blank character(s) after stripping",
        ))
    return checks


def _table_checks(columns: list[str], min_rows: int) -> list:
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectTableRowCountToBeBetween(min_value=min_rows),
        # exact_match=False: extra columns (added by later stages or by hand) are allowed.
        gxe.ExpectTableColumnsToMatchSet(column_set=list(columns), exact_match=False),
    ]


def samples_suite(cfg: ValidateConfig, max_new_tokens: int) -> gx.ExpectationSuite:
    """Suite ``samples``: generated responses are present, unique, within length and token bounds."""
    import great_expectations.expectations as gxe

    return _suite("samples", [
        *_table_checks(SAMPLE_COLUMNS, min_rows=1),
        *(gxe.ExpectColumnValuesToNotBeNull(column=c) for c in ("sample_id", "prompt_id", "prompt", "response")),
        gxe.ExpectColumnValuesToBeUnique(column="sample_id"),
        *_text_checks("response", cfg.min_response_chars, cfg.max_response_chars),
        gxe.ExpectColumnValuesToBeBetween(column="response_tokens", min_value=1, max_value=max_new_tokens),
        gxe.ExpectColumnValuesToBeInSet(column="finish_reason", value_set=FINISH_REASONS),
    ])


def scores_suite(cfg: ValidateConfig, labeler: LabelerSpec) -> gx.ExpectationSuite:
    """Suite ``scores``: every sample has a score the labeler can give: 0 or 1 from the verifiable labeler, within
    the plausible ``[label.score_min, label.score_max]`` from a reward model (:attr:`LabelerSpec.score_range`)."""
    import great_expectations.expectations as gxe

    low, high = labeler.score_range
    values = labeler.score_values
    range_check = (gxe.ExpectColumnValuesToBeInSet(column="score", value_set=list(values),
                                                   description=f"scores of the {labeler.labeler} labeler")
                   if values else gxe.ExpectColumnValuesToBeBetween(
                       column="score", min_value=low, max_value=high,
                       description=f"plausible {labeler.labeler} scores: {low} to {high} (label.score_min / label.score_max)"))
    return _suite("scores", [
        *_table_checks(SCORE_COLUMNS, min_rows=1),
        gxe.ExpectColumnValuesToNotBeNull(column="score"),
        range_check,
        gxe.ExpectColumnValuesToBeInSet(column="labeler", value_set=[labeler.labeler],
                                        description="scored by the configured labeler"),
        gxe.ExpectColumnValuesToBeUnique(column="sample_id"),
        *_text_checks("response", cfg.min_response_chars, cfg.max_response_chars),
    ])


def pairs_suite(cfg: ValidateConfig) -> gx.ExpectationSuite:
    """Suite ``pairs``: enough pairs, each (chosen, rejected) pair once, at most one best–worst pair per prompt
    (and nothing else under ``pairing: best_worst``), non-empty texts, chosen scored strictly higher.

    A prompt may give several pairs (``validate.pairing: all``), so ``prompt_id`` repeats; its best–worst pair,
    the one DPO keeps with ``dpo.pairs: best_worst``, must not.
    """
    import great_expectations.expectations as gxe

    min_chars = max(1, cfg.min_response_chars)
    return _suite("pairs", [
        *_table_checks(PAIR_COLUMNS, min_rows=cfg.min_pairs),
        gxe.ExpectCompoundColumnsToBeUnique(column_list=["chosen_sample_id", "rejected_sample_id"]),
        # ``pairing: best_worst`` builds nothing but best–worst pairs, one per prompt.
        gxe.ExpectColumnValuesToBeInSet(column="best_worst",
                                        value_set=[True] if cfg.pairing == "best_worst" else [True, False]),
        gxe.ExpectColumnValuesToNotBeNull(column="best_worst"),
        gxe.ExpectColumnValuesToBeUnique(column="prompt_id", row_condition="best_worst == True",
                                         condition_parser="pandas",
                                         description="at most one best–worst pair per prompt"),
        *(gxe.ExpectColumnValuesToNotBeNull(column=c) for c in ("chosen", "rejected")),
        *_text_checks("chosen", min_chars, cfg.max_response_chars),
        *_text_checks("rejected", min_chars, cfg.max_response_chars),
        # A missing score on either side counts as a failure, not as a skipped row.
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="chosen_score", column_B="rejected_score", or_equal=False, ignore_row_if="neither",
            description="chosen_score strictly greater than rejected_score",
        ),
        # make_pairs keeps only pairs whose scores differ by more than min_score_gap.
        gxe.ExpectColumnValuesToBeBetween(column="score_gap", min_value=cfg.min_score_gap, strict_min=True),
    ])


# --------------------------------------------------------------------------------------------------
# Running


def validate_tables(tables: dict[str, tuple[pd.DataFrame, gx.ExpectationSuite]], docs_dir: Path) -> dict:
    """Validate each DataFrame against its suite, write Data Docs into ``docs_dir``, return a summary.

    ``tables`` maps a table name to ``(dataframe, suite)``; the suite is registered under the table
    name, which names it in the summary, the error message and the Data Docs. The summary is::

        {"success": bool, "docs_index": str,
         "suites": {name: {"success": bool, "evaluated": int, "successful": int,
                           "failed": [{"expectation": str, "column": str | None, "details": str}]}}}

    The site is built in a temporary sibling and renamed over ``docs_dir`` (:func:`atomic_path`), so
    ``docs_dir`` holds exactly this run (a filesystem site otherwise keeps listing the runs of earlier
    calls) and a failed build leaves the previous report in place. Its pages use the vendored scripts and
    styles copied into it (:func:`foresight.offline.localize_data_docs`).

    Raises :class:`ValidationFailed` (after the Data Docs are written) when any suite fails.
    """
    docs_dir = Path(docs_dir)
    with atomic_path(docs_dir) as staging:
        suites = _run(tables, staging)
        localize_data_docs(staging)

    docs_index = docs_dir / "index.html"
    summary = {
        "success": all(s["success"] for s in suites.values()),
        "docs_index": str(docs_index),
        "suites": suites,
    }
    if not summary["success"]:
        raise ValidationFailed(_failure_message(summary, tables), results=summary, docs_index=docs_index)
    return summary


def _run(tables: dict[str, tuple[pd.DataFrame, gx.ExpectationSuite]], site_dir: Path) -> dict[str, dict]:
    """Run one checkpoint per table in a shared ephemeral context whose Data Docs site is ``site_dir``."""
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    # tqdm bars ("Calculating Metrics") would flood the stage's logs; results are logged instead.
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    context.add_data_docs_site(_DOCS_SITE, {
        "class_name": "SiteBuilder",
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(site_dir)},
    })
    source = context.data_sources.add_pandas("foresight")
    docs_action = UpdateDataDocsAction(name="update_data_docs", site_names=[_DOCS_SITE])

    suites = {}
    for name, (frame, suite) in tables.items():
        batch = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe(name)
        registered = context.suites.add(gx.ExpectationSuite(name=name, expectations=list(suite.expectations)))
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=name, data=batch, suite=registered)
        )
        # The DataFrame is a batch parameter of the whole checkpoint run, so each table needs its own
        # checkpoint; they share the context, hence one site listing every table.
        checkpoint = context.checkpoints.add(gx.Checkpoint(
            name=name, validation_definitions=[definition], actions=[docs_action], result_format="SUMMARY",
        ))
        run = checkpoint.run(batch_parameters={"dataframe": frame})
        (result,) = run.run_results.values()
        suites[name] = _suite_summary(result, registered)
    return suites


# --------------------------------------------------------------------------------------------------
# Summaries and messages


def _suite_summary(result: Any, suite: gx.ExpectationSuite) -> dict:
    """Plain-dict summary of one ``ExpectationSuiteValidationResult``; failures in suite order."""
    # GX returns results grouped by its metric resolution, not in suite order; the suite order reads
    # better (table checks first, then column by column).
    order = {e.id: i for i, e in enumerate(suite.expectations)}
    failed = sorted(
        (r for r in result.results if not r.success), key=lambda r: order.get(r.expectation_config.id, len(order))
    )
    stats = result.statistics
    return {
        "success": bool(result.success),
        "evaluated": int(stats["evaluated_expectations"]),
        "successful": int(stats["successful_expectations"]),
        "failed": [
            {"expectation": r.expectation_config.type, "column": _columns(r.expectation_config.kwargs),
             "details": _details(r)}
            for r in failed
        ],
    }


def _columns(kwargs: dict) -> str | None:
    if "column" in kwargs:
        return kwargs["column"]
    if "column_A" in kwargs:
        return f"{kwargs['column_A']}, {kwargs['column_B']}"
    if "column_list" in kwargs:
        return ", ".join(kwargs["column_list"])
    return None


def _details(r: Any) -> str:
    """Observed value or unexpected values of one failed expectation, plus what was expected."""
    kwargs = r.expectation_config.kwargs
    # A description, where the suite gives one, says what a bare kwarg (a regex) does not.
    expected = r.expectation_config.description or ", ".join(
        f"{k}={v!r}" for k, v in kwargs.items()
        if k not in ("batch_id", "column", "column_A", "column_B", "column_list", "column_set")
    )
    result = r.result or {}
    errors = _exception_messages(r.exception_info)
    if errors:
        # GX reports a column-level expectation on an absent column as a metric exception.
        found = "; ".join(errors)
    elif "unexpected_count" in result:
        examples = ", ".join(_short(v) for v in result.get("partial_unexpected_list", [])[:_EXAMPLES])
        found = f"{result['unexpected_count']} of {result.get('element_count')} rows unexpected, e.g. [{examples}]"
    elif r.expectation_config.type.startswith("expect_table_row_count"):
        found = f"{result.get('observed_value')} rows"
    elif r.expectation_config.type == "expect_table_columns_to_match_set":
        missing = result.get("details", {}).get("mismatched", {}).get("missing", [])
        found = f"missing columns: {', '.join(missing)}"
        expected = ""
    else:
        found = f"observed {_short(result.get('observed_value'))}"
    return f"{found} (expected {expected})" if expected else found


def _exception_messages(info: Any) -> list[str]:
    """Messages of exceptions GX caught while computing metrics (flat or keyed by metric)."""
    if not info:
        return []
    entries = [info] if "raised_exception" in info else list(info.values())
    messages = []
    for entry in entries:
        message = (entry.get("exception_message") or "").removeprefix("Error: ").strip()
        if entry.get("raised_exception") and message and message not in messages:
            messages.append(message)
    return messages


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, tuple):  # column-pair expectations report (A, B) tuples of numpy scalars
        return "(" + ", ".join(_short(v, limit) for v in value) + ")"
    if hasattr(value, "item"):  # numpy scalar -> Python, so repr shows 3 rather than np.int64(3)
        value = value.item()
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failure_message(summary: dict, tables: dict) -> str:
    lines = ["Great Expectations validation failed:"]
    for name, suite in summary["suites"].items():
        if suite["success"]:
            continue
        rows = len(tables[name][0])
        lines.append(
            f"  suite '{name}' ({rows} rows): {len(suite['failed'])} of {suite['evaluated']} expectations failed"
        )
        for f in suite["failed"]:
            column = f" [{f['column']}]" if f["column"] else ""
            lines.append(f"    - {f['expectation']}{column}: {f['details']}")
    lines.append(f"Data Docs: {summary['docs_index']}")
    return "\n".join(lines)
