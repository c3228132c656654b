"""The whole pipeline as one Prefect flow: ``dvc repro`` under one parent MLflow run.

DVC decides what is stale (params, code and data hashes in ``dvc.lock``) and runs each stale
stage's flow (``flows.stages``) in its own process; this flow opens the parent MLflow run that those
stage runs nest under, streams their output into the Prefect log, collects every stage's metrics into
a table artifact and a markdown summary, judges each paper's central claims on them (``foresight/claims.py``:
``data/reports/claims.md``, an MLflow artifact and a Prefect artifact), and, when asked (``push``), pushes the
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
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.stages import metrics_path, run_streaming
from foresight.claims import claims_markdown, claims_table, write_claims
from foresight.config import Config, load_config
from foresight.stages import STAGES, sync_dvc_yaml
from foresight.tracking import PARENT_RUN_ENV, headline_metrics, pipeline_run


def _prefect_api_url() -> str | None:
    """URL of the Prefect API this process talks to (also the temporary server's, when one was started)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return str(client.api_url).rstrip("/") or None


def _ran_stages(lines: list[str]) -> list[str]:
    """The stages DVC ran (not restored from its run cache), from its output."""
    return [m.group(1) for line in lines if (m := re.match(r"Running stage '([^']+)'", line))]


@task(name="dvc-repro", cache_policy=NO_CACHE)
def reproduce_task(root: Path, parent_run_id: str, targets: list[str], force: bool, isolated: bool = False
                   ) -> list[str]:
    """``dvc repro`` the stale stages (in a temporary workspace when ``isolated``); returns the stages that ran.

    Not tagged ``gpu``: it waits for the stage tasks that are, and under a ``gpu`` concurrency limit of 1 it
    would hold the only slot they wait for (a deadlock). The stage tasks themselves take the slots.
    """
    # TQDM_MININTERVAL: progress bars redraw every 10 s instead of flooding the log with lines;
    # PYTHONUNBUFFERED: stage output reaches the Prefect log as it happens, not in late blocks;
    # PATH: dvc.yaml's commands run `python`, which must be this interpreter (the project's venv) however the flow
    # was started: `make` puts the venv on PATH, `.venv/bin/foresight` or a deployment's worker need not.
    env = dict(os.environ, **{PARENT_RUN_ENV: parent_run_id, "TQDM_MININTERVAL": "10", "PYTHONUNBUFFERED": "1",
                              "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])})
    api_url = _prefect_api_url()
    if api_url:  # stage processes report to the same Prefect server instead of starting their own
        env["PREFECT_API_URL"] = api_url
    dvc, force_flag = [sys.executable, "-m", "dvc", "--wait-for-lock"], ["--force"] if force else []
    if not isolated:
        return _ran_stages(run_streaming([*dvc, "repro", "--pull", *targets, *force_flag], root, env, "dvc repro"))
    ran = _ran_stages(run_streaming([*dvc, "exp", "run", "--temp", "--pull", *targets, *force_flag], root, env,
                                    "dvc exp run --temp"))
    restored = run_streaming([*dvc, "repro", *targets], root, env, "dvc repro (run cache)")
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
                  push: bool = False, isolated: bool = False) -> dict:
    """Reproduce the DVC pipeline (all stages, or ``targets`` and what they depend on).

    ``force`` re-runs stages even when DVC finds them up to date; ``push`` sends the outputs (and the run cache)
    to the default DVC remote afterwards (off by default: see the module's docstring); ``isolated`` runs the stages
    in a temporary copy of the workspace, so that runs of independent branches started at once (on several
    workers) do not contend for DVC's lock.
    """
    cfg = load_config(params_path)  # fail on malformed params before anything runs
    root = Path(params_path).resolve().parent
    if resynced := sync_dvc_yaml(cfg):
        get_run_logger().info("dvc.yaml rewritten: params.yaml names other local files for %s", ", ".join(resynced))
    with pipeline_run(cfg, "pipeline" if not targets else f"pipeline: {' '.join(targets)}") as run_id:
        ran = reproduce_task(root, run_id, targets or [], force, isolated)
        every = stage_metrics(cfg)
        rows = stage_table(every, ran, stale_stages(root))
        claims = claims_table(every)
        claims_path = write_claims(claims, cfg.path(cfg.paths.reports_dir))
        import mlflow

        mlflow.log_dict({"stages": rows}, "pipeline_stages.json")
        mlflow.log_artifact(str(claims_path))  # claims.md: the paper's figure, ours, the verdict, the reason
        mlflow.log_dict({"claims": claims}, "claims.json")
        mlflow.log_metrics({f"{r['stage']}.seconds": r["seconds"] for r in rows if r["status"] == "ran"})
        # every stage's headline figures (with their intervals) on the parent run: one row per pipeline run
        mlflow.log_metrics(headline_metrics(every, {stage.name: stage.headline for stage in STAGES}))
    create_table_artifact(key="pipeline-stages", table=rows, description="Stages of this pipeline run")
    create_markdown_artifact(key="pipeline-summary", markdown=_markdown(rows, run_id, cfg),
                             description="Pipeline run summary")
    create_markdown_artifact(key="pipeline-claims", markdown=claims_path.read_text(),
                             description="Each paper's central claims at this scale: holds / does not hold, and why")
    if push:
        push_task(root)
    logger = get_run_logger()
    logger.info("claims (%s):\n%s", claims_path, claims_markdown(claims))
    logger.info("pipeline done: %s ran", ", ".join(ran) or "nothing (all stages up to date)")
    return {"mlflow_run_id": run_id, "ran": ran, "stages": rows, "claims": claims}
