"""Prefect task of the ``validate`` stage: the GX suites on samples and scores, then the preference pairs, validated
before they are written (docs/pipeline.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from foresight.pairs import make_pairs
from foresight.storage import read_table, write_table
from foresight.validation import pairs_suite, samples_suite, scores_suite, validate_tables
from tasks.common import StageResult

if TYPE_CHECKING:
    from foresight.config import Config


@task(name="validate-and-pair", cache_policy=NO_CACHE)
def validate_task(cfg: Config) -> StageResult:
    """Run the GX suites on samples and scores, build preference pairs, validate them, then write them.

    A failed suite raises before the pairs file is replaced, so downstream stages never see bad data.
    """
    logger = get_run_logger()
    started = time.perf_counter()
    samples = read_table(cfg.path(cfg.paths.samples), "samples")
    scores = read_table(cfg.path(cfg.paths.scores), "scores")
    pairs, pair_stats = make_pairs(scores, cfg.validate_.min_score_gap, cfg.validate_.pairing,
                                   cfg.validate_.max_pairs_per_prompt)
    docs_dir = cfg.path(cfg.paths.reports_dir) / "datadocs"
    summary = validate_tables(
        {
            "samples": (samples, samples_suite(cfg.validate_, cfg.generate.max_new_tokens)),
            "scores": (scores, scores_suite(cfg.validate_, cfg.label)),
            "pairs": (pairs, pairs_suite(cfg.validate_)),
        },
        docs_dir,
    )
    out = write_table(pairs, cfg.path(cfg.paths.pairs))
    logger.info("validation passed; %d pairs (%s, %d before validate.max_pairs_per_prompt) from %d prompts (Data "
                "Docs: %s)", pair_stats["num_pairs"], cfg.validate_.pairing, pair_stats["num_pairs_uncapped"],
                pair_stats["num_prompts"], summary["docs_index"])
    metrics = dict(pair_stats)
    for name, suite in summary["suites"].items():
        metrics[f"{name}_expectations_passed"] = suite["successful"]
    metrics["wall_seconds"] = time.perf_counter() - started
    return StageResult(metrics=metrics, tables={"pairs": out}, artifacts={"datadocs": docs_dir})
