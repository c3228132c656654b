"""Prefect orchestration end to end: a real ``prefect server``, ``flows.serve`` serving every deployment from a
git + DVC repository, and a stage's run triggered through the API (what the UI's "Run" button does), executed by
the served runner through ``dvc repro``.

Both processes run in their own process group and are killed by PID at teardown, children included.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from foresight.stages import STAGES
from tests.helpers import make_dvc_repo, subprocess_env, tiny_params

DEPLOYMENTS = ["pipeline/pipeline", *(f"pipeline/{stage.flow_name}" for stage in STAGES)]
NUM_TRAIN, NUM_EVAL = 5, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """Start a process in a new session (its own process group), output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process's group, then SIGKILL it if it has not exited within 15 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    except ProcessLookupError:
        pass


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else "(no log)"


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> float:
    """Poll ``GET {url}/health`` until it answers true; returns the seconds it took."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        assert proc.poll() is None, f"prefect server exited ({proc.returncode}):\n{_tail(log)}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200 and json.loads(resp.read()) is True:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"prefect server not healthy after {timeout} s:\n{_tail(log)}")


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """``prefect server start`` on a free port with its own PREFECT_HOME; yields ``(api_url, env)``."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = subprocess_env(PREFECT_HOME=str(home), PREFECT_API_URL=url, PREFECT_RUNNER_POLL_FREQUENCY="1")
    log = home / "server.log"
    proc = _start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port),
                   "--no-ui"], home, env, log)
    try:
        seconds = _wait_healthy(url, proc, log)
        print(f"prefect server healthy after {seconds:.1f} s")
        yield url, env
    finally:
        _stop(proc)


@pytest.fixture
def api_client_settings(prefect_api):
    """Point this process's Prefect client at the test server for the duration of a test."""
    import prefect.settings

    url, _ = prefect_api
    with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL: url}):
        yield url


def _deployments() -> dict[str, object]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {f"{client.read_flow(d.flow_id).name}/{d.name}": d for d in client.read_deployments()}


@pytest.fixture(scope="module")
def served(prefect_api, tmp_path_factory, tiny_llama):
    """``flows.serve.main(params)`` in a subprocess, cwd = a git + DVC repository holding a tiny ``params.yaml``
    (and a local DVC remote). Yields the repository once every deployment is registered.
    """
    import prefect.settings

    url, env = prefect_api
    base = tmp_path_factory.mktemp("served")
    work = base / "repo"
    make_dvc_repo(work, tiny_params(work, tiny_llama, prompts={"num_train": NUM_TRAIN, "num_eval": NUM_EVAL}), env,
                  base / "remote")
    log = base / "serve.log"
    code = "import sys; from pathlib import Path; from flows.serve import main; main(Path(sys.argv[1]))"
    proc = _start([sys.executable, "-c", code, str(work / "params.yaml")], work, env, log)
    try:
        started = time.perf_counter()
        with prefect.settings.temporary_settings(updates={prefect.settings.PREFECT_API_URL: url}):
            while len(_deployments()) < len(DEPLOYMENTS):
                assert proc.poll() is None, f"serve exited ({proc.returncode}):\n{_tail(log)}"
                assert time.perf_counter() - started < 120, f"deployments not registered in 120 s:\n{_tail(log)}"
                time.sleep(0.5)
        print(f"serve registered its deployments after {time.perf_counter() - started:.1f} s")
        yield work, proc, log
    finally:
        _stop(proc)


def test_every_stage_has_a_deployment(served, api_client_settings):
    work = served[0]
    deployments = _deployments()
    assert sorted(deployments) == sorted(DEPLOYMENTS)
    for name, deployment in deployments.items():
        stage = name.split("/")[1].replace("-", "_")
        expected = {"params_path": str(work / "params.yaml")}
        if stage != "pipeline":  # a stage's deployment: that stage, in a temporary workspace
            expected |= {"targets": [stage], "isolated": True}
        assert deployment.parameters == expected, name
        assert "foresight" in deployment.tags
        assert deployment.description  # shown in the UI


def test_a_stage_triggered_through_the_api_runs_through_dvc(served, api_client_settings):
    """The ``prepare-prompts`` deployment runs ``dvc repro prepare_prompts`` (its flow run is the pipeline's;
    DVC runs the stage's own flow, which reports to the same server): ``dvc.lock`` records it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.deployments import run_deployment

    work, proc, log = served
    started = time.perf_counter()
    flow_run = run_deployment("pipeline/prepare-prompts", poll_interval=1, timeout=240)
    seconds = time.perf_counter() - started
    print(f"prepare-prompts deployment run: {seconds:.1f} s from trigger to final state")
    assert flow_run.state is not None and flow_run.state.is_completed(), (
        f"state {flow_run.state!r} after {seconds:.0f} s; serve log:\n{_tail(log)}")
    assert flow_run.parameters == {"params_path": str(work / "params.yaml"), "targets": ["prepare_prompts"],
                                   "isolated": True}

    # the run wrote into the repository of the deployment's params file, through DVC
    train = (work / "data/prompts/train.jsonl").read_text().splitlines()
    held_out = (work / "data/prompts/eval.jsonl").read_text().splitlines()
    assert len(train) == NUM_TRAIN and len(held_out) == NUM_EVAL
    assert all(json.loads(line)["question"] for line in train)
    metrics = json.loads((work / "data/metrics/prepare_prompts.json").read_text())
    assert metrics["num_train"] == NUM_TRAIN and metrics["num_eval"] == NUM_EVAL
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"prepare_policy", "prepare_prompts"}  # prompts are counted in the policy's tokens

    with get_client(sync_client=True) as client:
        summaries = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["prepare-prompts-summary"])))
        flow = client.read_flow(flow_run.flow_id)
    assert any("Stage `prepare_prompts`" in a.data and f"| num_train | {NUM_TRAIN} |" in a.data for a in summaries)
    assert flow.name == "pipeline"
    assert proc.poll() is None, "the serve process must keep serving after a run"
