"""The DVC pipeline for real: a temporary git + DVC repository, the tiny model, a temporary Prefect API.

One module-scoped run of ``flows.pipeline.pipeline_flow`` (parent MLflow run → ``dvc repro`` → every
stage's flow in its own process → artifacts → ``dvc push``) pays the cost of the stage processes once;
the tests then check its outputs, that a second ``dvc repro`` does nothing, that changing one param
re-runs exactly the stages downstream of it, and ``dvc metrics show``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

import foresight.stages
from tests.helpers import make_dvc_repo, subprocess_env, tiny_params

STAGES = [stage.name for stage in foresight.stages.STAGES]  # every stage's run checks its declared reads
NUM_TRAIN, NUM_SAMPLES = 6, 3
RUNNING = re.compile(r"Running stage '([^']+)'")


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 300) -> str:
    """Run a command; fail the test with its output when it fails; return stdout + stderr."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-4000:]}"
    return out


def _dvc(*args: str, repo: Path, env: dict) -> str:
    return _run([sys.executable, "-m", "dvc", *args], repo, env)


def _ran(output: str) -> list[str]:
    return [m.group(1) for line in output.splitlines() if (m := RUNNING.search(line))]


@pytest.fixture(scope="module")
def dvc_repo(tmp_path_factory, tiny_llama, tiny_armorm, prefect_server):
    """A committed git + DVC repo with this project's code, ``dvc.yaml`` and a tiny ``params.yaml``.

    Yields ``(repo, remote, env)``: ``env`` is what subprocesses get (the temporary Prefect API, so stage
    flows report to it instead of starting their own server; the venv first on PATH, so the stages'
    ``python`` is this interpreter).
    """
    base = tmp_path_factory.mktemp("dvc")
    repo, remote = base / "repo", base / "remote"
    # A random tiny policy rarely states a right answer, so score with a reward model: the tiny ArmoRM-layout
    # checkpoint, loaded natively (real key names, gating, transform). Its scores differ between samples, which
    # gives every prompt a spread and the validate stage its pairs; it is also the RL reward of train_mtp_rl.
    params = tiny_params(repo, tiny_llama,
                         prompts={"num_train": NUM_TRAIN}, generate={"num_samples": NUM_SAMPLES},
                         label={"labeler": "armorm", "model": str(tiny_armorm), "device": "cpu", "batch_size": 4},
                         validate={"min_response_chars": 0},
                         tracking={"large_file_mb": 0.05})  # the tiny policies' weights (60-120 kB) are large
    # MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL: every second (default 10), for the tiny stages to have some
    env = subprocess_env(PREFECT_API_URL=prefect_server, MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1")
    make_dvc_repo(repo, params, env, remote)
    yield repo, remote, env


def _limit_gpu_tasks(slots: int) -> None:
    """The GPU recipe of docs/gpu.md on the test server: at most ``slots`` ``gpu``-tagged task runs at once."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="gpu", concurrency_limit=slots)


@pytest.fixture(scope="module")
def pipeline_result(dvc_repo):
    """``pipeline_flow`` run in this process (inside the Prefect test harness), from the repo folder, under a
    ``gpu`` concurrency limit of 1: a task that waits for the stages while holding the slot (``dvc-repro`` once
    did) would deadlock it, and the run would never finish."""
    from flows.pipeline import pipeline_flow

    _limit_gpu_tasks(1)
    repo, _, env = dvc_repo
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)  # MLflow puts a new experiment's artifacts under the working directory
        # the venv off PATH, as `.venv/bin/foresight` finds it: the flow must put its interpreter first for the
        # stages' `python` (the system's has no prefect)
        mp.setenv("PATH", os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                          if Path(p) != Path(sys.executable).parent))
        mp.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", env["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"])
        started = time.perf_counter()
        state = pipeline_flow(params_path=str(repo / "params.yaml"), push=True, return_state=True)
        assert state.is_completed(), state
        result = dict(state.result(), wall_seconds=time.perf_counter() - started,
                      flow_run_id=state.state_details.flow_run_id)
    print(f"pipeline_flow (all stages, push): {result['wall_seconds']:.1f} s")
    return result


def _read_artifacts(key: str, flow_run_id=None):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    flow_run = ArtifactFilterFlowRunId(any_=[flow_run_id]) if flow_run_id else None
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]),
                                                                    flow_run_id=flow_run))


def _stage_runs(repo: Path, parent_run_id: str) -> dict:
    """The MLflow runs nested under the pipeline's parent run, by ``foresight.stage`` tag."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    assert experiment is not None
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    by_stage = {r.data.tags["foresight.stage"]: r for r in children}
    assert len(by_stage) == len(children), [r.data.tags for r in children]
    return by_stage


def test_pipeline_flow_runs_every_stage_and_pushes(dvc_repo, pipeline_result, tiny_armorm):
    import pandas as pd

    repo, remote, _ = dvc_repo
    assert pipeline_result["ran"] == STAGES
    assert [row["stage"] for row in pipeline_result["stages"]] == STAGES
    assert all(row["status"] == "ran" for row in pipeline_result["stages"])

    samples = pd.read_parquet(repo / "data/samples/samples.parquet")
    assert len(samples) == NUM_TRAIN * NUM_SAMPLES
    scores = pd.read_parquet(repo / "data/labels/scores.parquet")
    assert len(scores) == len(samples) and scores["score"].notna().all() and (scores["labeler"] == "armorm").all()
    assert scores["score"].nunique() == len(scores)  # continuous reward-model scores, one per sample
    assert {len(r) for r in scores["objective_rewards"]} == {5}  # the tiny ArmoRM's objectives behind each score
    pairs = pd.read_parquet(repo / "data/pairs/pairs.parquet")
    assert (pairs["chosen_score"] > pairs["rejected_score"]).all()
    # every (higher, lower) pair of a prompt's samples (validate.pairing: all), one of them its best–worst pair
    per_prompt = pairs.groupby("prompt_id")
    assert 1 <= per_prompt.ngroups <= NUM_TRAIN
    assert (per_prompt.size() <= NUM_SAMPLES * (NUM_SAMPLES - 1) // 2).all()
    assert (per_prompt["best_worst"].sum() == 1).all()
    assert (repo / "data/reports/datadocs").is_dir()
    for stage in STAGES:
        assert (repo / f"data/metrics/{stage}.json").is_file(), stage

    # SLA's win rates are by ArmoRM score: the benchmark's scores are the native labeler's, and win rates follow them
    from foresight.benchmark import win_tie_loss
    from models.labeling.config import LabelerSpec
    from models.labeling.labelers import build_labeler

    outputs = pd.read_parquet(repo / "data/benchmarks/sla/outputs.parquet")
    armorm = build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_armorm), device="cpu", dtype="float32"))
    some = outputs.head(6)
    assert armorm.score(some["question"].tolist(), some["response"].tolist(), [None] * 6) == pytest.approx(
        some["score"].tolist(), abs=1e-4)
    table = pd.read_csv(repo / "data/benchmarks/sla/table.csv")
    sla_row = table[(table["policy"] == "base") & (table["decoder"] == "sla") & (table["versus"] == "base+greedy")]
    base = outputs[outputs["policy"] == "base"].pivot(index="prompt_index", columns="decoder", values="score")
    assert sla_row["win_rate"].item() == pytest.approx(win_tie_loss(base["sla"].tolist(), base["greedy"].tolist())["win_rate"])

    # Medusa: supervised heads, one RL head set per init, and a benchmark whose greedy-verified decoders
    # reproduce HF greedy on every prompt
    for folder in ("supervised", "rl/base", "rl/supervised"):
        assert (repo / "data/medusa" / folder / "heads.safetensors").is_file(), folder
    speed = pd.read_csv(repo / "data/benchmarks/medusa/table.csv")
    # each prompt set (the task's held-out prompts, the general instructions) with every decoder
    assert speed["prompt_set"].unique().tolist() == ["held_out", "general"]
    for _, prompt_set in speed.groupby("prompt_set"):
        medusa = ["medusa_supervised", "medusa_rl_base", "medusa_rl_supervised"]
        # batch 1 on the timed prompts, then each Medusa decoder batched over the whole set
        assert prompt_set["decoder"].tolist() == ["greedy", "prompt_lookup", *medusa, *(f"{m}_batched" for m in medusa)]
    assert (speed["identical_to_greedy"] == 1.0).all()
    assert (repo / "data/coral/config.json").is_file() and (repo / "data/coral/loss.png").is_file()
    coral = pd.read_csv(repo / "data/benchmarks/coral/table.csv")
    assert coral["decoder"].tolist() == ["next_token", "coral", "coral_no_verifier", "coral_no_multi_forward",
                                         "coral_no_verifier_b3", "coral_no_verifier_kf2"]
    assert coral["accuracy"].between(0, 1).all() and (coral["tokens_per_forward"] > 0).all()

    # MTP: the equipped module with its depth ablation, then every GRPO variant with per-step τ and rollout time
    assert (repo / "data/mtp/module/mtp.safetensors").is_file() and (repo / "data/mtp/ablation.png").is_file()
    assert pd.read_csv(repo / "data/mtp/ablation.csv")["num_depths"].tolist() == [1, 2]
    mtp_rl = pd.read_csv(repo / "data/mtp_rl/table.csv")
    assert mtp_rl["variant"].tolist() == ["vanilla", "mtp_rl", "frozen_mtp", "ce_only", "no_backprop"]
    assert (mtp_rl["total_rollout_seconds"] > 0).all()
    # the RL reward is the configured labeler's: ArmoRM scores, not 0/1 answers
    assert mtp_rl["reward_mean"].map(lambda r: r not in (0.0, 1.0)).all() and mtp_rl["reward_after"].notna().all()
    for plot in ("tau.png", "rollout_seconds.png"):
        assert (repo / "data/mtp_rl" / plot).is_file(), plot

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert sorted(lock["stages"]) == sorted(STAGES)
    assert lock["stages"]["generate"]["params"]["params.yaml"]["generate"]["seed"] == 0

    # dvc push copied every cached output into the remote (content-addressed under files/md5)
    pushed = [p for p in (remote / "files" / "md5").rglob("*") if p.is_file()]
    assert len(pushed) >= len(STAGES) * 2, pushed  # each stage: at least one output + its metrics file
    samples_md5 = next(o["md5"] for o in lock["stages"]["generate"]["outs"] if o["path"].endswith("samples.parquet"))
    assert (remote / "files" / "md5" / samples_md5[:2] / samples_md5[2:]).is_file()


def test_pipeline_mlflow_runs_nest_under_one_parent(dvc_repo, pipeline_result):
    from mlflow.tracking import MlflowClient

    repo, _, _ = dvc_repo
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    assert experiment is not None
    parents = client.search_runs([experiment.experiment_id], "tags.`foresight.kind` = 'pipeline'")
    assert [r.info.run_id for r in parents] == [pipeline_result["mlflow_run_id"]]
    assert parents[0].info.status == "FINISHED"
    assert parents[0].data.params["generate.seed"] == "0"

    by_stage = _stage_runs(repo, pipeline_result["mlflow_run_id"])
    assert sorted(by_stage) == sorted(STAGES)
    assert all(r.info.status == "FINISHED" for r in by_stage.values())
    assert by_stage["generate"].data.metrics["num_samples"] == NUM_TRAIN * NUM_SAMPLES
    assert by_stage["validate"].data.metrics["num_pairs"] >= 1
    # COrAL's training curves: one point per step for every forward offset (the tiny model's greedy responses
    # repeat one token, so corruption changes nothing there: reconstruction curves are tested in test_coral.py)
    coral_run = by_stage["train_coral"].info.run_id
    steps = {key: [m.step for m in client.get_metric_history(coral_run, key)]
             for key in ("ce_forward_1", "ce_forward_4", "loss")}
    assert steps["ce_forward_1"] == steps["ce_forward_4"] == steps["loss"] == list(range(1, len(steps["loss"]) + 1))
    assert len(steps["loss"]) >= 2  # stage 1 and stage 2
    # GRPO: per-step τ and rollout time of every variant as metric histories
    rl_run = by_stage["train_mtp_rl"].info.run_id
    for key in ("mtp_rl.per_step.tau", "frozen_mtp.per_step.tau", "vanilla.per_step.rollout_seconds",
                "mtp_rl.per_step.rollout_seconds"):
        assert [m.step for m in client.get_metric_history(rl_run, key)] == [1], key


def test_pipeline_registers_models_and_puts_the_headlines_on_the_parent_run(dvc_repo, pipeline_result):
    """The reusable artifacts are registered model versions linked to their stage's run (and their files come
    back from the registry); the parent run carries every stage's headline figures with their intervals, and
    every run the git commit it ran."""
    import mlflow
    from mlflow.tracking import MlflowClient

    repo, _, _ = dvc_repo
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    by_stage = _stage_runs(repo, pipeline_result["mlflow_run_id"])
    registered = {"reward-channel": "train_reward", "reward-channel-dpo": "train_reward_dpo",
                  "medusa-heads": "train_medusa", "mtp-module": "train_mtp", "dpo-policy": "dpo"}
    for name, stage in registered.items():
        versions = client.search_model_versions(f"name = 'test-{name}'")
        assert len(versions) == 1, name
        assert versions[0].run_id == by_stage[stage].info.run_id, name
        assert by_stage[stage].data.metrics[f"model_version.{name}"] == float(versions[0].version)
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlflow.db'}")
    heads = Path(mlflow.artifacts.download_artifacts("models:/test-medusa-heads/1"))
    assert (heads / "heads.safetensors").read_bytes() == (repo / "data/medusa/supervised/heads.safetensors").read_bytes()
    # weights over tracking.large_file_mb stay in DVC: the DPO policy's version is its manifest (the folder's hash
    # as dvc.lock records it) and its small files, and its weights are stored once, data/ linked to DVC's cache
    dpo_out = next(o for o in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["dpo"]["outs"]
                   if o["path"] == "data/dpo")
    policy = Path(mlflow.artifacts.download_artifacts("models:/test-dpo-policy/1"))
    manifest = json.loads((policy / "dvc-manifest.json").read_text())
    assert (manifest["path"], manifest["md5"], manifest["nfiles"]) == ("data/dpo", dpo_out["md5"], dpo_out["nfiles"])
    assert (policy / "config.json").is_file() and not (policy / "model.safetensors").exists()
    assert not list((repo / "mlruns").rglob("model.safetensors"))  # neither the DPO policy nor COrAL's model
    weights = next(f for f in manifest["files"] if f["relpath"] == "model.safetensors")
    cached = repo / ".dvc/cache/files/md5" / weights["md5"][:2] / weights["md5"][2:]
    assert os.path.samefile(repo / "data/dpo/model.safetensors", cached)

    parent = client.get_run(pipeline_result["mlflow_run_id"])
    reward = json.loads((repo / "data/metrics/train_reward.json").read_text())
    for key in ("autrc_channel", "autrc_channel_low", "autrc_channel_high"):
        assert parent.data.metrics[f"train_reward.{key}"] == pytest.approx(reward[key])
    assert "benchmark_medusa.held_out.medusa_supervised.speedup_vs_reference_low" in parent.data.metrics
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    for run in [parent, *by_stage.values()]:
        assert run.data.tags["foresight.git_commit"].startswith(commit)
    # system metrics (sampled every second here: every stage that ran long enough has some)
    assert any(key.startswith("system/cpu_utilization_percentage") for key in by_stage["train_coral"].data.metrics)


def test_pipeline_prefect_artifacts(dvc_repo, pipeline_result):
    flow_run_id = pipeline_result["flow_run_id"]
    table = _read_artifacts("pipeline-stages", flow_run_id)
    assert len(table) == 1 and table[0].type == "table"
    rows = table[0].data if isinstance(table[0].data, list) else json.loads(table[0].data)
    assert [row["stage"] for row in rows] == STAGES and {row["status"] for row in rows} == {"ran"}
    summary = _read_artifacts("pipeline-summary", flow_run_id)
    assert len(summary) == 1 and summary[0].type == "markdown"
    assert pipeline_result["mlflow_run_id"] in summary[0].data
    # the claims table: every claim judged on the stage metrics the run wrote, in the report, MLflow and Prefect
    from foresight.claims import CLAIMS, read_claims

    claims = read_claims(dvc_repo[0] / "data/reports")
    assert claims == pipeline_result["claims"] and len(claims) == len(CLAIMS)
    assert {row["verdict"] for row in claims} <= {"holds", "does not hold", "undecided", "not measured"}
    assert all(row["reason"] for row in claims if row["verdict"] != "holds")
    (claims_artifact,) = _read_artifacts("pipeline-claims", flow_run_id)
    assert claims_artifact.data == (dvc_repo[0] / "data/reports/claims.md").read_text()
    # the benchmark's Table 1 as a table artifact: every (policy, decoder) row plus DPO+SLA vs DPO greedy
    (benchmark,) = _read_artifacts("sla-benchmark")
    rows = benchmark.data if isinstance(benchmark.data, list) else json.loads(benchmark.data)
    decoders = {(row["policy"], row["decoder"], row["versus"]) for row in rows}
    assert ("base", "sla", "base+greedy") in decoders and ("dpo", "sla", "dpo+greedy") in decoders
    # cells as the report writes them: "value [low, high]" (+ " *" when significant)
    for row in rows:
        value, low, high = (float(x) for x in re.fullmatch(r"(\S+) \[(\S+), (\S+)\]( \*)?", row["win_rate"]).groups()[:3])
        assert 0.0 <= low <= value <= high <= 1.0
    # The stage flows ran in dvc's subprocesses and reported to the same Prefect API: each stage's
    # summary names the MLflow run that is nested under this pipeline's parent run.
    for stage, run in _stage_runs(dvc_repo[0], pipeline_result["mlflow_run_id"]).items():
        artifacts = _read_artifacts(f"{stage.replace('_', '-')}-summary")
        assert any(f"Stage `{stage}`" in a.data and run.info.run_id in a.data for a in artifacts), stage


def test_stage_flow_runs_are_tagged_subflows_of_the_pipeline_run(dvc_repo, pipeline_result):
    """Issue #34, defect 6: every stage's flow run (in its own process, started by DVC) is a subflow of the pipeline
    run's ``dvc-repro`` task run (a placeholder task run in the pipeline's flow run, as Prefect makes for a subflow),
    tagged ``foresight``, ``stage:<name>``, the checkout's tag and ``pipeline-run:<id>``; the pipeline run carries
    the first and the checkout's tag."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, TaskRunFilter, TaskRunFilterFlowRunId

    pipeline_id = pipeline_result["flow_run_id"]
    with get_client(sync_client=True) as client:
        pipeline = client.read_flow_run(pipeline_id)
        stage_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[f"pipeline-run:{pipeline_id}"])))
        placeholders = {run.id: client.read_task_run(run.parent_task_run_id) for run in stage_runs
                        if run.parent_task_run_id}
        task_runs = client.read_task_runs(task_run_filter=TaskRunFilter(
            flow_run_id=TaskRunFilterFlowRunId(any_=[pipeline_id])))
    (checkout,) = [tag for tag in pipeline.tags if tag.startswith("checkout:")]  # path hash - git commit
    assert "foresight" in pipeline.tags and re.fullmatch(r"checkout:[0-9a-f]{8}-[0-9a-f]{7,}", checkout), pipeline.tags
    (repro,) = [run for run in task_runs if run.name.startswith("dvc-repro")]
    by_stage = {tag.removeprefix("stage:"): run for run in stage_runs for tag in run.tags if tag.startswith("stage:")}
    assert len(stage_runs) == len(STAGES) and sorted(by_stage) == sorted(STAGES), [run.tags for run in stage_runs]
    for stage, run in by_stage.items():
        assert {"foresight", checkout} <= set(run.tags) and run.state.is_completed(), (stage, run.tags, run.state)
        placeholder = placeholders[run.id]  # the subflow's task run in the pipeline's flow run, under dvc-repro
        assert placeholder.flow_run_id == pipeline.id and placeholder.state.is_completed(), (stage, placeholder)
        assert [parent.id for parent in placeholder.task_inputs["__parents__"]] == [repro.id], stage


def test_dvc_metrics_show_lists_every_stage(dvc_repo, pipeline_result):
    repo, _, env = dvc_repo
    shown = json.loads(_dvc("metrics", "show", "--json", repo=repo, env=env))
    assert len(shown) == 1, shown  # the workspace only (keyed "" when dvc.yaml is at the repo root)
    files = next(iter(shown.values()))["data"]
    for stage in STAGES:
        assert f"data/metrics/{stage}.json" in files, (stage, sorted(files))
        assert "stage_seconds" in files[f"data/metrics/{stage}.json"]["data"]
    assert files["data/metrics/generate.json"]["data"]["num_samples"] == NUM_TRAIN * NUM_SAMPLES
    assert files["data/metrics/prepare_prompts.json"]["data"]["num_train"] == NUM_TRAIN
    table = _dvc("metrics", "show", repo=repo, env=env)
    assert all(f"data/metrics/{stage}.json" in table for stage in STAGES), table


def test_pipeline_report_reaches_mlflow_and_prefect(dvc_repo, pipeline_result):
    """The run ends with the results report: on disk, as the parent run's artifacts (with every plot) and
    description (the headline table), and as a Prefect artifact; it links the parent run and every stage's run."""
    from mlflow.tracking import MlflowClient

    repo, run_id = dvc_repo[0], pipeline_result["mlflow_run_id"]
    page, twin = (repo / "data/reports/report.html").read_text(), (repo / "data/reports/report.md").read_text()
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    assert client.get_run(run_id).data.tags["mlflow.note.content"].count("\n| ") >= 5  # the headline rows

    def files(path: str) -> list[str]:
        return [f for entry in client.list_artifacts(run_id, path)
                for f in (files(entry.path) if entry.is_dir else [entry.path])]

    logged = files("report")
    assert {"report/report.html", "report/report.md"} <= set(logged)
    plots = sorted(p.relative_to(repo).as_posix() for p in (repo / "data").rglob("*.png")
                   if not p.is_relative_to(repo / "data/reports"))  # but the Data Docs' logos
    assert plots and sorted(p.removeprefix("report/plots/") for p in logged if p.endswith(".png")) == plots
    assert page.count("data:image/png;base64,") == len(plots)
    assert f"/runs/{run_id}" in page and all(f"/runs/{run.info.run_id}" in page
                                             for run in _stage_runs(repo, run_id).values())
    (artifact,) = _read_artifacts("pipeline-report", pipeline_result["flow_run_id"])
    assert artifact.data == twin


def test_second_repro_is_a_noop(dvc_repo, pipeline_result):
    repo, _, env = dvc_repo
    out = _dvc("repro", repo=repo, env=env)
    assert _ran(out) == [], out
    assert "up to date" in out, out


def test_changed_param_reruns_only_downstream_stages(dvc_repo, pipeline_result):
    """``reward.epochs`` is read by both reward trainings; the benchmark uses their heads; DPO reads only
    ``reward.eval_fraction`` / ``reward.seed`` and the data stages none of it: exactly three stages re-run."""
    repo, _, env = dvc_repo
    params_file = repo / "params.yaml"
    params = yaml.safe_load(params_file.read_text())
    params["reward"]["epochs"] += 1
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    before = {stage: (repo / f"data/metrics/{stage}.json").read_text() for stage in STAGES}
    rerun = ["train_reward", "train_reward_dpo", "benchmark_sla"]

    out = _dvc("repro", repo=repo, env=env)
    assert _ran(out) == rerun, out
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert lock["stages"]["train_reward"]["params"]["params.yaml"]["reward"]["epochs"] == params["reward"]["epochs"]
    # the other stages' outputs were not rewritten; the re-run stages' were
    for stage in STAGES:
        changed = (repo / f"data/metrics/{stage}.json").read_text() != before[stage]
        assert changed == (stage in rerun), stage
    assert "Data and pipelines are up to date" in _dvc("status", repo=repo, env=env)

    # run by the dvc CLI, not by the pipeline flow: the new stage runs are top-level MLflow runs
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    runs = client.search_runs([experiment.experiment_id], "tags.`foresight.stage` = 'train_reward'")
    top_level = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 2 and len(top_level) == 1
    assert top_level[0].data.params["reward.epochs"] == str(params["reward"]["epochs"])


def test_failing_stage_names_the_problem_and_keeps_earlier_outputs(dvc_repo, pipeline_result):
    """A missing reward model: ``dvc repro`` fails with a message naming it; no output is lost or half-written. DVC
    removed the failed stage's output before running it (outputs are cached, not ``persist``); the stage brought
    back the last good version from the DVC cache, byte for byte, and says so."""
    repo, _, env = dvc_repo
    params_path = repo / "params.yaml"
    original = params_path.read_text()
    kept = {p: (repo / p).read_bytes() for p in
            ("data/labels/scores.parquet", "data/pairs/pairs.parquet", "data/samples/samples.parquet")}
    params = yaml.safe_load(original)
    params["label"]["model"] = str(repo / "no-such-reward-model")
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out
        assert _ran(out) == ["label"], out  # validate never ran on the failed stage's output
        assert "ERROR: stage label failed" in out and "no-such-reward-model" in out, out[-3000:]
        assert "were restored from the DVC cache (dvc checkout label)" in out, out[-3000:]
        for path, content in kept.items():
            assert (repo / path).read_bytes() == content, f"{path} changed after a failed run"
    finally:
        params_path.write_text(original)
    assert _ran(_dvc("repro", repo=repo, env=env)) == [], "restoring the params must make everything up to date"


def test_training_stage_runs_in_two_processes(dvc_repo, pipeline_result):
    """``launch.num_processes: 2``: every training stage is out of date (``launch`` is their param), and a stage run
    by DVC trains under ``accelerate launch`` in 2 processes (gloo on this CPU), its bookkeeping done once."""
    repo, _, env = dvc_repo
    params_path = repo / "params.yaml"
    original = params_path.read_text()
    params = yaml.safe_load(original)
    params["launch"]["num_processes"] = 2
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        status = _dvc("status", repo=repo, env=env)
        distributed = {stage.name for stage in foresight.stages.STAGES if stage.distributed}
        changed = {name.rstrip(":") for name in re.findall(r"^(\w+):", status, re.MULTILINE)}
        assert changed == distributed, status
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("test")

        def stage_runs():
            return client.search_runs([experiment.experiment_id], "tags.`foresight.stage` = 'train_reward'",
                                      order_by=["attributes.start_time DESC"])

        runs_before = len(stage_runs())
        before = (repo / "data/reward/base/channel").stat().st_mtime_ns
        out = _dvc("repro", "-s", "train_reward", repo=repo, env=env)
        assert _ran(out) == ["train_reward"], out
        metrics = json.loads((repo / "data/metrics/train_reward.json").read_text())
        assert metrics["num_processes"] == 2
        assert "pair_accuracy_channel" in metrics
        assert (repo / "data/reward/base/channel").stat().st_mtime_ns != before  # written anew
        runs = stage_runs()
        assert len(runs) == runs_before + 1  # one MLflow run for the stage, not one per process
        assert runs[0].data.metrics["num_processes"] == 2
    finally:
        params_path.write_text(original)


def test_experiments_share_one_store_and_a_reverted_param_restores_from_the_run_cache(dvc_repo, pipeline_result):
    """``dvc exp run --temp -S generate.seed=1 generate`` samples in a temporary copy of the repository; its MLflow
    run lands in the repository's store, tagged with the experiment's name. The same change in the workspace is
    then restored from DVC's run cache without a run, and so is going back to seed 0: the first samples, byte for
    byte (outputs are cached, not ``persist``)."""
    from mlflow.tracking import MlflowClient

    repo, _, env = dvc_repo
    params_path = repo / "params.yaml"
    original = params_path.read_text()
    samples = repo / "data/samples/samples.parquet"
    first = samples.read_bytes()
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")

    def generate_runs() -> list:
        return client.search_runs([experiment.experiment_id], "tags.`foresight.stage` = 'generate'",
                                  order_by=["attributes.start_time DESC"])

    cached = "Stage 'generate' is cached - skipping run, checking out outputs"
    try:
        runs = len(generate_runs())
        out = _dvc("exp", "run", "--temp", "-n", "seed-one", "-S", "generate.seed=1", "generate", repo=repo, env=env)
        assert _ran(out) == ["generate"], out
        assert samples.read_bytes() == first  # the workspace is untouched by a --temp experiment
        latest = generate_runs()
        assert len(latest) == runs + 1, "the temporary copy's run must land in the repository's store"
        assert latest[0].data.tags["foresight.dvc_experiment"] == "seed-one"
        assert latest[0].data.params["generate.seed"] == "1"

        out = _dvc("exp", "run", "-S", "generate.seed=1", "generate", repo=repo, env=env)
        assert _ran(out) == [] and cached in out, out
        seed_one = samples.read_bytes()
        assert seed_one != first

        out = _dvc("exp", "run", "-S", "generate.seed=0", "generate", repo=repo, env=env)
        assert _ran(out) == [] and cached in out, out
        assert samples.read_bytes() == first and len(generate_runs()) == runs + 1
    finally:
        params_path.write_text(original)
        _dvc("checkout", repo=repo, env=env)
    assert _ran(_dvc("repro", repo=repo, env=env)) == []


def test_training_curves_are_dvc_plots(dvc_repo, pipeline_result):
    """Each training stage's curves are CSVs (step, value) under data/metrics/curves/<stage>/, declared as the
    stage's plots: ``dvc plots show`` renders them and ``dvc plots diff`` compares them between experiments."""
    repo, _, env = dvc_repo
    curve_stages = [stage.name for stage in foresight.stages.STAGES if stage.curves]
    assert {"train_reward", "train_medusa", "train_mtp_rl"} <= set(curve_stages)
    for stage in curve_stages:
        files = sorted((repo / "data/metrics/curves" / stage).glob("*.csv"))
        assert files, stage
        for file in files:
            table = pd.read_csv(file)
            assert list(table.columns) == ["step", "value"] and len(table) > 0, file
            assert table["step"].is_monotonic_increasing and table["value"].notna().all(), file
    loss = pd.read_csv(repo / "data/metrics/curves/train_medusa/loss.csv")
    history = json.loads((repo / "data/medusa/supervised/history.json").read_text())
    assert loss["value"].tolist() == pytest.approx(history["loss"])
    shown = json.loads(_dvc("plots", "show", "--json", repo=repo, env=env))
    rendered = json.dumps(shown)
    for stage in curve_stages:
        assert f"data/metrics/curves/{stage}/" in rendered, stage
