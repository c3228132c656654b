"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

Stages run in separate processes (``dvc repro`` starts each stage's flow), and MLflow's active run
is thread-local, so the parent run id travels explicitly: as an argument, or through the
``FORESIGHT_MLFLOW_PARENT_RUN_ID`` environment variable that the pipeline flow sets for ``dvc repro``.
A stage run on its own (no parent) becomes a top-level run.

Model weights live in DVC (workspace + cache, linked: ``.dvc/config``); MLflow gets, for every folder it logs, a
``dvc-manifest.json`` that names each file by its md5 (the name of its object in DVC's cache) and the folder by
the hash DVC gives it in ``dvc.lock`` (dvc_data's ``Tree.digest``: the md5 of the sorted ``[{"md5", "relpath"}]``
JSON list, plus ``.dir``), and copies only the files up to ``tracking.large_file_mb``
(``tracking.large_files: manifest``). A registered 8B policy is then a few kilobytes in MLflow that identify its
16 GB of weights exactly, instead of a third copy of them.

What the MLflow UI shows (docs/pipeline.md, "What MLflow holds"): the experiment is tagged as a model-training one
(:data:`EXPERIMENT_KIND`) and :func:`experiment_url` links to its runs table; every interval is a row of a
``headline.json`` table (:func:`interval_table`: value, low, high, level and ``value [low, high]``) on the stage's run
and, for every stage's headline figures, on the parent run, beside the flat ``x``, ``x_low``, ``x_high`` metrics
that keep runs sortable and comparable in the runs table; training curves arrive step by step while a stage trains
(:class:`LiveCurves`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import posixpath
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from foresight.params import ATTRIBUTE_NAMES

if TYPE_CHECKING:
    from foresight.config import Config


PARENT_RUN_ENV = "FORESIGHT_MLFLOW_PARENT_RUN_ID"
STAGE_RUN_ENV = "FORESIGHT_MLFLOW_STAGE_RUN_ID"
"""Set while a stage's run is open, for the code that logs to it from elsewhere: the task's live curves
(:class:`LiveCurves`), also from the processes of an ``accelerate launch``, which inherit the environment."""
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""The experiment tag that MLflow's UI reads for the experiment's type, and the value that its type selector writes
for "Machine learning" (mlflow/server/js, 3.17.2: ``ExperimentKind.CUSTOM_MODEL_DEVELOPMENT``), whose experiment
page opens on the runs table; untagged, a new experiment is taken for a GenAI one and opens on "Traces". MLflow
3.17.2's UI decides the view by its global workflow type instead (the sidebar's "GenAI" / "Model training" switch,
default GenAI, or the ``workflowType`` URL parameter): :func:`experiment_url` sets it in the link."""
MANIFEST = "dvc-manifest.json"
"""The manifest's name in every folder logged to MLflow (not a name any stage writes)."""


def _mlflow(cfg: Config):
    import mlflow
    from filelock import FileLock

    uri = cfg.mlflow_uri()
    mlflow.set_tracking_uri(uri)
    if not uri.startswith("sqlite:"):  # a tracking server creates its store and experiments itself
        _tag_kind(mlflow, mlflow.set_experiment(cfg.tracking.experiment))
        return mlflow
    # Runs started at once (workers on independent branches) would race to create the store's tables and the
    # experiment, and the loser fails ("table ... already exists"): one process at a time does it.
    with FileLock(uri.removeprefix("sqlite:///") + ".lock"):
        if mlflow.get_experiment_by_name(cfg.tracking.experiment) is None:
            # MLflow would put artifacts under the *working* folder's ./mlruns; keep them beside the sqlite store.
            location = (cfg.tracking_root / "mlruns").resolve().as_uri()
            mlflow.create_experiment(cfg.tracking.experiment, artifact_location=location)
        _tag_kind(mlflow, mlflow.set_experiment(cfg.tracking.experiment))
    return mlflow


def _tag_kind(mlflow, experiment) -> None:
    """Tag the experiment as a model-training one (:data:`EXPERIMENT_KIND`), unless it already has a kind (one a
    user chose in the UI stays)."""
    key, kind = EXPERIMENT_KIND
    if key not in experiment.tags:
        mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, key, kind)


def experiment_url(cfg: Config, server: str) -> str:
    """The link to the experiment's runs table on the MLflow UI at ``server`` (``http://127.0.0.1:5000``), in the
    UI's model-training view (:data:`EXPERIMENT_KIND`)."""
    experiment = _mlflow(cfg).get_experiment_by_name(cfg.tracking.experiment)
    return f"{server.rstrip('/')}/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"


def run_tags(cfg: Config) -> dict[str, str]:
    """Where a run's results came from: the git commit of the project (``-dirty`` with uncommitted changes) and,
    inside ``dvc exp run``, the DVC experiment's name and baseline commit; MLflow's UI filters and groups by them."""
    import subprocess

    tags = {}
    git = ["git", "-C", str(cfg.root)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode == 0:
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=False).stdout.strip()
        tags["foresight.git_commit"] = head.stdout.strip() + ("-dirty" if dirty else "")
    for env, tag in (("DVC_EXP_NAME", "foresight.dvc_experiment"), ("DVC_EXP_BASELINE_REV", "foresight.dvc_baseline")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    return tags


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
def _killed_when_interrupted(mlflow) -> Iterator[None]:
    """Inside an MLflow run: Ctrl-C (``KeyboardInterrupt``) or a kill (Prefect's ``TerminationSignal``) ends the run
    KILLED; MLflow's own ``start_run`` context would call it FAILED, like a stage that failed."""
    from mlflow.entities import RunStatus
    from prefect.exceptions import TerminationSignal

    try:
        yield
    except (KeyboardInterrupt, TerminationSignal):
        mlflow.end_run(RunStatus.to_string(RunStatus.KILLED))
        raise


@contextlib.contextmanager
def pipeline_run(cfg: Config, run_name: str = "pipeline") -> Iterator[str]:
    """Open the parent run; yields its id. The whole params file is logged as params and as an artifact."""
    mlflow = _mlflow(cfg)
    with mlflow.start_run(run_name=run_name, tags={"foresight.kind": "pipeline", **run_tags(cfg)}) as run, \
            _killed_when_interrupted(mlflow):
        mlflow.log_params(flatten(cfg.model_dump(mode="json", by_alias=True)))
        yield run.info.run_id


@contextlib.contextmanager
def stage_run(cfg: Config, stage: str, sections: list[str], parent_run_id: str | None = None) -> Iterator[str]:
    """Open a stage's run, nested under the parent when one is given (argument or environment)."""
    mlflow = _mlflow(cfg)
    # the system metrics monitor's INFO lines (started, no GPU metrics, stopping, stopped) say nothing the run's
    # record does not: its warnings only
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    parent = parent_run_id or os.environ.get(PARENT_RUN_ENV) or None
    tags = {"foresight.kind": "stage", "foresight.stage": stage, **run_tags(cfg)}
    with mlflow.start_run(run_name=stage, nested=parent is not None, parent_run_id=parent, tags=tags,
                          log_system_metrics=cfg.tracking.system_metrics) as run, _killed_when_interrupted(mlflow):
        # each section dumped as the stage holds it: whole, or only its declared keys
        mlflow.log_params(flatten({s: getattr(cfg, ATTRIBUTE_NAMES.get(s, s)).model_dump(mode="json")
                                   for s in sections}))
        outer = os.environ.get(STAGE_RUN_ENV)
        os.environ[STAGE_RUN_ENV] = run.info.run_id
        try:
            yield run.info.run_id
        finally:
            if outer is None:
                os.environ.pop(STAGE_RUN_ENV, None)
            else:
                os.environ[STAGE_RUN_ENV] = outer


def log_stage_outputs(cfg: Config, metrics: dict, tables: dict[str, pd.DataFrame], artifact_dirs: dict[str, Path],
                      curves: dict[str, list[float]] | None = None, headline: tuple[str, ...] = ()) -> None:
    """Log metrics, the interval table (``headline.json``: the ``headline`` metrics, then every other metric with an
    interval; :func:`interval_table`), curves (a metric history per key, step = index + 1; NaN steps skipped) that
    the training loops did not already log live (:class:`LiveCurves`), a preview of each table, and folders (model
    folders, Data Docs: each with its ``dvc-manifest.json``, its large files listed there rather than copied under
    ``tracking.large_files: manifest``) to the active run."""
    import mlflow
    from mlflow.entities import Metric

    # a curve is a metric's history in MLflow: under a metric's name its last step would overwrite the metric
    clashes = sorted(set(metrics) & set(curves or {}))
    if clashes:
        raise ValueError(f"{clashes} are both metrics and per-step curves of the stage: name the curves apart")
    run_id = mlflow.active_run().info.run_id
    live = set(mlflow.MlflowClient().get_run(run_id).data.metrics)  # curves logged step by step while training
    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    stage = mlflow.active_run().data.tags.get("foresight.stage", "")
    intervals = [key for key in metrics if f"{key}_low" in metrics and f"{key}_high" in metrics]
    table = interval_table({stage: metrics}, {stage: (*headline, *(k for k in intervals if k not in headline))})
    if len(table):
        log_interval_table(table)
    now = int(time.time() * 1000)
    history = [Metric(key, float(v), now, step) for key, values in (curves or {}).items() if key not in live
               for step, v in enumerate(values, start=1) if v == v]
    for start in range(0, len(history), 1000):  # MLflow takes at most 1000 metrics per batch
        mlflow.tracking.MlflowClient().log_batch(run_id, metrics=history[start : start + 1000])
    for name, df in tables.items():
        preview = df.head(cfg.tracking.preview_rows)
        # log_table wants JSON-serialisable cells: nullable booleans and NaN become plain objects.
        mlflow.log_table(preview.astype(object).where(preview.notna(), None), artifact_file=f"tables/{name}.json")
    for name, folder in artifact_dirs.items():
        if Path(folder).is_dir():
            _log_folder(cfg, Path(folder), name, mlflow.log_artifact, mlflow.log_artifacts)


def register_models(cfg: Config, folders: dict[str, Path]) -> dict[str, int]:
    """Each folder of ``folders`` (name → trained artifact) that ``tracking.register_models`` names, as a logged model
    of the active run (its manifest and its files up to ``tracking.large_file_mb``, all of them under
    ``large_files: copy``) registered as ``<experiment>-<name>``: a new version each run, linked to the run and
    tagged with the git commit. Returns the version numbers registered.
    ``mlflow.artifacts.download_artifacts("models:/<experiment>-<name>/<version>")`` brings a version back; its
    ``dvc-manifest.json`` names the files left in DVC (``dvc checkout PATH`` in this clone)."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    client, tags = mlflow.MlflowClient(), run_tags(cfg)
    versions = {}
    for name, folder in folders.items():
        if name not in cfg.tracking.register_models:
            continue
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"model {name}: no folder {folder} to register")
        registered = f"{cfg.tracking.experiment}-{name}"
        model = mlflow.initialize_logged_model(name=registered, model_type=name, tags=tags)
        _log_folder(cfg, Path(folder), None, functools.partial(client.log_model_artifact, model.model_id),
                    functools.partial(client.log_model_artifacts, model.model_id))
        mlflow.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        versions[name] = int(mlflow.register_model(f"models:/{model.model_id}", registered).version)
    return versions


def _md5(path: Path) -> str:
    """A file's md5, read 16 MB at a time (a 16 GB policy never sits in memory)."""
    digest = hashlib.md5()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def folder_manifest(cfg: Config, folder: Path) -> dict:
    """What identifies ``folder``'s contents and where they are kept: its path (relative to the params file's
    folder, the DVC root, when inside it), its DVC hash (``md5``, ``<hex>.dir``: what ``dvc.lock`` records when
    the folder is a stage's output), ``size`` and ``nfiles`` as there, the git commit, and per file its relative
    path, size and md5 (DVC's cache keeps it at ``.dvc/cache/files/md5/<md5[:2]>/<md5[2:]>``) and whether MLflow
    holds a copy (``copied``: ``large_files: copy``, or at most ``large_file_mb``)."""
    folder, limit = Path(folder), cfg.tracking.large_file_mb * 1e6
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        size = path.stat().st_size
        files.append({"relpath": path.relative_to(folder).as_posix(), "size": size, "md5": _md5(path),
                      "copied": cfg.tracking.large_files == "copy" or size <= limit})
    # dvc_data.hashfile.tree.Tree.as_bytes: the entries sorted by relpath, keys sorted, json.dumps' default spacing
    tree = json.dumps(sorted(({"md5": f["md5"], "relpath": f["relpath"]} for f in files),
                             key=lambda entry: entry["relpath"]), sort_keys=True)
    resolved, root = folder.resolve(), Path(cfg.root).resolve()
    path = resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else str(resolved)
    return {"path": path, "md5": hashlib.md5(tree.encode("utf-8")).hexdigest() + ".dir",
            "size": sum(f["size"] for f in files), "nfiles": len(files),
            "git_commit": run_tags(cfg).get("foresight.git_commit"),
            "restore": f"dvc checkout {path}  (this clone's DVC cache; `dvc pull {path}` from a remote it was pushed "
                       "to); files not copied here are DVC cache objects named by their md5",
            "files": files}


def _log_folder(cfg: Config, folder: Path, prefix: str | None, log_file: Callable[[str, str | None], None],
                log_dir: Callable[[str, str | None], None]) -> None:
    """Log ``folder``'s manifest (:func:`folder_manifest`) and the files it marks ``copied`` under the artifact path
    ``prefix``: ``log_file(local_file, artifact_path)`` one by one, or ``log_dir(folder, prefix)`` at once when
    every file is copied (MLflow's ``log_artifact``/``log_artifacts`` signatures)."""
    manifest = folder_manifest(cfg, folder)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        log_file(str(Path(tmp) / MANIFEST), prefix)
    if all(f["copied"] for f in manifest["files"]):
        log_dir(str(folder), prefix)
        return
    for f in manifest["files"]:
        if f["copied"]:
            parent = posixpath.dirname(f["relpath"])
            log_file(str(folder / f["relpath"]), "/".join(filter(None, (prefix, parent))) or None)


def headline_metrics(stage_metrics: dict[str, dict], headlines: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """``<stage>.<metric>`` for each stage's headline metrics, with their interval bounds (``<metric>_low`` /
    ``_high``) where the stage wrote them: the parent run's row in MLflow's run table, so pipeline runs compare
    side by side."""
    flat = {}
    for stage, metrics in stage_metrics.items():
        for key in headlines.get(stage, ()):
            for name in (key, f"{key}_low", f"{key}_high"):
                value = metrics.get(name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    flat[f"{stage}.{name}"] = float(value)
    return flat


def interval_table(stage_metrics: dict[str, dict], keys: dict[str, tuple[str, ...]]) -> pd.DataFrame:
    """One row per figure: ``stage``, ``metric``, ``value``, ``low``, ``high`` (its 95 % interval,
    :data:`foresight.statistics.CONFIDENCE`: ``level``; empty where it has none) and ``figure`` (``value [low,
    high]``, as the report writes it), for each stage's ``keys`` that it measured as a number: what a reader takes
    for one thing in the MLflow UI, where the flat metrics are three unrelated columns."""
    from foresight.statistics import CONFIDENCE

    def number(value) -> float | None:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
            else None

    rows = []
    for stage, metrics in stage_metrics.items():
        for key in keys.get(stage, ()):
            value = number(metrics.get(key))
            if value is None:
                continue
            low, high = number(metrics.get(f"{key}_low")), number(metrics.get(f"{key}_high"))
            bounded = low is not None and high is not None
            rows.append({"stage": stage, "metric": key, "value": value, "low": low, "high": high,
                         "level": CONFIDENCE if bounded else None,
                         "figure": f"{value:.4g} [{low:.4g}, {high:.4g}]" if bounded else f"{value:.4g}"})
    return pd.DataFrame(rows, columns=["stage", "metric", "value", "low", "high", "level", "figure"])


HEADLINE_TABLE = "headline.json"
"""The artifact of the interval table on a stage's run and on the parent run."""


def log_interval_table(table: pd.DataFrame) -> None:
    """:func:`interval_table` as the active run's ``headline.json`` (``mlflow.log_table``: the run's artifact view
    shows it as a table)."""
    import mlflow

    # log_table wants JSON-serialisable cells: a missing bound is null, not NaN
    mlflow.log_table(table.astype(object).where(table.notna(), None), artifact_file=HEADLINE_TABLE)


class LiveCurves:
    """The curve sink of a stage's training loops (:func:`models.common.curves.log_step`): each step's numbers
    that ``names`` maps to a curve name (``names(key)``; None: not a curve) become one point of that curve at the
    loop's step (the index + 1 in ``StageResult.curves``), stamped with the time it arrived. A loop that starts
    over at a step it already passed is the next loop of the block (COrAL's stage 2 after stage 1, whose curves
    are one history): its steps go on after the last one's. A loop resumed from a checkpoint starts past step 1:
    this run gets the steps from there (the killed run holds the earlier ones). They go to the stage's MLflow run
    (:data:`STAGE_RUN_ENV`; none: they are only kept) every :data:`FLUSH_SECONDS` as one batch, written by MLflow's
    asynchronous logging on a thread of its own: a step pays a list append, the store one write per batch rather
    than one per step (a sqlite write costs 20–50 ms of a 2-core machine's CPU under load). :attr:`curves` keeps
    every point, NaN included (MLflow takes none: that step is left out, as the end-of-stage logging does);
    :meth:`wait` sends what is buffered and returns once MLflow holds it all. The end-of-stage logging
    (:func:`log_stage_outputs`) skips the curves the run already holds.

    Under ``accelerate launch`` the sink runs in the main worker, outside the flow's process: it logs through an
    ``MlflowClient`` of its own to the run id the environment carries."""

    FLUSH_SECONDS = 2.0
    """How long points wait to be sent at most (and a step longer than this sends its own at once)."""

    def __init__(self, cfg: Config, names: Callable[[str], str | None]):
        self.names, self.uri, self.run_id = names, cfg.mlflow_uri(), os.environ.get(STAGE_RUN_ENV)
        self.curves: dict[str, list[float]] = {}
        self._client, self._buffer, self._pending, self._sent = None, [], [], time.monotonic()
        self._offset = self._last = 0  # steps of the loops before the running one; the running one's last step

    def __call__(self, values, step: int) -> None:
        from mlflow.entities import Metric

        if step <= self._last:  # a new loop: it counts from 1 again
            self._offset += self._last
        self._last, number, now = step, self._offset + step, int(time.time() * 1000)
        for key, value in values.items():
            name = self.names(key)
            if name is None:
                continue
            curve = self.curves.setdefault(name, [])
            curve += [float("nan")] * (number - 1 - len(curve)) + [float(value)]  # NaN: steps before a resume
            if value == value and self.run_id:
                self._buffer.append(Metric(name, float(value), now, number))
        if time.monotonic() - self._sent >= self.FLUSH_SECONDS:
            self._send()

    def _send(self) -> None:
        self._sent = time.monotonic()
        if not self._buffer:
            return
        if self._client is None:
            import mlflow

            self._client = mlflow.MlflowClient(self.uri)
        points, self._buffer = self._buffer, []
        for start in range(0, len(points), 1000):  # MLflow takes at most 1000 metrics per batch
            self._pending.append(self._client.log_batch(self.run_id, metrics=points[start : start + 1000],
                                                        synchronous=False))

    def wait(self) -> None:
        """Send the buffered points and block until MLflow has stored every point so far (raises what a failed
        write raised)."""
        self._send()
        pending, self._pending = self._pending, []
        for operation in pending:
            operation.wait()
