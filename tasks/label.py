"""Prefect task of the ``label`` stage: every sample scored by the configured labeler, and its correctness wherever a
reference answer is known (docs/pipeline.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pandas as pd
from prefect import get_run_logger
from tqdm.auto import tqdm

from foresight.pairs import SCORE_COLUMNS
from foresight.storage import read_table, write_table
from models.labeling.answers import extract_answer, is_correct, unreadable_references
from models.labeling.labelers import ArmoRMLabeler, build_labeler
from tasks.common import StageResult, gpu_task, progress_artifact, reference_answers

if TYPE_CHECKING:
    from foresight.config import Config


@gpu_task("label-samples")
def label_task(cfg: Config) -> StageResult:
    """Score every sample with the configured labeler (batched, with a progress bar and artifact); record
    correctness wherever a reference answer is known, and count the references no answer can be read from."""
    logger = get_run_logger()
    started = time.perf_counter()
    samples = read_table(cfg.path(cfg.paths.samples), "samples")
    if samples.empty:
        raise ValueError(f"{cfg.path(cfg.paths.samples)} has no rows: nothing to label")
    answers = reference_answers(samples)
    references = samples.drop_duplicates("prompt_id")["answer"].dropna()
    unreadable = len(unreadable_references(references))
    if unreadable:
        logger.warning("%d of %d reference answers cannot be read (no number, '#### X', '\\boxed{X}' or 'The "
                       "answer is N'): their samples get no correctness", unreadable, len(references))
    labeler = build_labeler(cfg.label)
    logger.info("labeling %d samples with '%s' (batches of %d)", len(samples), labeler.name, cfg.label.batch_size)

    progress = progress_artifact(key="label-progress", description="Samples scored")
    bar = tqdm(total=len(samples), desc="label", unit="sample")

    def on_batch(done: int, total: int) -> None:
        bar.update(done - bar.n)
        progress(100.0 * done / total)

    questions, responses = samples["question"].tolist(), samples["response"].tolist()
    cut = (samples["finish_reason"] == "length").tolist()  # credited only for a marked answer (answers.py)
    labeled = samples.copy()
    scoring_started = time.perf_counter()
    if isinstance(labeler, ArmoRMLabeler):  # keep the objective rewards behind ArmoRM's score for reports
        labeled["score"], objectives = labeler.score_objectives(questions, responses, on_batch)
    else:
        labeled["score"], objectives = labeler.score(questions, responses, answers, on_batch, truncated=cut), None
    scoring_seconds = time.perf_counter() - scoring_started
    bar.close()
    labeled["correct"] = pd.array([is_correct(r, a, c) for r, a, c in zip(responses, answers, cut)], dtype="boolean")
    labeled["extracted_answer"] = [extract_answer(r, c) for r, c in zip(responses, cut)]
    labeled["labeler"] = labeler.name
    table = labeled[SCORE_COLUMNS].copy()
    if objectives is not None:
        table["objective_rewards"] = objectives
    out = write_table(table, cfg.path(cfg.paths.scores))
    if labeler.truncated_responses:
        logger.warning("%d of %d responses were cut to fit label.max_length = %d tokens (the prompt and the end of "
                       "turn kept): their scores judge a response's beginning", labeler.truncated_responses,
                       len(labeled), cfg.label.max_length)
    metrics = {"num_scored": len(labeled), "mean_reward": float(labeled["score"].mean()),
               "unparseable_references": unreadable, "truncated_responses": labeler.truncated_responses,
               "seconds_per_1k_samples": 1000 * scoring_seconds / len(labeled),
               "wall_seconds": time.perf_counter() - started}
    known = labeled["correct"].dropna()
    if len(known):
        metrics["sample_accuracy"] = float(known.astype(float).mean())
    return StageResult(metrics=metrics, tables={"scores": out})
