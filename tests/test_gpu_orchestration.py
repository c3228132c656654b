"""Prefect on GPUs (docs/gpu.md): GPU stage tasks retry once after a transient CUDA error and never after running
out of memory; deployments can be put on work pools, the GPU stages on a GPU pool; the launch of a stage's
processes. (The ``gpu`` concurrency limit is exercised by the pipeline run in tests/test_dvc_pipeline.py.)"""

from __future__ import annotations

import sys

import pytest
import torch
from prefect import flow

from flows.pipeline import reproduce_task
from foresight.stages import GPU_TAG
from tasks.common import gpu_task, is_transient_cuda_error
from tests.helpers import make_dvc_repo, subprocess_env, tiny_params


def _flaky(error: Exception, attempts: list[int]):
    """A GPU task failing with ``error`` on its first attempt, succeeding on the next."""
    @gpu_task("flaky")
    def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise error
        return "done"

    return flaky.with_options(retry_delay_seconds=0)


@pytest.mark.parametrize(("error", "retried"), [
    (RuntimeError("CUDA error: unspecified launch failure\nCompile with `TORCH_USE_CUDA_DSA`"), True),
    (RuntimeError("NCCL communicator was aborted on rank 1"), True),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (ValueError("no training prompts"), False),
])
def test_gpu_tasks_retry_once_after_a_transient_cuda_error_only(prefect_server, error, retried):
    attempts: list[int] = []
    task = _flaky(error, attempts)

    @flow
    def run() -> bool:
        return task(return_state=True).is_completed()

    assert run() == retried
    assert len(attempts) == (2 if retried else 1)
    assert is_transient_cuda_error(error) == retried


@pytest.mark.parametrize(("error", "retried"), [
    (RuntimeError("dvc exp run --temp failed (exit 255):\nERROR: unexpected error - 39aa546: the index is locked; "
                  "this might be due to a concurrent or crashed process"), True),
    (RuntimeError("dvc exp run --temp failed (exit 1):\nERROR: failed to reproduce 'train_mtp'"), False),
])
def test_dvc_repro_retries_after_git_index_lock_only(prefect_server, monkeypatch, tmp_path, error, retried):
    """Two ``dvc exp run --temp`` at once can fail on git's index lock before any stage runs (seen once in
    tests/test_gpu_orchestration.py's concurrent deployments): ``dvc-repro`` runs DVC again then, and only then."""
    import flows.pipeline

    calls: list[list[str]] = []

    def run_streaming(command, *args, **kwargs):
        calls.append(command)
        if len(calls) == 1:
            raise error
        return ""

    monkeypatch.setattr(flows.pipeline, "run_streaming", run_streaming)
    repro = reproduce_task.with_options(retry_delay_seconds=0, retry_jitter_factor=None)

    @flow
    def run() -> bool:
        return repro(tmp_path, "parent", [], False, True, return_state=True).is_completed()

    assert run() == retried
    dvc = [command[command.index("--wait-for-lock") + 1:][:3] for command in calls]  # after `python -m dvc …`
    assert dvc == [["exp", "run", "--temp"]] * (2 if retried else 1) + ([["repro"]] if retried else [])  # then restore


def test_only_stage_tasks_take_gpu_slots():
    """``dvc-repro`` waits for the stage tasks: tagged ``gpu`` it would hold the slot they wait for."""
    from flows.stages import STAGE_FLOWS, _task
    from foresight.stages import STAGES

    assert GPU_TAG not in reproduce_task.tags
    gpu_stages = {stage.name for stage in STAGES if GPU_TAG in _task(stage).tags}
    assert gpu_stages == set(STAGE_FLOWS) - {"prepare_policy", "prepare_prompts", "validate"}
    # the stage table's flag (what deployments and the README read) says the same as the tasks' tags
    assert gpu_stages == {stage.name for stage in STAGES if stage.gpu}


def test_deployments_on_work_pools(prefect_server, tmp_path):
    """``foresight deploy``: the pipeline and the GPU stages on the GPU pool (tagged ``gpu``), the rest on the CPU
    pool; every deployment runs this repository's pipeline flow by entrypoint with the given params file, a stage's
    with the stage as its DVC target."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.serve import ROOT
    from flows.cli import main
    from foresight.stages import STAGES

    with get_client(sync_client=True) as client:
        for name in ("test-gpu-pool", "test-cpu-pool"):
            client.create_work_pool(WorkPoolCreate(name=name, type="process"), overwrite=True)
    params = tmp_path / "params.yaml"
    params.write_text("policy:\n  device: cpu\n")
    assert main(["deploy", "--work-pool", "test-gpu-pool", "--cpu-work-pool", "test-cpu-pool",
                 "--params", str(params)]) == 0
    with get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()
                       if d.work_pool_name in ("test-gpu-pool", "test-cpu-pool")}
        assert {client.read_flow(d.flow_id).name for d in deployments.values()} == {"pipeline"}
    cpu_only = {"prepare-policy", "prepare-prompts", "validate"}
    assert sorted(deployments) == sorted(["pipeline", *(stage.flow_name for stage in STAGES)])
    for name, deployment in deployments.items():
        assert deployment.work_pool_name == ("test-cpu-pool" if name in cpu_only else "test-gpu-pool"), name
        assert (GPU_TAG in deployment.tags) == (name not in cpu_only), name
        stage = name.replace("-", "_")
        # push: workers in their own clones share results through the DVC remote
        expected = {"params_path": str(params.resolve()), "push": True}
        if name != "pipeline":  # a stage's deployment: that stage, in a temporary workspace
            expected |= {"targets": [stage], "isolated": True}
        assert deployment.parameters == expected, name
        assert deployment.entrypoint == "flows/pipeline.py:pipeline_flow"
        assert deployment.path == str(ROOT) or str(ROOT) in str(deployment.pull_steps), deployment.pull_steps


def _stop_group(proc) -> None:
    """Stop a process started with ``start_new_session`` and everything it started, by process group."""
    import os
    import signal
    import subprocess

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_workers_run_two_deployments_at_once_through_dvc(prefect_server, tmp_path, tiny_llama):
    """Two real ``prefect worker start`` processes (``--limit 1`` each) on one process work pool, on loopback: the
    ``prepare-prompts`` and ``prepare-policy`` deployments, triggered at once through the API (the UI's Run button),
    run at the same time, so on different workers, each through ``dvc exp run --temp`` in its own temporary
    workspace (prepare_prompts reads the policy's tokenizer, so its workspace runs prepare_policy first); both are
    then recorded in the repository's ``dvc.lock``
    and pushed to the DVC remote with the run cache. A second clone of the repository, sharing only that remote,
    restores the stage from the remote's run cache instead of running it. The workers are stopped by PID."""
    import os
    import subprocess
    import time
    from pathlib import Path

    import yaml
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments import run_deployment

    from flows.cli import main

    repo, remote = tmp_path / "repo", tmp_path / "remote"
    env = subprocess_env(PREFECT_API_URL=prefect_server, PREFECT_WORKER_QUERY_SECONDS="1")
    make_dvc_repo(repo, tiny_params(repo, tiny_llama, prompts={"num_train": 5, "num_eval": 3}), env, remote)
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="worker-test-pool", type="process"), overwrite=True)
    assert main(["deploy", "--work-pool", "worker-test-pool", "--params", str(repo / "params.yaml")]) == 0
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = []
    try:
        for count, log in enumerate(logs, start=1):
            with log.open("wb") as out:
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "prefect", "worker", "start", "--pool", "worker-test-pool", "--limit", "1",
                     "--name", f"worker-{count}"],
                    cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            # one at a time: workers that register at the same moment contend for the test server's sqlite
            with get_client(sync_client=True) as client:
                deadline = time.perf_counter() + 60
                while len(client.read_workers_for_work_pool("worker-test-pool")) < count:
                    assert time.perf_counter() < deadline, log.read_text(errors="replace")[-3000:]
                    time.sleep(0.5)
        started = time.perf_counter()
        names = ["pipeline/prepare-prompts", "pipeline/prepare-policy"]
        ids = [run_deployment(name, timeout=0).id for name in names]  # both scheduled now; neither awaited
        with get_client(sync_client=True) as client:
            while not all((run := client.read_flow_run(i)).state and run.state.is_final() for i in ids):
                assert time.perf_counter() - started < 300, "the runs did not finish in 300 s"
                time.sleep(1)
            runs = [client.read_flow_run(i) for i in ids]
        worker_logs = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
        for name, run in zip(names, runs, strict=True):
            assert run.state.is_completed(), f"{name}: {run.state!r}; worker logs:\n{worker_logs}"
        (first, second), seconds = sorted(runs, key=lambda r: r.start_time), time.perf_counter() - started
        print(f"the two deployments ran in {seconds:.1f} s: {first.start_time:%X}-{first.end_time:%X} and "
              f"{second.start_time:%X}-{second.end_time:%X}")
        # each worker takes one run at a time: runs that overlap ran on different workers
        assert second.start_time < first.end_time, "the two runs did not overlap"
        assert all(worker.poll() is None for worker in workers), "the workers keep polling after a run"
    finally:
        for worker in workers:
            _stop_group(worker)
    assert all(not Path(f"/proc/{worker.pid}").exists() for worker in workers)

    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare_prompts", "prepare_policy"}  # both recorded in the one workspace
    assert len((repo / "data/prompts/train.jsonl").read_text().splitlines()) == 5
    experiments = subprocess.run([sys.executable, "-m", "dvc", "exp", "ls", "--name-only"], cwd=repo, env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
    assert len(experiments) == 2, experiments  # each ran in its own temporary workspace
    assert (remote / "runs").is_dir(), "dvc push --run-cache sent the run cache to the remote"

    # another machine: a clone with the committed (empty) dvc.lock and only the remote in common
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], env=env, check=True)
    result = subprocess.run([sys.executable, "-m", "flows.cli", "run", "prepare_prompts",
                             "--params", str(clone / "params.yaml")], cwd=clone, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "prepare_prompts  up to date" in result.stdout, result.stdout[-2000:]  # restored, not run
    assert (clone / "data/prompts/train.jsonl").read_bytes() == (repo / "data/prompts/train.jsonl").read_bytes()
    assert "prepare_prompts" in yaml.safe_load((clone / "dvc.lock").read_text())["stages"]


def test_launch_command_uses_accelerate(tmp_path):
    """The workers' command line: ``accelerate launch`` of ``flows.stages --worker`` with the configured processes,
    or the user's accelerate config file."""
    from flows.stages import launch_command
    from foresight.config import parse_config
    from foresight.stages import STAGES

    stage = next(s for s in STAGES if s.name == "train_mtp")
    cfg = parse_config({"launch": {"num_processes": 4}})
    command = launch_command(stage, cfg, "params.yaml", {"mtp.epochs": 1}, tmp_path / "result.json")
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[command.index("--num_processes") + 1] == "4" and "--multi_gpu" in command
    assert command[command.index("-m", 3):][:4] == ["-m", "flows.stages", "--worker", "train_mtp"]
    assert command[-2:] == ['{"mtp.epochs": 1}', str(tmp_path / "result.json")]
    (tmp_path / "multi_node.yaml").write_text("distributed_type: MULTI_GPU\nnum_machines: 2\n")  # read at validation
    cfg = parse_config({"launch": {"num_processes": 8, "accelerate_config": str(tmp_path / "multi_node.yaml")}})
    command = launch_command(stage, cfg, "params.yaml", None, tmp_path / "result.json")
    assert (command[command.index("--config_file") + 1] == str(tmp_path / "multi_node.yaml")
            and "--multi_gpu" not in command)
