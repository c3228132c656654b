"""What every stage's Prefect task uses: the task decorator, logging and artifacts, the result a stage reports, the
policy it works on, its accelerator, and the prompt splits with the prompt length limit.

The task modules: the data stages (prepare policy → prompts → generate → label → validate + pairs: :mod:`tasks.policy`,
:mod:`tasks.prompts`, :mod:`tasks.generate`, :mod:`tasks.label`, :mod:`tasks.validate`), then one module per method
(:mod:`tasks.sla`, :mod:`tasks.distill`, :mod:`tasks.medusa`, :mod:`tasks.coral`, :mod:`tasks.mtp`). A stage's DVC code
deps are the project modules its task module imports (:func:`foresight.stages.stage_modules`), so what only one
stage family uses lives in its own module.

Thin wrappers: the work lives in ``models/`` and ``foresight/`` (docs/pipeline.md); model code gets its own
small configs, which the params sections subclass (``models/<method>/config.py``). Each task writes its outputs
atomically (nothing half-written survives a failure) and returns a :class:`StageResult` of metrics
and paths, never models or tensors. DVC decides what is stale, so Prefect's own result caching is off.

Tasks that run a neural network are :func:`gpu_task` s: tagged ``gpu``, so a Prefect concurrency limit
(``prefect concurrency-limit create gpu 1``) guards the GPUs, and retried once after a transient CUDA error.
Only stage tasks carry the tag, never a task that waits for them (that would deadlock the limit).

A training stage may run in several processes at once (``launch.num_processes``, docs/gpu.md): its task then
runs in each process of an ``accelerate launch``, outside any Prefect run, so tasks log through
:func:`stage_logger` and publish artifacts through :func:`table_artifact` / :func:`markdown_artifact` /
:func:`progress_artifact`, which outside a run keep them for the flow's process to publish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError

from foresight.prompt_limits import drop_long_prompts, policy_context_length, resolve_max_prompt_tokens
from foresight.stages import GPU_TAG, retry_when
from foresight.storage import read_table
from foresight.tracking import LiveCurves
from models.common.curves import curve_sink
from models.engine.policy import load_policy, load_pretrained, policy_path

if TYPE_CHECKING:
    from foresight.config import Config

TRANSIENT_CUDA_ERRORS = ("CUDA error: unspecified launch failure", "CUDA error: an illegal memory access",
                         "CUDA error: uncorrectable ECC error", "NCCL", "CUDA-capable device(s) is/are busy",
                         "CUBLAS_STATUS_EXECUTION_FAILED", "CUDA error: misaligned address")
"""Messages of CUDA failures that a fresh attempt may not meet (a flaky device, a busy GPU, a collective that
timed out). Out of memory is not among them: it fails again, and says which knob to turn."""


def is_transient_cuda_error(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA or NCCL failure worth one more attempt (never out-of-memory)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    return isinstance(error, RuntimeError) and any(message in str(error) for message in TRANSIENT_CUDA_ERRORS)


def gpu_task(name: str, log_prints: bool | None = None):
    """A stage task that runs a neural network: tagged ``gpu``, uncached, retried once after a transient CUDA
    error (:func:`is_transient_cuda_error`). ``log_prints``: the flow's setting unless given."""
    return task(name=name, tags=[GPU_TAG], cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10,
                retry_condition_fn=retry_when(is_transient_cuda_error), log_prints=log_prints)


def in_prefect_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run (not so in a worker of ``accelerate launch``)."""
    try:
        get_run_context()
    except MissingContextError:
        return False
    return True


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; outside one (an ``accelerate launch`` worker) a plain logger."""
    return get_run_logger() if in_prefect_run() else logging.getLogger("foresight.stage")


PENDING_ARTIFACTS: list[dict] = []
"""Artifacts a task made outside a Prefect run, for the flow's process to publish (``flows.stages``)."""


def table_artifact(key: str, table: list[dict], description: str) -> None:
    """A Prefect table artifact (kept for the flow's process when outside a run)."""
    if in_prefect_run():
        create_table_artifact(key=key, table=table, description=description)
    else:
        PENDING_ARTIFACTS.append({"kind": "table", "key": key, "table": table, "description": description})


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    """A Prefect markdown artifact (kept for the flow's process when outside a run)."""
    if in_prefect_run():
        create_markdown_artifact(key=key, markdown=markdown, description=description)
    else:
        PENDING_ARTIFACTS.append({"kind": "markdown", "key": key, "markdown": markdown, "description": description})


def progress_artifact(key: str, description: str):
    """A Prefect progress artifact at 0 %; returns the function that moves it (a no-op outside a run)."""
    if not in_prefect_run():
        return lambda percent: None
    progress_id = create_progress_artifact(progress=0.0, key=key, description=description)
    return lambda percent: update_progress_artifact(progress_id, progress=percent)


@contextmanager
def live_curves(cfg: Config, names: Callable[[str], str | None]) -> Iterator[LiveCurves]:
    """Inside the block, the steps of the training loops (:func:`models.common.curves.log_step`) reach the stage's
    MLflow run as they happen, each key renamed by ``names`` to its curve's name in the :class:`StageResult`
    (None: not a curve; e.g. ``{"loss": "head.loss"}.get``), so that the end-of-stage logging finds them logged;
    yields the :class:`foresight.tracking.LiveCurves`, whose ``curves`` hold the points (for a loop whose history the
    task does not get otherwise: DPO's trainer). Leaving the block waits until MLflow holds every point."""
    sink = LiveCurves(cfg, names)
    with curve_sink(sink):
        try:
            yield sink
        finally:
            sink.wait()


@dataclass
class StageResult:
    """What a stage reports: scalar metrics, tables to preview in MLflow, folders to attach, training curves (one
    value per step) to log as MLflow metric histories (those not logged live, :func:`live_curves`), and the trained
    artifacts users reuse (``models``: name → folder; registered in MLflow's model registry when
    ``tracking.register_models`` names them, else attached)."""

    metrics: dict
    curves: dict[str, list[float]] = field(default_factory=dict)
    tables: dict[str, Path] = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)
    models: dict[str, Path] = field(default_factory=dict)


POLICY_SOURCES = ("base", "dpo")

COLLECTIVE_TIMEOUT = timedelta(hours=6)
"""How long a process of a launched stage waits at a barrier or collective before giving up."""


def load_stage_policy(cfg: Config, policy_source: str, training: bool = False):
    """The policy a stage works on: ``base`` (the prepared policy) or ``dpo`` (the DPO-tuned folder); ``training``
    for a stage that trains through it (``policy.dtype: auto`` is then float32 on a CPU)."""
    if policy_source not in POLICY_SOURCES:
        raise ValueError(f"policy_source must be one of {POLICY_SOURCES}, got {policy_source!r}")
    if policy_source == "base":
        return load_policy(cfg.policy, cfg.path(cfg.paths.policy_dir), training)
    return load_trained_policy(cfg, cfg.path(cfg.paths.dpo_dir), training)


def load_trained_policy(cfg: Config, folder: Path, training: bool = False):
    """A model folder a stage wrote (the DPO policy, the COrAL model) on the policy's device, in its dtype."""
    return load_pretrained(folder, cfg.policy, training)


def stage_accelerator(device, mixed_precision: str = "no", gradient_accumulation_steps: int = 1):
    """The ``accelerate.Accelerator`` a stage runs under: on the policy's ``device`` (CPU when it is on the CPU),
    one or many processes as ``accelerate launch`` configured them, accumulating the gradients of
    ``gradient_accumulation_steps`` batches per optimizer step (the section's knob:
    :func:`models.common.training.train` checks that its accelerator has it).

    Under several processes, some work runs on the main process alone while the others wait at a barrier (the
    Medusa stage's distillation pass, writing outputs): hours at 8B on real data, so the process group's timeout
    is raised from torch's default (10 min for NCCL) to ``COLLECTIVE_TIMEOUT``.
    """
    return Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision,
                       gradient_accumulation_steps=gradient_accumulation_steps,
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)])


PROMPT_SPLITS = {"train": "training prompts", "eval": "held-out prompts"}


def prompt_split_path(cfg: Config, split: str) -> Path:
    return cfg.path(cfg.paths.prompts_dir) / f"{split}.jsonl"


def read_prompts(cfg: Config, split: str) -> pd.DataFrame:
    """The ``train`` or ``eval`` (held-out) prompts ``prepare_prompts`` wrote; a clear error if it has not run."""
    return read_table(prompt_split_path(cfg, split), PROMPT_SPLITS[split])


def prompt_token_limit(cfg: Config, max_new_tokens: int | None = None) -> int:
    """The longest prompt, in the policy's chat template, that any stage gives the policy:
    ``prompts.max_prompt_tokens``, or automatically the policy's context minus ``generate.max_new_tokens`` and, with a
    reward-model labeler, at most ``label.max_length`` minus it (:func:`foresight.prompts.resolve_max_prompt_tokens`).
    One rule for the splits (``prepare_prompts``) and every prompt set read elsewhere (:func:`drop_long_prompt_sets`);
    a stage that decodes with a budget of its own (``max_new_tokens``) keeps, besides, only prompts that leave it room
    in the context. Reads the prepared policy's config.json, not its weights."""
    context = policy_context_length(policy_path(cfg.path(cfg.paths.policy_dir)), cfg.policy.trust_remote_code)
    reward_model_length = cfg.label.max_length if cfg.label.labeler != "verifiable" else None
    limit = resolve_max_prompt_tokens(cfg.prompts.max_prompt_tokens, context, cfg.generate.max_new_tokens,
                                      reward_model_length)
    return limit if max_new_tokens is None else min(limit, context - max_new_tokens)


def drop_long_prompt_sets(cfg: Config, tokenizer, sets: dict[str, pd.DataFrame], max_new_tokens: int
                          ) -> tuple[dict[str, pd.DataFrame], dict[str, int]]:
    """Each prompt set (a table with ``question``) without its prompts over :func:`prompt_token_limit`, counted in
    the policy's chat template (:func:`foresight.prompts.drop_long_prompts`: a set that keeps none is an error), and
    metrics ``dropped_long_prompts.<set>``; a warning names each set that lost prompts and how many. For the stages
    that read prompts besides the splits ``prepare_prompts`` already checked (further task prompts, the general
    instruction set, benchmark prompt files), which decode up to ``max_new_tokens``: a prompt over the policy's
    context would fail or decode junk."""
    limit = prompt_token_limit(cfg, max_new_tokens)
    kept, counts = drop_long_prompts(sets, tokenizer, cfg.prompts.system_prompt, limit)
    dropped = {name: [n for n in set_counts if n > limit] for name, set_counts in counts.items()}
    for name, over in dropped.items():
        if over:
            stage_logger().warning(
                "prompt set %r: dropped %d of %d prompt(s) longer than prompts.max_prompt_tokens = %d tokens in the "
                "policy's chat template (the longest %d tokens)", name, len(over), len(sets[name]), limit, max(over))
    return kept, {f"dropped_long_prompts.{name}": len(over) for name, over in dropped.items()}


def reference_answers(table: pd.DataFrame) -> list[str | None]:
    """The table's ``answer`` column as Python values, None where a prompt has no reference answer (NaN in a
    parquet or jsonl column)."""
    return [None if pd.isna(answer) else answer for answer in table["answer"]]
