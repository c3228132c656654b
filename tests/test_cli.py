"""The command line: ``--params`` anywhere, stage names checked, a ``run --params`` study refused before anything
runs when its values cannot run (its run as a DVC experiment: tests/test_bad_inputs.py, in that file's DVC
repository), and ``foresight ui`` for real (both servers up on loopback, both gone after SIGTERM)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.cli import main
from tests.helpers import REPO, subprocess_env



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_params_go_before_or_after_the_command(tmp_path, capsys):
    params = tmp_path / "study.yaml"
    params.write_text("generate:\n  seed: 7\n")
    for argv in (["--params", str(params), "check"], ["check", "--params", str(params)]):
        assert main(argv) == 0
        assert '"seed": 7' in capsys.readouterr().out


def test_run_names_an_unknown_stage_and_lists_the_real_ones(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("{}\n")
    assert main(["run", "train_medusa", "no_such_stage", "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "no stage no_such_stage" in err and "train_medusa" in err and "benchmark_sla" in err


def test_ui_serves_mlflow_and_prefect_on_loopback_and_stops_both(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(f"tracking:\n  mlflow_uri: sqlite:///{tmp_path / 'mlflow.db'}\n")
    mlflow_port, prefect_port = _free_port(), _free_port()
    env = subprocess_env(PREFECT_HOME=str(tmp_path / "prefect"))
    log = tmp_path / "ui.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--params", str(params),
                                 "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = time.monotonic()
        while "Ctrl-C stops both" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() - started < 150, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        printed = log.read_text(errors="replace")
        assert f"MLflow UI: http://127.0.0.1:{mlflow_port}" in printed
        assert f"Prefect UI: http://127.0.0.1:{prefect_port}" in printed
        # the experiment's runs, in the UI's model-training view (not the GenAI traces it opens on by default)
        assert re.search(rf"MLflow runs: http://127.0.0.1:{mlflow_port}/#/experiments/\d+/runs\?workflowType="
                         "machine_learning", printed), printed
        with urllib.request.urlopen(f"http://127.0.0.1:{mlflow_port}/health", timeout=5) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/api/health", timeout=5) as response:
            assert response.read() == b"true"
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False)
        servers = {int(pid) for pid in children.stdout.split()}
        assert len(servers) == 2, "the two servers run as children of foresight ui"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    for pid in servers:  # stopped with it, and reaped
        assert not Path(f"/proc/{pid}").exists(), pid
    for url in (f"http://127.0.0.1:{mlflow_port}/health", f"http://127.0.0.1:{prefect_port}/api/health"):
        with pytest.raises(OSError):
            urllib.request.urlopen(url, timeout=2)


def test_run_params_refuses_a_study_before_anything_runs(tmp_path, monkeypatch, capsys):
    """``foresight run --params FILE`` validates FILE's values on the project's params.yaml first: a key
    params.yaml lacks, a bad value, a value DVC's --set-param cannot carry, no DVC project here — each fails
    with the key named and the pipeline never starts."""
    import flows.pipeline

    started = []
    monkeypatch.setattr(flows.pipeline, "pipeline_flow", lambda **kwargs: started.append(kwargs))
    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    (project / "params.yaml").write_text("prompts:\n  num_train: 6\n  instruction: null\n")
    monkeypatch.chdir(project)
    study = tmp_path / "study.yaml"
    for text, named in (("generate:\n  seed: 3\n", "generate is not a key of"),
                        ("prompts:\n  num_trian: 4\n", "prompts.num_trian is not a key of"),
                        ("prompts:\n  num_train: many\n", "prompts.num_train"),
                        ("prompts:\n  instruction: 'say ${x}'\n", "interpolation")):
        study.write_text(text)
        assert main(["run", "prepare_prompts", "--params", str(study)]) == 2
        assert named in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no DVC project
    study.write_text("prompts:\n  num_train: 4\n")
    assert main(["run", "prepare_prompts", "--params", str(study)]) == 2
    assert "not inside of a DVC repository" in capsys.readouterr().err
    assert started == []
