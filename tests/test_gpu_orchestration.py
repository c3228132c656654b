"""Prefect on GPUs (docs/gpu.md): GPU stage tasks retry once after a transient CUDA error and never after running
out of memory; deployments can be put on work pools, the GPU stages on a GPU pool; the launch of a stage's
processes. (The ``gpu`` concurrency limit is exercised by the pipeline run in tests/test_dvc_pipeline.py.)"""

from __future__ import annotations

import sys

import pytest
import torch
from prefect import flow

from flows.pipeline import reproduce_task
from tasks.data import GPU_TAG, gpu_task, is_transient_cuda_error


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


def test_only_stage_tasks_take_gpu_slots():
    """``dvc-repro`` waits for the stage tasks: tagged ``gpu`` it would hold the slot they wait for."""
    from flows.stages import STAGE_FLOWS, _task
    from foresight.stages import STAGES

    assert GPU_TAG not in reproduce_task.tags
    gpu_stages = {stage.name for stage in STAGES if GPU_TAG in _task(stage).tags}
    assert gpu_stages == set(STAGE_FLOWS) - {"prepare_policy", "prepare_prompts", "validate"}


def test_deployments_on_work_pools(prefect_server, tmp_path):
    """``foresight deploy``: the pipeline and the GPU stages on the GPU pool (tagged ``gpu``), the rest on the CPU
    pool, each running this repository's flow by entrypoint with the given params file."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.serve import ROOT
    from foresight.cli import main

    with get_client(sync_client=True) as client:
        for name in ("test-gpu-pool", "test-cpu-pool"):
            client.create_work_pool(WorkPoolCreate(name=name, type="process"), overwrite=True)
    params = tmp_path / "params.yaml"
    params.write_text("policy:\n  device: cpu\n")
    assert main(["--params", str(params), "deploy", "--work-pool", "test-gpu-pool",
                 "--cpu-work-pool", "test-cpu-pool"]) == 0
    with get_client(sync_client=True) as client:
        deployments = {client.read_flow(d.flow_id).name: d for d in client.read_deployments()
                       if d.work_pool_name in ("test-gpu-pool", "test-cpu-pool")}
    cpu_only = {"prepare-policy", "prepare-prompts", "validate"}
    assert "pipeline" in deployments and "train-dpo" not in deployments and "dpo" in deployments
    for name, deployment in deployments.items():
        assert deployment.work_pool_name == ("test-cpu-pool" if name in cpu_only else "test-gpu-pool"), name
        assert (GPU_TAG in deployment.tags) == (name not in cpu_only), name
        assert deployment.parameters == {"params_path": str(params.resolve())}
        assert deployment.path == str(ROOT) or str(ROOT) in str(deployment.pull_steps), deployment.pull_steps
    assert deployments["train-mtp-rl"].entrypoint == "flows/stages.py:train_mtp_rl_flow"


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
    cfg = parse_config({"launch": {"num_processes": 8, "accelerate_config": str(tmp_path / "fsdp.yaml")}})
    command = launch_command(stage, cfg, "params.yaml", None, tmp_path / "result.json")
    assert command[command.index("--config_file") + 1] == str(tmp_path / "fsdp.yaml") and "--multi_gpu" not in command
