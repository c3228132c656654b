"""The pipeline's console (issue #34, defect 3): ``flows.stages.run_streaming`` reads a command's output as bytes, so a
progress bar's redraws stay frames (never lines of the log), and ``PipelineConsole`` turns what ``dvc repro`` and a
stage print into one console line per stage event while every line goes to the log file. A real subprocess prints
what a stage under ``dvc repro`` prints; ``tests/test_bad_inputs.py`` checks the console of a real ``foresight run``.
"""

from __future__ import annotations

import os
import sys
import textwrap

from prefect import flow, task

from flows.stages import PipelineConsole, run_streaming

# What dvc repro and a stage process print, in the order they print it: DVC's line, a tqdm bar on stderr (redrawn in
# place, a warning printed in the middle of it), the stage flow's own log lines (Prefect's console format), DVC's line.
STAGE = textwrap.dedent("""
    import sys, time, warnings
    from tqdm import tqdm
    print("Running stage 'demo':", flush=True)
    for i in tqdm(range(3), desc="demo step", mininterval=0, file=sys.stderr):
        if i == 1:
            warnings.warn("a library's warning")
        time.sleep(0.05)
    print("12:00:00.000 | WARNING | Task run 'demo-task-1ab' - 2 prompts dropped", flush=True)
    print("12:00:01.000 | INFO    | Flow run 'brave-fox' - stage demo done in 1.5 s: num_train=6, accuracy=0.25",
          flush=True)
    print("Updating lock file 'dvc.lock'", flush=True)
""")


def test_progress_frames_are_no_lines_and_each_stage_event_is_one(prefect_server, tmp_path, capsys):
    log = tmp_path / "logs" / "run.log"

    @task
    def reproduce() -> list[str]:
        return run_streaming([sys.executable, "-c", STAGE], tmp_path, dict(os.environ), "demo",
                             PipelineConsole(log))

    @flow
    def pipeline() -> list[str]:
        return reproduce()

    lines = pipeline()
    console = capsys.readouterr().out.splitlines()
    # every line kept, in the log file too; of the bar only its last frame (its duration), no blank line
    assert log.read_text().splitlines() == lines
    assert lines[0] == "Running stage 'demo':" and lines[-1] == "Updating lock file 'dvc.lock'", lines
    frames = [line for line in lines if "%|" in line]
    assert len(frames) == 1 and frames[0].startswith("demo step: 100%|") and "3/3" in frames[0], lines
    assert any("UserWarning: a library's warning" in line for line in lines) and all(line.strip() for line in lines)
    # the console: the stage's events (its warning, its end with its figures), the log file's name; nothing else
    events = [line.split("  ", 1)[1] for line in console if line[:2].isdigit()]
    assert events == ["demo: started", "demo: warning: 2 prompts dropped",
                      "demo: done in 1.5 s  num_train=6, accuracy=0.25", f"the stages' full output: {log}"], console
