"""The whole pipeline as one Prefect flow: ``dvc repro`` under one parent MLflow run.

DVC decides what is stale (params, code and data hashes in ``dvc.lock``) and runs each stale
stage's flow (``flows.stages``) in its own process; this flow opens the parent MLflow run that those
stage runs nest under (their Prefect flow runs are subflows of its ``dvc-repro`` task run), shows one console line
per stage event while their full output goes to a log file (:data:`LOG_DIR`) and the Prefect API, collects every
stage's metrics into a table artifact and a markdown summary, judges each paper's central claims on them (``foresight/claims.py``:
``data/reports/claims.md``, an MLflow artifact and a Prefect artifact), writes the results report
(``foresight/report.py``: ``data/reports/report.html`` and ``report.md``, logged to the parent run with its plots, its
headline table the run's description, and a Prefect artifact), and, when asked (``push``), pushes the
versioned data and the run cache to the DVC remote. Not by default: the default remote is a folder inside the
checkout, and a push there stores every output a second time (32 GB more for the 8B policies) for no machine but
this one, whose DVC cache already restores every stage it ran; a fleet of workers sharing a remote (``foresight
deploy``) pushes.

Independent branches of the DAG at once, on several workers (docs/gpu.md, "Prefect on GPUs"): DVC releases its
lock while a stage's command runs, but two runs in one workspace whose targets share a stale ancestor would both
run it, into the same output paths. So an ``isolated`` run reproduces its stages in a temporary copy of the
workspace (``dvc exp run --temp``, DVC's own executor, sharing the workspace's cache) and the workspace then takes
the results from DVC's run cache (``dvc repro`` again, which finds every stage "cached - skipping run" and only
checks the outputs out and records them in ``dvc.lock``). Every run waits for DVC's lock rather than failing
after DVC's default 3 s when another run holds it for its bookkeeping. Across
machines the same run cache travels through the DVC remote: runs pull missing data and run-cache entries
(``--pull``) and push theirs (``dvc push --run-cache``; ``foresight deploy``'s deployments do), so a worker in its
own clone restores what another worker computed instead of computing it again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run
from prefect.settings import PREFECT_UI_URL

from flows.stages import PIPELINE_RUN_ENV, PipelineConsole, metrics_path, prefect_tags, run_streaming
from foresight.claims import claims_markdown, claims_table, write_claims
from foresight.config import Config, ConfigError, load_config
from foresight.report import write_report
from foresight.stages import STAGES, retry_when, sync_dvc_yaml
from foresight.tracking import (PARENT_RUN_ENV, flatten, headline_metrics, interval_table, log_interval_table,
                                pipeline_run)


LOG_DIR = "logs"
"""Where each pipeline run keeps the full output of ``dvc repro`` and its stages (``<time>-<flow run>.log``, in the
checkout: gitignored, no DVC output); its console shows one line per stage event (``flows.stages.PipelineConsole``)."""


def tag_flow_run(root: Path) -> None:
    """Add the checkout's tags (:func:`flows.stages.prefect_tags`) to this flow run's (a deployment's run has some)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        tags = client.read_flow_run(flow_run.id).tags
        client.update_flow_run(flow_run.id, tags=sorted({*tags, *prefect_tags(root)}))


def _prefect_api_url() -> str | None:
    """URL of the Prefect API this process talks to (also the temporary server's, when one was started)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return str(client.api_url).rstrip("/") or None


def _ran_stages(lines: list[str]) -> list[str]:
    """The stages DVC ran (not restored from its run cache), from its output."""
    return [m.group(1) for line in lines if (m := re.match(r"Running stage '([^']+)'", line))]


def set_param_args(overrides: dict[str, Any]) -> list[str]:
    """``dvc exp run --set-param`` values (``key=value``) setting the dotted params keys of ``overrides``.

    DVC parses each value with Hydra's override grammar (dvc/utils/hydra.py ``apply_overrides``), so a value is
    written the way Hydra writes one back (``Override._get_value_element_as_str``: ``null``, ``[1,2]``, ``{k:v}``),
    every string quoted (unquoted, ``1``, ``true`` or ``null`` would change type). DVC then resolves the file
    through OmegaConf, which would read ``${...}`` in a string as an interpolation: such a value is refused.
    """
    from hydra.core.override_parser.types import Override, Quote, QuotedString

    def quoted(value: Any) -> Any:
        if isinstance(value, str):
            if "${" in value:
                raise ConfigError(f"--params: the value of a key contains '${{', which DVC's --set-param reads as an "
                                  f"OmegaConf interpolation: {value!r}; edit params.yaml itself for this value")
            return QuotedString(text=value, quote=Quote.single)
        if isinstance(value, list):
            return [quoted(item) for item in value]
        if isinstance(value, dict):
            return {key: quoted(item) for key, item in value.items()}
        return value

    return [f"{key}={Override._get_value_element_as_str(quoted(value))}" for key, value in overrides.items()]


GIT_INDEX_LOCKED = "the index is locked"
"""What DVC reports when another git operation holds the repository's index: two ``dvc exp run --temp`` started at
once (two deployments triggered together) race for it while each copies the workspace into its temporary one."""


def is_git_index_locked(error: BaseException) -> bool:
    """Whether ``error`` is a DVC run that failed on git's index lock (:data:`GIT_INDEX_LOCKED`), worth a retry."""
    return isinstance(error, RuntimeError) and GIT_INDEX_LOCKED in str(error)


@task(name="dvc-repro", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[3, 10], retry_jitter_factor=1.0,
      retry_condition_fn=retry_when(is_git_index_locked))
def reproduce_task(root: Path, parent_run_id: str, targets: list[str], force: bool, isolated: bool = False,
                   set_params: list[str] | None = None) -> list[str]:
    """``dvc repro`` the stale stages (in a temporary workspace when ``isolated``); returns the stages that ran.

    ``set_params`` (:func:`set_param_args`): run them as DVC's experiment instead (``dvc exp run --set-param``),
    which writes the values into params.yaml before the stages run, so params.yaml, ``dvc.lock`` and the outputs
    agree afterwards, and records the experiment (``dvc exp show``).

    Not tagged ``gpu``: it waits for the stage tasks that are, and under a ``gpu`` concurrency limit of 1 it
    would hold the only slot they wait for (a deadlock). The stage tasks themselves take the slots. Retried (twice,
    after 3 and 10 s, jittered) only when DVC failed on git's index lock (:func:`is_git_index_locked`): seen in one
    fresh-clone test run, where tests/test_gpu_orchestration.py triggers two deployments at once, before any stage
    ran.
    """
    # PIPELINE_RUN_ENV: each stage's flow run becomes a subflow of this task run (flows.stages.run_stage_flow);
    # TQDM_MININTERVAL: a stage's progress bars redraw every second where the console draws them (a terminal), else
    # every 10 s (their frames are dropped: flows.stages.PipelineConsole);
    # PYTHONUNBUFFERED: stage output reaches the log as it happens, not in late blocks;
    # PATH: dvc.yaml's commands run `python`, which must be this interpreter (the project's venv) however the flow
    # was started: `make` puts the venv on PATH, `.venv/bin/foresight` or a deployment's worker need not.
    env = dict(os.environ, **{PARENT_RUN_ENV: parent_run_id, PIPELINE_RUN_ENV: f"{flow_run.id}/{task_run.id}",
                              "TQDM_MININTERVAL": "1" if sys.stdout.isatty() else "10", "PYTHONUNBUFFERED": "1",
                              "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])})
    api_url = _prefect_api_url()
    if api_url:  # stage processes report to the same Prefect server instead of starting their own
        env["PREFECT_API_URL"] = api_url
        # and link to their runs only where this process does: not for a temporary API (foresight.prefect_api)
        env["PREFECT_UI_URL"] = PREFECT_UI_URL.value() or ""
    log = root / LOG_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{flow_run.name}.log"
    dvc, force_flag = [sys.executable, "-m", "dvc", "--wait-for-lock"], ["--force"] if force else []
    sets = [arg for value in set_params or [] for arg in ("--set-param", value)]
    # in the workspace: dvc repro, or with params to set, dvc exp run (the same reproduction, after the set)
    here, what = ([*dvc, "exp", "run", *sets], "dvc exp run") if sets else ([*dvc, "repro"], "dvc repro")
    if not isolated:
        return _ran_stages(run_streaming([*here, "--pull", *targets, *force_flag], root, env, what,
                                         PipelineConsole(log)))
    ran = _ran_stages(run_streaming([*dvc, "exp", "run", "--temp", *sets, "--pull", *targets, *force_flag], root,
                                    env, "dvc exp run --temp", PipelineConsole(log)))
    # the same params set here too (params.yaml takes them, dvc.lock records the stages under them)
    restored = run_streaming([*here, *targets], root, env, f"{what} (run cache)", PipelineConsole(log))
    if again := _ran_stages(restored):  # the run cache lacked them (a stage DVC cannot cache): they ran twice
        get_run_logger().warning("the run cache did not restore %s: they ran again in the workspace",
                                 ", ".join(again))
    return ran


@task(name="dvc-push", retries=1, cache_policy=NO_CACHE)
def push_task(root: Path) -> None:
    """Copy the versioned outputs and the run cache to the default DVC remote (another machine's runs restore
    these stages from it instead of running them)."""
    run_streaming([sys.executable, "-m", "dvc", "push", "--run-cache"], root, dict(os.environ), "dvc push")


def stage_metrics(cfg: Config) -> dict[str, dict]:
    """Every stage's metrics file (``{}`` for a stage that has not run)."""
    return {stage.name: json.loads(path.read_text()) if (path := metrics_path(cfg, stage.name)).is_file() else {}
            for stage in STAGES}


def stale_stages(root: Path) -> set[str]:
    """The stages ``dvc status`` finds out of date (changed deps, params or outputs, or never run)."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"dvc status failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return set(json.loads(proc.stdout or "{}"))


def stage_table(every: dict[str, dict], ran: list[str], stale: set[str]) -> list[dict]:
    """One row per stage, in pipeline order, from ``every`` stage's metrics (:func:`stage_metrics`): whether it ran
    now, is up to date or is ``stale`` (``dvc status``: its metrics are those of an older run, or none), its wall
    time and headline metrics."""
    rows = []
    for stage in STAGES:
        metrics = every[stage.name]
        status = "ran" if stage.name in ran else "stale" if stage.name in stale else "up to date"
        row = {"stage": stage.name, "status": status,
               "seconds": round(metrics.get("stage_seconds", float("nan")), 1)}
        for key in stage.headline:
            if key in metrics:  # an optional part (MTP's depth ablation, say) may be switched off
                value = metrics[key]
                row[key] = round(value, 3) if isinstance(value, float) else value
        rows.append(row)
    return rows


def _markdown(rows: list[dict], run_id: str, cfg: Config) -> str:
    lines = [f"# Foresight pipeline\n\nMLflow parent run `{run_id}` in `{cfg.mlflow_uri()}`\n",
             "| stage | status | seconds | metrics |", "|---|---|---|---|"]
    for row in rows:
        extra = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("stage", "status", "seconds"))
        lines.append(f"| {row['stage']} | {row['status']} | {row['seconds']} | {extra} |")
    lines.append(f"\nData Docs: `{cfg.path(cfg.paths.reports_dir) / 'datadocs' / 'index.html'}`")
    return "\n".join(lines)


@flow(name="pipeline", log_prints=True)
def pipeline_flow(params_path: str = "params.yaml", targets: list[str] | None = None, force: bool = False,
                  push: bool = False, isolated: bool = False, overrides: dict[str, Any] | None = None) -> dict:
    """Reproduce the DVC pipeline (all stages, or ``targets`` and what they depend on).

    ``force`` re-runs stages even when DVC finds them up to date; ``push`` sends the outputs (and the run cache)
    to the default DVC remote afterwards (off by default: see the module's docstring); ``isolated`` runs the stages
    in a temporary copy of the workspace, so that runs of independent branches started at once (on several
    workers) do not contend for DVC's lock. ``overrides`` (dotted params keys → values; ``foresight run --params
    FILE``, :func:`foresight.params.study_overrides`) are set on params.yaml by DVC's experiment run before the
    stages run; the parent MLflow run logs params.yaml with them, the values the stages read.
    """
    # fail on malformed params before anything runs
    cfg, set_params = load_config(params_path, overrides), set_param_args(overrides or {})
    root = Path(params_path).resolve().parent
    tag_flow_run(root)  # the stages' flow runs carry these tags too, and this run's id (flows.stages.run_stage_flow)
    if resynced := sync_dvc_yaml(cfg):
        get_run_logger().info("dvc.yaml rewritten: params.yaml names other local files for %s", ", ".join(resynced))
    with pipeline_run(cfg, "pipeline" if not targets else f"pipeline: {' '.join(targets)}") as run_id:
        ran = reproduce_task(root, run_id, targets or [], force, isolated, set_params)
        if set_params:  # the params logged above are those DVC wrote into params.yaml, which the stages read
            logged = flatten(cfg.model_dump(mode="json", by_alias=True))
            ran_with = flatten(load_config(params_path).model_dump(mode="json", by_alias=True))
            if changed := sorted(k for k in logged.keys() | ran_with.keys() if logged.get(k) != ran_with.get(k)):
                raise RuntimeError(f"params.yaml after dvc exp run differs from the params logged to MLflow: "
                                   f"{', '.join(changed)}")
        every = stage_metrics(cfg)
        rows = stage_table(every, ran, stale_stages(root))
        claims = claims_table(every)
        claims_path = write_claims(claims, cfg.path(cfg.paths.reports_dir))
        import mlflow

        mlflow.log_dict({"stages": rows}, "pipeline_stages.json")
        mlflow.log_artifact(str(claims_path))  # claims.md: the paper's figure, ours, the verdict, the reason
        mlflow.log_dict({"claims": claims}, "claims.json")
        mlflow.log_metrics({f"{r['stage']}.seconds": r["seconds"] for r in rows if r["status"] == "ran"})
        headlines = {stage.name: stage.headline for stage in STAGES}
        # every stage's headline figures (with their intervals) on the parent run: one row per pipeline run
        mlflow.log_metrics(headline_metrics(every, headlines))
        # the same figures as one row each, value [low, high] (headline.json): the flat metrics are three columns
        log_interval_table(interval_table(every, headlines))
        # the results report (foresight/report.py) with its plots, and its headline table as the run's description
        report_html, report_md, report = write_report(cfg, every)
        mlflow.log_artifact(str(report_html), "report")
        mlflow.log_artifact(str(report_md), "report")
        for paths in report.plots.values():
            for path in paths:  # under their folders' paths in the checkout (two stages write a loss.png each)
                folder = path.resolve().parent
                mlflow.log_artifact(str(path), "report/plots/" + (folder.relative_to(root).as_posix()
                                                                  if folder.is_relative_to(root) else folder.name))
        mlflow.set_tag("mlflow.note.content", report.headline_markdown())
    create_table_artifact(key="pipeline-stages", table=rows, description="Stages of this pipeline run")
    create_markdown_artifact(key="pipeline-summary", markdown=_markdown(rows, run_id, cfg),
                             description="Pipeline run summary")
    create_markdown_artifact(key="pipeline-claims", markdown=claims_path.read_text(),
                             description="Each paper's central claims at this scale: holds / does not hold, and why")
    create_markdown_artifact(key="pipeline-report", markdown=report_md.read_text(),
                             description=f"The results report (the page with its plots embedded: {report_html})")
    if push:
        push_task(root)
    logger = get_run_logger()
    logger.info("claims (%s):\n%s", claims_path, claims_markdown(claims))
    logger.info("pipeline done: %s ran", ", ".join(ran) or "nothing (all stages up to date)")
    return {"mlflow_run_id": run_id, "ran": ran, "stages": rows, "claims": claims, "report": str(report_html)}
