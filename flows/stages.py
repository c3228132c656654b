"""One Prefect flow per pipeline stage, built from the stage table (:data:`foresight.stages.STAGES`). DVC stages
call these: ``python -m flows.stages <stage>``.

Every flow takes the same parameters, so the Prefect UI can trigger any of them:
``params_path`` (the params file), ``overrides`` (dotted keys on top of it, e.g.
``{"generate.num_samples": 3}``) and ``parent_run_id`` (the MLflow run to nest under; the pipeline
flow passes it through the environment instead, because DVC runs stages in their own processes).

Each flow is a module-level attribute named ``<stage>_flow``, so a deployment finds it by entrypoint
(``flows/stages.py:train_reward_flow``). A flow imports only its own task's module, when it runs, so a stage
process loads only the code its stage declares; ``run_stage`` checks that (and the config keys read) after
the task returns.
"""

from __future__ import annotations

import importlib
import sys
import time
from contextvars import ContextVar
from pathlib import Path

from prefect import Flow, flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.utilities.annotations import quote

from foresight.config import Config, load_config
from foresight.stages import (
    PATH_EXPRESSION,
    STAGES,
    RecordingConfig,
    Stage,
    resolve_path,
    undeclared_modules,
    undeclared_reads,
)
from foresight.storage import read_table, write_json
from foresight.tracking import log_stage_outputs, stage_run

ROOT = Path(__file__).resolve().parent.parent

# Only a process started for one stage (``main``, what DVC runs) has nothing in ``sys.modules`` but what that
# stage imported; a test or any other long-lived process may hold other stages' modules.
_CHECK_MODULES: ContextVar[bool] = ContextVar("check_modules", default=False)


class UndeclaredReadError(RuntimeError):
    """A stage read config keys, data paths or code that the stage table does not declare: DVC would not re-run
    it when they change."""


def metrics_path(cfg: Config, stage: str):
    """The stage's DVC metrics file."""
    return cfg.path(cfg.paths.metrics_dir) / f"{stage}.json"


def _task(stage: Stage):
    module, _, name = stage.task.partition(":")
    return getattr(importlib.import_module(module), name)


def _check_declarations(stage: Stage, reads: set[str]) -> None:
    """Fail naming every config key, ``paths`` entry and project module the stage used but does not declare."""
    problems = []
    if undeclared := undeclared_reads(stage, reads):
        problems.append(f"config keys {', '.join(undeclared)} (declare them in params, or the paths entries in "
                        "inputs/outputs)")
    if _CHECK_MODULES.get() and (modules := undeclared_modules(stage, sys.modules, ROOT)):
        problems.append(f"modules {', '.join(modules)} (declare their files or folders in code)")
    if problems:
        raise UndeclaredReadError(f"stage {stage.name} read what foresight/stages.py does not declare for it: "
                                  + "; ".join(problems))


def run_stage(stage: Stage, params_path: str, overrides: dict | None, parent_run_id: str | None) -> dict:
    """Load the config, run the stage's task inside its MLflow run, check what it read against the stage's
    declarations, write its metrics, publish artifacts."""
    cfg = load_config(params_path, overrides)
    started = time.perf_counter()
    sections = sorted({param.split(".")[0] for param in stage.params})  # logged to MLflow whole
    with stage_run(cfg, stage.name, sections, parent_run_id) as run_id:
        recording = RecordingConfig(cfg)
        kwargs = {key: resolve_path(recording, value) if PATH_EXPRESSION.match(value) else value
                  for key, value in stage.task_kwargs.items()}
        try:
            # quote: Prefect would otherwise walk the config's fields looking for futures, reading all of them
            result = _task(stage)(quote(recording), **kwargs)
        except Exception as err:
            results = getattr(err, "results", None)  # a failed GX suite carries its summary: keep it
            if results is not None:
                import mlflow

                mlflow.log_dict(results, "validation_summary.json")
                log_stage_outputs(cfg, {}, {}, {"datadocs": cfg.path(cfg.paths.reports_dir) / "datadocs"})
            raise
        _check_declarations(stage, recording.reads)
        result.metrics["stage_seconds"] = time.perf_counter() - started
        tables = {name: read_table(path, name) for name, path in result.tables.items()}
        log_stage_outputs(cfg, result.metrics, tables, result.artifacts, result.curves)
    write_json(result.metrics, metrics_path(cfg, stage.name))
    lines = "\n".join(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |"
                      for k, v in sorted(result.metrics.items()))
    create_markdown_artifact(
        key=f"{stage.flow_name}-summary",
        markdown=f"# Stage `{stage.name}`\n\nMLflow run `{run_id}`\n\n| metric | value |\n|---|---|\n{lines}\n",
        description=f"Metrics of stage {stage.name}",
    )
    get_run_logger().info("stage %s done in %.1f s", stage.name, result.metrics["stage_seconds"])
    return result.metrics


def _stage_flow(stage: Stage) -> Flow:
    """The stage's flow, its function named ``<stage>_flow`` (the name a deployment's entrypoint looks up)."""
    def run(params_path: str = "params.yaml", overrides: dict | None = None, parent_run_id: str | None = None) -> dict:
        return run_stage(stage, params_path, overrides, parent_run_id)

    run.__name__ = run.__qualname__ = f"{stage.name}_flow"
    run.__doc__ = stage.description
    return flow(run, name=stage.flow_name, description=stage.description, log_prints=True)


STAGE_FLOWS: dict[str, Flow] = {stage.name: _stage_flow(stage) for stage in STAGES}
globals().update({stage_flow.fn.__name__: stage_flow for stage_flow in STAGE_FLOWS.values()})


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.stages STAGE [PARAMS_PATH]``: what each DVC stage runs."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in STAGE_FLOWS:
        sys.exit(f"usage: python -m flows.stages {{{','.join(STAGE_FLOWS)}}} [params.yaml]")
    _CHECK_MODULES.set(True)
    try:
        STAGE_FLOWS[argv[0]](params_path=argv[1] if len(argv) > 1 else "params.yaml")
    except Exception as err:  # the traceback is in the Prefect log; end with the cause, for dvc's output
        sys.exit(f"ERROR: stage {argv[0]} failed: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
