"""Ctrl-C on ``foresight run`` (issue #32, item 5): it stops within seconds, says so, marks its Prefect flow runs
crashed or cancelled, keeps what finished stages wrote and leaves no process behind.

Without ``PREFECT_API_URL`` the run needs a temporary Prefect API; the terminal's SIGINT goes to its whole
foreground process group, so the test sends SIGINT to the run's process group, as a terminal does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers import make_dvc_repo, subprocess_env, tiny_params

INTERRUPT_BOUND_S = 30  # measured 4-5 s on a loaded 2-core CPU; the old code took minutes (its API died with it)


def _processes_with(marker: str) -> list[str]:
    """Command lines of the live (not zombie) processes whose environment contains ``marker`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_bytes().rsplit(b") ", 1)[-1][:1]  # "pid (comm) S ...": S is the state
            if state != b"Z" and marker.encode() in (entry / "environ").read_bytes():
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone, or not ours
            continue
    return found


def test_ctrl_c_stops_promptly_marks_runs_and_keeps_outputs(tmp_path, tiny_llama):
    repo, home = tmp_path / "repo", tmp_path / "prefect-home"
    # generation long enough to be interrupted in the middle (batch 1: many short steps): 48 prompts, ~100 s
    # uninterrupted on an idle 2-core CPU (6 prompts, 13 s, could end before the interrupt reached it)
    params = tiny_params(repo, tiny_llama, prompts={"num_train": 48, "num_eval": 2},
                         generate={"num_samples": 16, "max_new_tokens": 192, "batch_size": 1})
    # no Prefect API named (foresight starts a temporary one) and its own PREFECT_HOME: the temporary API's database,
    # read below, and a marker to find its processes by
    env = subprocess_env(PREFECT_HOME=str(home))
    make_dvc_repo(repo, params, env)

    # SIGINT at its default, as in a terminal's foreground job: a process that inherits it ignored (pytest-xdist's
    # workers ignore it; so does a shell for its background jobs) keeps it ignored, Python included
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "generate"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def full_output() -> str:
        """The stages' output: the console shows one line per stage event, the run's log file holds the rest."""
        return "".join(log.read_text() for log in sorted((repo / "logs").glob("*.log")))

    try:
        deadline = time.monotonic() + 300
        # tasks/generate.py: the generate stage's sampling loop has begun
        while "sampling " not in full_output() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert "sampling " in full_output(), "generate never started:\n" + "".join(lines[-40:])
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
        sent = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):  # asserted below, with its output
            proc.wait(timeout=INTERRUPT_BOUND_S)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
    output = "".join(lines)
    print(f"Ctrl-C to exit: {elapsed:.1f} s (exit {proc.returncode})\n{output[-3000:]}")
    assert elapsed < INTERRUPT_BOUND_S, output[-3000:]
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output.splitlines()[-1], output[-3000:]
    assert "ConnectError" not in output + full_output() and "Connection refused" not in output + full_output()
    assert "View at" not in output + full_output()  # no link to the temporary API: it is gone now

    # no process of this run is left (the stage process, dvc, the temporary Prefect API)
    deadline = time.monotonic() + 5
    while (left := _processes_with(f"PREFECT_HOME={home}\0")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left

    # the flow runs ended crashed or cancelled in the temporary API's database, none left running
    with sqlite3.connect(home / "prefect.db") as db:
        runs = db.execute("SELECT flow.name, flow_run.state_type FROM flow_run JOIN flow ON flow.id = flow_run.flow_id"
                          ).fetchall()
    states = dict(runs)
    assert set(states) >= {"pipeline", "generate"}, runs
    assert states["pipeline"] in ("CRASHED", "CANCELLED") and states["generate"] in ("CRASHED", "CANCELLED"), runs
    assert not [run for run in runs if run[1] in ("RUNNING", "PENDING")], runs

    # what the finished stages wrote stays
    assert (repo / "data/policy").is_dir() and any((repo / "data/policy").iterdir())
    assert (repo / "data/prompts/train.jsonl").is_file()
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "prepare_policy", "prepare_prompts"], cwd=repo,
                            env=env, capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout + status.stderr

    # and a run that finishes, through a temporary API of its own, ends cleanly: nothing is sent after it stops
    started = time.monotonic()
    rerun = subprocess.run([sys.executable, "-m", "flows.cli", "run", "prepare_prompts"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=300)
    print(f"an up-to-date `foresight run prepare_prompts`: {time.monotonic() - started:.1f} s")
    output = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, output[-3000:]
    assert "Unable to connect" not in output and "ConnectError" not in output, output[-3000:]
    assert not _processes_with(f"PREFECT_HOME={home}\0")
    with sqlite3.connect(home / "prefect.db") as db:
        finished = db.execute("SELECT flow_run.state_type FROM flow_run JOIN flow ON flow.id = flow_run.flow_id "
                              "WHERE flow.name = 'pipeline' ORDER BY flow_run.created DESC LIMIT 1").fetchone()
    assert finished == ("COMPLETED",)
