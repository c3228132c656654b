"""One Prefect flow per pipeline stage, built from the stage table (:data:`foresight.stages.STAGES`). DVC stages
call these: ``python -m flows.stages <stage>``.

Every flow takes the same parameters, so the Prefect UI can trigger any of them:
``params_path`` (the params file), ``overrides`` (dotted keys on top of it, e.g.
``{"generate.num_samples": 3}``) and ``parent_run_id`` (the MLflow run to nest under; the pipeline
flow passes it through the environment instead, because DVC runs stages in their own processes).

Each flow is a module-level attribute named ``<stage>_flow``, so a deployment finds it by entrypoint
(``flows/stages.py:train_reward_flow``). A flow imports only its own task's module, when it runs, and reads only
its stage's sections of the params (:func:`foresight.params.load_params`), so a stage process loads only the code
its stage's DVC deps list (:attr:`foresight.stages.Stage.code`); ``run_stage`` checks that after the task returns.

Several GPUs (``launch.num_processes`` > 1, docs/gpu.md). A training stage (``Stage.distributed``) then runs its
task in every process of ``accelerate launch -m flows.stages --worker …`` (data parallel: each process takes its
share of every batch, gradients are all-reduced). The flow's own process keeps all the bookkeeping: it runs the
launch as one ``gpu``-tagged Prefect task (retried once after a transient CUDA error), and once the workers are
done it checks their declarations and logs their result to MLflow and Prefect. Workers run outside any Prefect
run; the main one writes the stage's outputs and hands its :class:`tasks.common.StageResult` back as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextvars import ContextVar
from pathlib import Path

import yaml
from prefect import Flow, flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.utilities.annotations import quote

from foresight.params import Params, load_params, load_reference
from foresight.stages import (
    PATH_EXPRESSION,
    STAGES,
    Stage,
    resolve_path,
    undeclared_files,
    undeclared_modules,
)
from foresight.storage import read_table, write_json
from foresight.tracking import log_stage_outputs, register_models, stage_run
from models.common.files import atomic_path

ROOT = Path(__file__).resolve().parent.parent

# Only a process started for one stage (``main``, what DVC runs) has nothing in ``sys.modules`` but what that
# stage imported; a test or any other long-lived process may hold other stages' modules.
_CHECK_MODULES: ContextVar[bool] = ContextVar("check_modules", default=False)


class UndeclaredReadError(RuntimeError):
    """A stage read files or code that its ``dvc.yaml`` entry does not list: DVC would not re-run it when they
    change."""


def metrics_path(cfg: Params, stage: str):
    """The stage's DVC metrics file."""
    return cfg.path(cfg.paths.metrics_dir) / f"{stage}.json"


def write_curves(curves: dict[str, list[float]], folder: Path) -> None:
    """Each curve as ``folder/<name>.csv`` (``step,value``; step = index + 1, NaN steps left out, a curve with no
    number at all left out), the folder replaced whole: the stage's DVC plots."""
    import pandas as pd

    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        for name, values in curves.items():
            table = pd.DataFrame({"step": range(1, len(values) + 1), "value": values}).dropna()
            if len(table):
                table.to_csv(tmp / f"{name.replace('/', '_')}.csv", index=False)


def _task(stage: Stage):
    return load_reference(stage.task)


def _check_modules(stage: Stage, modules: list[str] | None = None) -> None:
    """Fail naming every project module the stage imported outside its code deps. ``modules``: what launched
    workers imported outside them (``None``: check this process)."""
    if modules is None and _CHECK_MODULES.get():
        modules = undeclared_modules(stage, sys.modules, ROOT)
    if modules:
        raise UndeclaredReadError(
            f"stage {stage.name} imported modules {', '.join(modules)} outside its code deps "
            f"(foresight.stages.stage_modules missed them: an import it cannot see, such as importlib)")


INTERRUPT_GRACE_S = 30.0
"""How long an interrupted command (``dvc repro``, a stage's ``accelerate launch``) gets to end as interrupted (a
stage reports its flow run crashed and restores its outputs) before what is left of it is killed."""


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the whole group has ended
        pass


def run_streaming(cmd: list[str], cwd: Path, env: dict, what: str) -> list[str]:
    """Run a command, forward each output line to the Prefect log, fail with its last lines.

    The command runs in a session of its own, so the terminal's Ctrl-C reaches this process only, and whatever
    stops this process early (Ctrl-C; a cancellation, Prefect's ``TerminationSignal`` on SIGTERM; an error) is
    passed on to the command's whole process group as one SIGINT, the signal every part of it ends cleanly on
    (``dvc`` waits for its stage; a stage reports its flow run crashed, restores its outputs and exits 130) while
    this process logs what they say; after :data:`INTERRUPT_GRACE_S`, or at a second interrupt, what is left of the
    group is killed, so no process of the command outlives this one.
    """
    logger = get_run_logger()
    lines: list[str] = []
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            for line in proc.stdout:
                line = line.rstrip()
                lines.append(line)
                logger.info("%s", line)
        except BaseException:
            _signal_group(proc.pid, signal.SIGINT)
            deadline = threading.Timer(INTERRUPT_GRACE_S, _signal_group, (proc.pid, signal.SIGKILL))
            deadline.start()
            try:
                for line in proc.stdout:  # until the whole group has closed its output: it has ended
                    logger.info("%s", line.rstrip())
            finally:
                deadline.cancel()
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    if proc.returncode != 0:
        tail = "\n".join(lines[-25:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return lines


def _task_kwargs(stage: Stage, cfg) -> dict:
    return {key: resolve_path(cfg, value) if PATH_EXPRESSION.match(value) else value
            for key, value in stage.task_kwargs.items()}


def launch_command(stage: Stage, cfg: Params, params_path: str, overrides: dict | None, result_path: Path) -> list[str]:
    """``accelerate launch`` of the stage's workers: ``launch.num_processes`` processes (``--multi_gpu``: one per
    GPU, or gloo processes on a CPU), or the user's ``launch.accelerate_config``."""
    launch = cfg.launch
    config = (["--config_file", str(cfg.path(launch.accelerate_config))] if launch.accelerate_config
              else ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"])
    return [sys.executable, "-m", "accelerate.commands.launch", *config, "--num_processes", str(launch.num_processes),
            "-m", "flows.stages", "--worker", stage.name, str(Path(params_path).resolve()), json.dumps(overrides or {}),
            str(result_path)]


def _launch(stage: Stage, cfg: Params, params_path: str, overrides: dict | None):
    """Run the stage's workers under ``accelerate launch`` (as a ``gpu`` Prefect task); returns the main worker's
    result and the modules they imported outside the stage's code."""
    from tasks.common import StageResult, gpu_task

    @gpu_task(f"{stage.flow_name}-launch")
    def launched() -> dict:
        with tempfile.TemporaryDirectory(prefix="foresight-launch-") as scratch:
            result_path = Path(scratch) / "result.json"
            command = launch_command(stage, cfg, params_path, overrides, result_path)
            get_run_logger().info("launching %d processes: %s", cfg.launch.num_processes, " ".join(command))
            run_streaming(command, ROOT, dict(os.environ, PYTHONUNBUFFERED="1"), f"accelerate launch of {stage.name}")
            return json.loads(result_path.read_text())

    report = launched()
    result = StageResult(metrics={**report["metrics"], "num_processes": report["num_processes"]},
                         curves=report["curves"],
                         tables={k: Path(v) for k, v in report["tables"].items()},
                         artifacts={k: Path(v) for k, v in report["artifacts"].items()},
                         models={k: Path(v) for k, v in report["models"].items()})
    for artifact in report["pending_artifacts"]:  # made by the main worker, outside any Prefect run
        if artifact.pop("kind") == "table":
            create_table_artifact(**artifact)
        else:
            create_markdown_artifact(**artifact)
    return result, report["modules"]


def run_worker(stage_name: str, params_path: str, overrides: dict, result_path: Path) -> None:
    """One process of a launched stage: run its task's function (no Prefect run); the main process writes the
    result and any undeclared module for the flow's process to check."""
    from accelerate import PartialState

    from tasks.common import PENDING_ARTIFACTS

    stage = next(s for s in STAGES if s.name == stage_name)
    # The task's log (tasks.common.stage_logger) goes to the launch's output, which the flow streams to Prefect. The
    # rank comes from the launcher's environment: accelerate's state must first be made by the task's own
    # Accelerator (on the policy's device), or it would settle on defaults that ignore the other processes.
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s | rank {rank} | %(message)s")
    cfg = load_params(params_path, overrides, stage.config_keys)
    result = _task(stage).fn(cfg, **_task_kwargs(stage, cfg))
    if PartialState().is_main_process:
        report = {"metrics": result.metrics, "curves": result.curves,
                  "tables": {name: str(path) for name, path in result.tables.items()},
                  "artifacts": {name: str(path) for name, path in result.artifacts.items()},
                  "models": {name: str(path) for name, path in result.models.items()},
                  "pending_artifacts": PENDING_ARTIFACTS,
                  "num_processes": PartialState().num_processes,
                  "modules": undeclared_modules(stage, sys.modules, ROOT)}
        write_json(report, result_path)
    PartialState().wait_for_everyone()


def run_stage(stage: Stage, params_path: str, overrides: dict | None, parent_run_id: str | None) -> dict:
    """Load the stage's sections of the params, run the stage's task inside its MLflow run (in this process, or in
    the processes of an ``accelerate launch``), check the modules it imported against its code deps, write its
    metrics, publish artifacts."""
    from foresight.memory import preflight, visible_gpus

    cfg = load_params(params_path, overrides, stage.config_keys)
    if _CHECK_MODULES.get() and (missing := undeclared_files(stage, cfg)):  # run by DVC, from its dvc.yaml
        raise UndeclaredReadError(
            f"stage {stage.name} reads {', '.join(missing)} (named in params.yaml), which dvc.yaml does not list "
            "among its deps: DVC would not re-run it when the file changes. Run `foresight dvc-yaml > dvc.yaml` "
            "(foresight run / pipeline do it for you)")
    preflight(stage, cfg, visible_gpus())  # on GPUs: fail now, naming the knob, rather than out of memory later
    started = time.perf_counter()
    sections = sorted({param.split(".")[0] for param in stage.params})  # logged to MLflow whole
    with stage_run(cfg, stage.name, sections, parent_run_id) as run_id:
        try:
            if stage.distributed and cfg.launch.num_processes > 1:
                result, modules = _launch(stage, cfg, params_path, overrides)
            else:
                # quote: Prefect would otherwise walk the config's fields looking for futures
                result = _task(stage)(quote(cfg), **_task_kwargs(stage, cfg))
                modules = None
        except Exception as err:
            results = getattr(err, "results", None)  # a failed GX suite carries its summary: keep it
            if results is not None:
                import mlflow

                mlflow.log_dict(results, "validation_summary.json")
                log_stage_outputs(cfg, {}, {}, {"datadocs": cfg.path(cfg.paths.reports_dir) / "datadocs"})
            raise
        _check_modules(stage, modules)
        result.metrics["stage_seconds"] = time.perf_counter() - started
        tables = {name: read_table(path, name) for name, path in result.tables.items()}
        registered = register_models(cfg, result.models)
        result.metrics |= {f"model_version.{name}": version for name, version in registered.items()}
        attached = {name: path for name, path in result.models.items() if name not in registered}
        log_stage_outputs(cfg, result.metrics, tables, result.artifacts | attached, result.curves)
    write_json(result.metrics, metrics_path(cfg, stage.name))
    if stage.curves:
        write_curves(result.curves, cfg.path(cfg.paths.metrics_dir) / "curves" / stage.name)
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


def restore_outputs(stage_name: str, root: Path) -> str:
    """Bring back the outputs DVC removed before running the failed stage: ``dvc checkout`` of the stage, the
    versions its ``dvc.lock`` entry records, from the DVC cache (DVC leaves its repository unlocked while a stage's
    command runs). Returns one line saying what happened, for the error message."""
    recorded = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage_name, {}).get("outs", []) \
        if (lock := root / "dvc.lock").is_file() else []
    if not recorded:
        return f"Stage {stage_name} had no earlier outputs to restore."
    proc = subprocess.run([sys.executable, "-m", "dvc", "checkout", stage_name], cwd=root, capture_output=True,
                          text=True)
    paths = ", ".join(out["path"] for out in recorded)
    if proc.returncode == 0 and all((root / out["path"]).exists() for out in recorded):
        return f"Its previous outputs ({paths}) were restored from the DVC cache (dvc checkout {stage_name})."
    return (f"Its previous outputs ({paths}) could not be restored (dvc checkout {stage_name}: "
            f"{(proc.stdout + proc.stderr).strip()[-500:]}); `dvc checkout {stage_name}` retries.")


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.stages STAGE [PARAMS_PATH]``: what each DVC stage runs (``--worker STAGE PARAMS
    OVERRIDES RESULT``: one process of a launched stage)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _, stage_name, params_path, overrides, result_path = argv
        run_worker(stage_name, params_path, json.loads(overrides), Path(result_path))
        return
    if not argv or argv[0] not in STAGE_FLOWS:
        sys.exit(f"usage: python -m flows.stages {{{','.join(STAGE_FLOWS)}}} [params.yaml]")
    _CHECK_MODULES.set(True)
    params_path = argv[1] if len(argv) > 1 else "params.yaml"
    try:
        STAGE_FLOWS[argv[0]](params_path=params_path)
    except Exception as err:  # the traceback is in the Prefect log; end with the cause, for dvc's output
        sys.exit(f"ERROR: stage {argv[0]} failed: {type(err).__name__}: {err}\n"
                 + restore_outputs(argv[0], Path(params_path).resolve().parent))
    except KeyboardInterrupt:  # Ctrl-C: DVC waits for this process (it ignores SIGINT while a stage runs)
        print(f"stage {argv[0]} interrupted. " + restore_outputs(argv[0], Path(params_path).resolve().parent),
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
