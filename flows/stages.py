"""One Prefect flow per pipeline stage, built from the stage table (:data:`foresight.stages.STAGES`). DVC stages
call these: ``python -m flows.stages <stage>``.

Under the pipeline flow, each stage's flow run is a subflow of its ``dvc-repro`` task run, tagged with the stage and the
checkout (:func:`run_stage_flow`), and the pipeline's console shows one line per stage event while the stages' full
output goes to a log file and the Prefect API (:class:`PipelineConsole`).

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

import codecs
import hashlib
import json
import logging
import os
import re
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
from models.common.files import CHECKPOINTS_DIR, atomic_path, training_checkpoints

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


TQDM_FRAME = re.compile(r"(?:(?P<desc>.*?): )? *(?P<percent>\d+)%\|[^|]*\| (?P<n>\d+)/(?P<total>\d+) \[[^\]]*\]")
"""One progress-bar frame as tqdm (4.x) draws it by default: ``{desc}: {percent}%|{bar}| {n}/{total} [{elapsed}<
{remaining}, {rate}{postfix}]``. tqdm redraws a bar in place: each frame begins with a carriage return and only the
bar's last frame ends with a newline; what a process prints meanwhile may follow a frame on the same line."""


class CommandOutput:
    """A command's output, split into lines and tqdm's progress frames as it arrives (:func:`run_streaming`).

    Text mode would turn every carriage return into a line break, so each redraw of a progress bar would become a
    line of its own (hundreds in a pipeline's log): the bytes are decoded here and split on newlines only, and each
    carriage-return-separated piece of a line is a frame (:data:`TQDM_FRAME`, to :meth:`progress`) or text. A bar's
    last frame (the one its line ends with) is text as well: it says how long the step took. A frame is handled as
    soon as the next redraw begins, not when the bar's line ends, so a parent's bar moves with the child's.

    This base logs each line to the Prefect run (console and API) and passes the frames on to this process's stderr,
    where the parent's :class:`PipelineConsole` draws them (a stage's ``accelerate launch``, run by ``dvc repro``).
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> None:
        self._pending += self._decoder.decode(data)
        *complete, self._pending = self._pending.split("\n")
        for line in complete:
            self._pieces(line, ends_line=True)
        done, redraw, rest = self._pending.rpartition("\r")
        if redraw:  # what precedes the latest redraw is complete
            self._pieces(done, ends_line=False)
            self._pending = redraw + rest

    def finish(self) -> None:
        """The output has ended: handle what is left of its last line."""
        self._pending += self._decoder.decode(b"", final=True)
        self._pieces(self._pending, ends_line=True)
        self._pending = ""

    def _pieces(self, text: str, ends_line: bool) -> None:
        pieces = text.split("\r")
        for i, piece in enumerate(pieces):
            if frame := TQDM_FRAME.match(piece):
                piece = piece[frame.end():]
                last = ends_line and i == len(pieces) - 1 and not piece.strip()
                self.progress(frame, last)
                if last:
                    self._line(frame.group(0))
            if piece.strip():
                self._line(piece.rstrip())

    def _line(self, line: str) -> None:
        self.lines.append(line)
        self.line(line)

    def line(self, line: str) -> None:
        """A line of output (without its line break)."""
        get_run_logger().info("%s", line)

    def progress(self, frame: re.Match, last: bool) -> None:
        """A progress bar's frame (:data:`TQDM_FRAME`); ``last``: the bar's final one, which is a line as well."""
        if not last:
            sys.stderr.write("\r" + frame.group(0))
            sys.stderr.flush()


def run_streaming(cmd: list[str], cwd: Path, env: dict, what: str, output: CommandOutput | None = None) -> list[str]:
    """Run a command, hand its output to ``output`` as it arrives (default :class:`CommandOutput`: each line to the
    Prefect log), fail with its last lines; returns its lines.

    The command runs in a session of its own, so the terminal's Ctrl-C reaches this process only, and whatever
    stops this process early (Ctrl-C; a cancellation, Prefect's ``TerminationSignal`` on SIGTERM; an error) is
    passed on to the command's whole process group as one SIGINT, the signal every part of it ends cleanly on
    (``dvc`` waits for its stage; a stage reports its flow run crashed, restores its outputs and exits 130) while
    this process logs what they say; after :data:`INTERRUPT_GRACE_S`, or at a second interrupt, what is left of the
    group is killed, so no process of the command outlives this one.
    """
    output = output or CommandOutput()
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        # read1: what has arrived, without waiting for a line's end (a progress bar's frames have none)
        chunks = iter(lambda: proc.stdout.read1(65536), b"")
        try:
            for chunk in chunks:
                output.feed(chunk)
        except BaseException:
            _signal_group(proc.pid, signal.SIGINT)
            deadline = threading.Timer(INTERRUPT_GRACE_S, _signal_group, (proc.pid, signal.SIGKILL))
            deadline.start()
            try:
                for chunk in chunks:  # until the whole group has closed its output: it has ended
                    output.feed(chunk)
            finally:
                deadline.cancel()
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                output.finish()
            raise
        output.finish()
    if proc.returncode != 0:
        tail = "\n".join(output.lines[-25:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return output.lines


PREFECT_LINE = re.compile(r"\d\d:\d\d:\d\d\.\d{3} \| (?P<level>[A-Z]+) *\| (?P<source>.+?) - (?P<message>.*)$")
"""A line of Prefect's console handler (prefect 3.8.8, ``logging/logging.yml``, formatter ``standard``)."""
RUN_SOURCE = re.compile(r"(Flow|Task) run '")
"""The source of a run logger's line (``Flow run 'name'``, ``Task run 'name'``): its process sent it to the API."""
STAGE_DONE = re.compile(r"stage (?P<stage>\S+) done in (?P<seconds>[\d.]+) s(?:: (?P<headline>.*))?$")
"""The last line a stage's flow logs (:func:`run_stage`)."""
DVC_EVENTS = ((re.compile(r"Running stage '(?P<stage>[^']+)':$"), "started"),
              (re.compile(r"Stage '(?P<stage>[^']+)' didn't change, skipping$"), "up to date"),
              (re.compile(r"Stage '(?P<stage>[^']+)' is cached - skipping run"), "restored from DVC's run cache"),
              (re.compile(r"ERROR: failed to reproduce '(?P<stage>[^']+)'"), "failed"),
              (re.compile(r"stage (?P<stage>\S+) interrupted\. (?P<detail>.*)$"), "interrupted"))
"""What ``dvc repro`` (dvc 3.67: ``stage/run.py``, ``stage/__init__.py``, ``stage/cache.py``, ``repo/reproduce.py``)
and a stage's :func:`main` print for each stage event."""
FAILED_TAIL = 5
"""Lines of a failed stage's output the console shows."""

_API_ONLY = logging.getLogger("foresight.command_output")
"""Lines for the Prefect API alone: Prefect's ``APILogHandler`` takes them, the console handler (the root logger's)
never sees them (no propagation)."""
_API_ONLY.propagate = False
_API_ONLY.setLevel(logging.INFO)  # not the root's WARNING, which it would inherit


class PipelineConsole(CommandOutput):
    """The console of ``dvc repro`` under the pipeline flow: one line per stage event, a progress bar while a stage
    runs, and the full output in a log file and the Prefect API instead.

    - Every line goes to ``log_file`` as the stages printed it.
    - The Prefect API (the ``dvc-repro`` task run's log) gets DVC's lines and the stages' other output (warnings,
      tracebacks, libraries' lines), not what a stage's flow logged: that is in its own flow run's log already.
    - The console gets each stage's start, its end (``done in N s`` with its headline figures, :attr:`Stage.headline`,
      up to date, restored, failed with its last :data:`FAILED_TAIL` lines, interrupted), the warnings and errors it
      logged, a link to its flow run where a Prefect UI outlives the run and, on a terminal only, one tqdm
      bar per running stage, moved by the stage's own bars (none where the console is a file: no frames in a CI log).
    """

    def __init__(self, log_file: Path) -> None:
        from prefect.logging.handlers import APILogHandler

        super().__init__()
        if not _API_ONLY.handlers:
            _API_ONLY.addHandler(APILogHandler())
        self._api = logging.LoggerAdapter(_API_ONLY, get_run_logger().extra)  # the run's ids: the task run's log
        self.log_file = log_file
        log_file.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(log_file, "a", buffering=1)  # a log, read while it grows: appended to, line by line
        self._stage: str | None = None
        self._stage_lines: list[str] = []
        self._interrupted: set[str] = set()
        self._bar = None
        self._bars = sys.stdout.isatty()

    def finish(self) -> None:
        super().finish()
        self._close_bar()
        self._file.close()
        self.event(None, f"the stages' full output: {self.log_file}")

    def event(self, stage: str | None, message: str) -> None:
        """One line on the console: the time, the stage, what happened (above the progress bar, if one is drawn)."""
        from tqdm import tqdm

        tqdm.write(f"{time.strftime('%H:%M:%S')}  {f'{stage}: ' if stage else ''}{message}", file=sys.stdout)
        sys.stdout.flush()

    def line(self, line: str) -> None:
        self._file.write(line + "\n")
        self._stage_lines.append(line)
        logged = PREFECT_LINE.match(line)
        if not (logged and RUN_SOURCE.match(logged.group("source"))):
            self._api.info("%s", line)
        for pattern, what in DVC_EVENTS:
            if match := pattern.match(line):
                self._stage_event(match.group("stage"), what, match)
                return
        if not (logged and self._stage):
            return
        message, by_run = logged.group("message"), RUN_SOURCE.match(logged.group("source"))
        if logged.group("level") in ("WARNING", "ERROR", "CRITICAL"):  # a run's logger's, or a library's
            self.event(self._stage, f"{logged.group('level').lower()}: {message}")
        elif by_run and (done := STAGE_DONE.match(message)):
            self._close_bar()
            self.event(done.group("stage"), f"done in {done.group('seconds')} s"
                       + (f"  {done.group('headline')}" if done.group("headline") else ""))
        elif by_run and message.startswith("View at "):  # only where a Prefect UI outlives the run (prefect_api)
            self.event(self._stage, "view at " + message.removeprefix("View at "))

    def _stage_event(self, stage: str, what: str, match: re.Match) -> None:
        self._close_bar()
        if what == "started":
            self._stage, self._stage_lines = stage, []
            self.event(stage, "started")
        elif what == "failed":
            if stage not in self._interrupted:  # DVC calls an interrupted stage failed as well
                tail = "\n".join("    " + line for line in self._stage_lines[-FAILED_TAIL - 1:-1])
                self.event(stage, f"failed (full output: {self.log_file}); its last lines:\n{tail}")
        elif what == "interrupted":
            self._interrupted.add(stage)
            self.event(stage, f"interrupted. {match.group('detail')}")
        else:
            self.event(stage, what)

    def progress(self, frame: re.Match, last: bool) -> None:
        if not self._bars or self._stage is None:
            return
        from tqdm import tqdm

        desc, n, total = f"{self._stage}: {frame.group('desc') or ''}", int(frame.group("n")), int(frame.group("total"))
        if self._bar is None or self._bar.desc != desc or self._bar.total != total or n < self._bar.n:
            self._close_bar()
            self._bar = tqdm(total=total, desc=desc, leave=False, file=sys.stdout, dynamic_ncols=True)
        self._bar.update(n - self._bar.n)
        if last:
            self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


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
    # a training stage killed mid-way resumes from its checkpoints when run again; they go once it succeeds
    with (stage_run(cfg, stage.name, sections, parent_run_id) as run_id,
          training_checkpoints(cfg.path(CHECKPOINTS_DIR) / stage.name)):
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
        # the machine's load over the stage (its timings are only comparable on an otherwise idle machine): the
        # 1-, 5- and 15-minute run-queue averages as it ends (foresight/report.py shows them beside the wall time)
        result.metrics |= dict(zip(("load_average_1min", "load_average_5min", "load_average_15min"), os.getloadavg()))
        tables = {name: read_table(path, name) for name, path in result.tables.items()}
        registered = register_models(cfg, result.models)
        result.metrics |= {f"model_version.{name}": version for name, version in registered.items()}
        attached = {name: path for name, path in result.models.items() if name not in registered}
        log_stage_outputs(cfg, result.metrics, tables, result.artifacts | attached, result.curves, stage.headline)
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
    # the line the pipeline's console shows for the stage (PipelineConsole, STAGE_DONE), with its headline figures
    headline = ", ".join(f"{key}={format(value, '.4g') if isinstance(value, float) else value}"
                         for key in stage.headline if (value := result.metrics.get(key)) is not None)
    get_run_logger().info("stage %s done in %.1f s%s", stage.name, result.metrics["stage_seconds"],
                          f": {headline}" if headline else "")
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


PIPELINE_RUN_ENV = "FORESIGHT_PREFECT_PIPELINE_RUN"
"""``<flow run id>/<task run id>``: the pipeline's Prefect flow run and its ``dvc-repro`` task run, for the stage flows
``dvc repro`` starts (:func:`run_stage_flow`); set by ``flows.pipeline.reproduce_task`` beside the MLflow parent run's
``FORESIGHT_MLFLOW_PARENT_RUN_ID``."""


def prefect_tags(root: Path) -> list[str]:
    """The Prefect tags of every run of this checkout: ``foresight`` and ``checkout:<hash of its path>-<git commit>``
    (runs of several clones on one Prefect server stay apart; the UI filters by tag)."""
    root = root.resolve()
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False)
    checkout = hashlib.sha1(str(root).encode()).hexdigest()[:8]
    return ["foresight", f"checkout:{checkout}" + (f"-{commit.stdout.strip()}" if commit.returncode == 0 else "")]


def run_stage_flow(stage: Stage, params_path: str) -> dict:
    """Run the stage's flow, tagged :func:`prefect_tags` and ``stage:<name>``; under a pipeline run
    (:data:`PIPELINE_RUN_ENV`) as a subflow of its ``dvc-repro`` task run, tagged ``pipeline-run:<id>`` as well.

    Prefect makes a flow called inside another flow's process a subflow by itself. Across processes this does what
    prefect 3.8.8's ``run_deployment`` does for a deployment's run (``deployments/flow_runs.py``): a placeholder task
    run in the parent flow run, whose parent is the calling task run, and a flow run whose ``parent_task_run_id`` is
    that placeholder; the server keeps the placeholder's state in step with the subflow's
    (``server/orchestration/global_policy.py``, ``UpdateSubflowParentTask``), and the UI shows the stage's run inside
    the pipeline's. The checkout is the repository DVC runs the stage for (``DVC_ROOT``: the workspace, also for a
    stage of ``dvc exp run --temp``, which runs in a temporary copy)."""
    from uuid import UUID, uuid4

    from prefect import Task, tags
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import TaskRunResult
    from prefect.flow_engine import run_flow
    from prefect.states import Pending

    stage_flow, parameters = STAGE_FLOWS[stage.name], {"params_path": params_path}
    labels = [*prefect_tags(Path(os.environ.get("DVC_ROOT") or Path(params_path).resolve().parent)),
              f"stage:{stage.name}"]
    if not (parent := os.environ.get(PIPELINE_RUN_ENV)):
        with tags(*labels):
            return stage_flow(**parameters)
    flow_run_id, task_run_id = (UUID(part) for part in parent.split("/"))
    labels.append(f"pipeline-run:{flow_run_id}")
    with get_client(sync_client=True) as client:
        placeholder = client.create_task_run(
            Task(name=stage_flow.name, fn=stage_flow.fn), flow_run_id=flow_run_id, dynamic_key=uuid4().hex,
            name=stage_flow.name, extra_tags=labels, state=Pending(),
            task_inputs={"__parents__": [TaskRunResult(id=task_run_id)]})
        flow_run = client.create_flow_run(stage_flow, parameters=stage_flow.serialize_parameters(parameters),
                                          parent_task_run_id=placeholder.id, state=Pending(), tags=labels)
    return run_flow(stage_flow, flow_run=flow_run, parameters=parameters)


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
        run_stage_flow(next(stage for stage in STAGES if stage.name == argv[0]), params_path)
    except Exception as err:  # the traceback is in the Prefect log; end with the cause, for dvc's output
        sys.exit(f"ERROR: stage {argv[0]} failed: {type(err).__name__}: {err}\n"
                 + restore_outputs(argv[0], Path(params_path).resolve().parent))
    except KeyboardInterrupt:  # Ctrl-C: DVC waits for this process (it ignores SIGINT while a stage runs)
        print(f"stage {argv[0]} interrupted. " + restore_outputs(argv[0], Path(params_path).resolve().parent),
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
