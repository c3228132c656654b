"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

Stages run in separate processes (``dvc repro`` starts each stage's flow), and MLflow's active run
is thread-local, so the parent run id travels explicitly: as an argument, or through the
``FORESIGHT_MLFLOW_PARENT_RUN_ID`` environment variable that the pipeline flow sets for ``dvc repro``.
A stage run on its own (no parent) becomes a top-level run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from foresight.config import Config

PARENT_RUN_ENV = "FORESIGHT_MLFLOW_PARENT_RUN_ID"


def _mlflow(cfg: Config):
    import mlflow

    mlflow.set_tracking_uri(cfg.mlflow_uri())
    if mlflow.get_experiment_by_name(cfg.tracking.experiment) is None and cfg.mlflow_uri().startswith("sqlite:"):
        # MLflow would put artifacts under the *working* folder's ./mlruns; keep them beside the params file.
        mlflow.create_experiment(cfg.tracking.experiment, artifact_location=(cfg.root / "mlruns").resolve().as_uri())
    mlflow.set_experiment(cfg.tracking.experiment)
    return mlflow


def flatten(section: dict, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (MLflow params are flat strings)."""
    flat = {}
    for key, value in section.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


@contextlib.contextmanager
def pipeline_run(cfg: Config, run_name: str = "pipeline") -> Iterator[str]:
    """Open the parent run; yields its id. The whole params file is logged as params and as an artifact."""
    mlflow = _mlflow(cfg)
    with mlflow.start_run(run_name=run_name, tags={"foresight.kind": "pipeline"}) as run:
        mlflow.log_params(flatten(cfg.model_dump(mode="json", by_alias=True)))
        yield run.info.run_id


@contextlib.contextmanager
def stage_run(cfg: Config, stage: str, sections: list[str], parent_run_id: str | None = None) -> Iterator[str]:
    """Open a stage's run, nested under the parent when one is given (argument or environment)."""
    mlflow = _mlflow(cfg)
    parent = parent_run_id or os.environ.get(PARENT_RUN_ENV) or None
    tags = {"foresight.kind": "stage", "foresight.stage": stage}
    with mlflow.start_run(run_name=stage, nested=parent is not None, parent_run_id=parent, tags=tags) as run:
        dumped = cfg.model_dump(mode="json", by_alias=True)
        mlflow.log_params(flatten({s: dumped[s] for s in sections}))
        yield run.info.run_id


def log_stage_outputs(cfg: Config, metrics: dict, tables: dict[str, pd.DataFrame], artifact_dirs: dict[str, Path],
                      curves: dict[str, list[float]] | None = None) -> None:
    """Log metrics, curves (a metric history per key, step = index + 1; NaN steps skipped), a preview of each
    table, and whole folders (e.g. Data Docs) to the active run."""
    import mlflow
    from mlflow.entities import Metric

    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    now = int(time.time() * 1000)
    history = [Metric(key, float(v), now, step) for key, values in (curves or {}).items()
               for step, v in enumerate(values, start=1) if v == v]
    for start in range(0, len(history), 1000):  # MLflow takes at most 1000 metrics per batch
        mlflow.tracking.MlflowClient().log_batch(mlflow.active_run().info.run_id, metrics=history[start : start + 1000])
    for name, df in tables.items():
        preview = df.head(cfg.tracking.preview_rows)
        # log_table wants JSON-serialisable cells: nullable booleans and NaN become plain objects.
        mlflow.log_table(preview.astype(object).where(preview.notna(), None), artifact_file=f"tables/{name}.json")
    for name, folder in artifact_dirs.items():
        if Path(folder).is_dir():
            mlflow.log_artifacts(str(folder), artifact_path=name)
