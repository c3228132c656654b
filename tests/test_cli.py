"""The command line: ``--params`` anywhere, stage names checked, and ``foresight ui`` for real (both servers up on
loopback, both gone after SIGTERM)."""

from __future__ import annotations

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


def test_pipeline_refuses_a_params_file_its_stages_would_not_read(tmp_path, capsys):
    """``dvc repro``'s stages read params.yaml: a preset given to ``pipeline``/``run`` must be copied there, not
    planned from one file and run from another (``plan``/``check`` take it as it is)."""
    preset = Path(__file__).resolve().parents[1] / "configs" / "llama3-8b.yaml"
    assert main(["pipeline", "--params", str(preset)]) == 2
    assert main(["run", "generate", "--params", str(preset)]) == 2
    assert f"cp {preset} params.yaml" in capsys.readouterr().err
