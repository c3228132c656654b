"""Bad input, as a new user gives it: one table of cases, each run the way the README offers (``foresight run`` or
plain ``dvc repro``) in a real git + DVC repository whose first stages have run. Each case asserts that the message
names the problem and that the outputs that existed before are intact afterwards (byte for byte) — or, for an input
that is not an error (an over-long prompt, a prompt file edited in place), what the stage did with it.

DVC removes a stage's outputs before it runs it; a stage that fails brings them back from the DVC cache
(``flows.stages.restore_outputs``), so a mistyped model path no longer costs the policy folder. Interrupts (Ctrl-C)
have their own test, ``tests/test_interrupt.py``. A params file given with ``--params`` runs its values as a DVC
experiment in the same repository (refused before anything runs when they cannot: ``tests/test_cli.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.helpers import make_dvc_repo, subprocess_env, tiny_params

ROWS = [{"prompt": f"Ben has {i} apples and finds {i + 1} more. How many apples does Ben have now?",
         "answer": str(2 * i + 1)} for i in range(1, 13)]
DVC_FAILED = 255  # dvc's exit code when a stage's command fails
STAGES_RUN = ("prepare_policy", "prepare_prompts")
PROTECTED = ("data/policy", "data/prompts")
LONG = "Ben has 4 apples. Ava gives Ben 2 more apples. " * 60 + "How many apples does Ben have now?"


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _run(cmd: list[str], repo: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def _foresight(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def _dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def _snapshot(repo: Path) -> dict[str, str]:
    """Every file under the protected outputs, by content."""
    return {str(file.relative_to(repo)): hashlib.sha256(file.read_bytes()).hexdigest()
            for folder in PROTECTED for file in sorted((repo / folder).rglob("*")) if file.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_llama, prefect_server):
    """A committed git + DVC repository reading its prompts from ``prompts.jsonl``, with ``prepare_policy`` and
    ``prepare_prompts`` run (``foresight run prepare_prompts``) and their outputs committed (``dvc.lock``); yields
    ``(repo, env, run)``: ``run`` the finished ``foresight run`` (its console: stdout, stderr)."""
    repo = tmp_path_factory.mktemp("bad-inputs") / "repo"
    repo.mkdir()
    _write_rows(repo / "prompts.jsonl", ROWS)
    params = tiny_params(repo, tiny_llama, prompts={
        "source": "file", "file": {"path": "prompts.jsonl", "text_column": "prompt", "answer_column": "answer"},
        "num_train": 6, "num_eval": 2})
    env = subprocess_env(PREFECT_API_URL=prefect_server)
    make_dvc_repo(repo, params, env)
    ran = _run(_foresight("run", "prepare_prompts"), repo, env)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    subprocess.run(["git", "commit", "-qm", "first stages"], cwd=repo, env=env, check=True)
    return repo, env, ran


@pytest.fixture(scope="module")
def workspace(first_run):
    """:func:`first_run`'s repository and environment."""
    return first_run[:2]


def test_console_shows_stage_events_and_keeps_the_full_output_in_a_log(first_run, prefect_server):
    """Issue #34, defect 3: the console of ``foresight run`` (the first run: ``prepare_policy``, ``prepare_prompts``)
    is one line per stage event with the stage's headline figures, without the stages' output re-logged under a
    second timestamp, blank or progress-bar lines, MLflow's system-metrics lines, or links to another server than
    the configured Prefect API's UI; the stages' full output is in the log file the console names."""
    repo, _, ran = first_run
    lines = (ran.stdout + ran.stderr).splitlines()
    events = ran.stdout.split("=" * 72)[0].strip().splitlines()  # what comes before the summary
    assert all(re.match(r"\d\d:\d\d:\d\d  \S", line) for line in events), events
    for stage in STAGES_RUN:
        assert sum(re.fullmatch(rf"\S+  {stage}: started", line) is not None for line in events) == 1, events
        assert sum(re.match(rf"\S+  {stage}: done in [\d.]+ s", line) is not None for line in events) == 1, events
    assert any("prepare_prompts: done in" in line and "num_train=6, num_eval=2" in line for line in events), events
    assert not [line for line in lines if len(re.findall(r"\b\d\d:\d\d:\d\d\b", line)) > 1], lines  # doubled
    assert not [line for line in lines if re.search(r"\d+%\|", line)], lines  # progress-bar frames
    assert not [line for line in lines if re.fullmatch(r"[\d:. ]+\| \w+ *\| .+? - \s*", line)], lines  # blank
    assert not [line for line in lines if "Task run 'dvc-repro" in line and "Finished in state" not in line], lines
    assert "system_metrics" not in ran.stdout + ran.stderr
    links = re.findall(r"[Vv]iew at (\S+)", ran.stdout + ran.stderr)
    assert links and all(link.startswith(prefect_server.removesuffix("/api") + "/") for link in links), links
    (log,) = re.findall(r"the stages' full output: (\S+)", ran.stdout)
    full = Path(log).read_text()
    assert Path(log).parent == repo / "logs" and "Running stage 'prepare_prompts'" in full
    assert "prompts: 6 train, 2 eval" in full and "system_metrics" not in full  # the stage's own log, mlflow quiet


def _params(repo: Path, **sections) -> None:
    """Update params.yaml's sections (nested keys merged one level down)."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for name, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(params[name].get(key), dict):
                params[name][key].update(value)
            else:
                params[name][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _append(repo: Path, text: str) -> None:
    with open(repo / "params.yaml", "a") as f:
        f.write(text)


def _latin1(repo: Path) -> None:
    lines = [json.dumps(row) for row in ROWS]
    lines[2] = json.dumps({"prompt": "Añadir 3 y 4. How many?", "answer": "7"}, ensure_ascii=False)
    (repo / "prompts.jsonl").write_bytes(("\n".join(lines) + "\n").encode("latin-1"))


def _other_file_unsynced(repo: Path) -> None:
    _write_rows(repo / "other.jsonl", ROWS[::-1])
    _params(repo, prompts={"file": {"path": "other.jsonl"}})


def _prompts_now(repo: Path) -> list[str]:
    return [question for split in ("train", "eval")
            for question in pd.read_json(repo / f"data/prompts/{split}.jsonl", lines=True)["question"]]


def _only_the_file_rows(repo: Path, out: str) -> None:
    """The stage re-ran on the edited file: every prompt now comes from its current rows; and the summary calls
    the stages downstream of it stale (as ``dvc status`` does), not up to date."""
    current = {row["prompt"] for row in ROWS[4:]}
    assert all(any(question.startswith(prompt) for prompt in current) for question in _prompts_now(repo)), \
        _prompts_now(repo)
    assert any(line.split()[:2] == ["generate", "stale"] for line in out.splitlines()), out[-3000:]


def _long_prompt_dropped(repo: Path, out: str) -> None:
    metrics = json.loads((repo / "data/metrics/prepare_prompts.json").read_text())
    assert metrics["dropped_long_prompts"] == 1, metrics
    assert not any(question.startswith(LONG[:40]) for question in _prompts_now(repo))


def _multi_turn(repo: Path) -> None:
    _write_rows(repo / "prompts.jsonl", [{"turns": [row["prompt"], "Now double it."], "answer": row["answer"]}
                                         for row in ROWS])
    _params(repo, prompts={"file": {"text_column": "turns"}})


def _first_turns_kept(repo: Path, out: str) -> None:
    metrics = json.loads((repo / "data/metrics/prepare_prompts.json").read_text())
    assert metrics["multi_turn_prompts"] == len(ROWS), metrics
    assert not any("Now double it" in question for question in _prompts_now(repo))


@dataclass(frozen=True)
class Case:
    name: str
    mutate: Callable[[Path], None]
    command: list[str]
    returncode: int
    messages: tuple[str, ...]
    """Each must appear in the output (stdout + stderr)."""
    intact: bool = True
    """The protected outputs are byte for byte what they were (else ``check`` says what changed)."""
    check: Callable[[Path, str], None] | None = None


CASES = [
    # params errors: named, exit 2 before DVC touches anything
    Case("typo'd key", lambda repo: _params(repo, prompts={"num_trian": 5}), _foresight("run", "prepare_prompts"), 2,
         ("num_trian",)),
    Case("wrong type", lambda repo: _params(repo, prompts={"num_train": "many"}), _foresight("run", "prepare_prompts"),
         2, ("prompts.num_train",)),
    Case("invalid YAML", lambda repo: _append(repo, "prompts: [unclosed\n"), _foresight("run", "prepare_prompts"), 2,
         ("params.yaml is not valid YAML", "line")),
    # a stage that fails after DVC removed its outputs: they come back
    Case("missing policy folder", lambda repo: _params(repo, policy={"model": str(repo / "no-such-policy")}),
         _foresight("run", "prepare_policy"), 1, ("no-such-policy", "restored from the DVC cache")),
    Case("prompt file not UTF-8", _latin1, _dvc("repro", "prepare_prompts"), DVC_FAILED,
         ("prompts.jsonl", "line 3", "UTF-8", "restored from the DVC cache")),
    Case("empty prompt file", lambda repo: (repo / "prompts.jsonl").write_text(""), _dvc("repro", "prepare_prompts"),
         DVC_FAILED, ("prompts.jsonl is empty", "restored from the DVC cache")),
    Case("missing prompt column", lambda repo: _params(repo, prompts={"file": {"text_column": "question_text"}}),
         _dvc("repro", "prepare_prompts"), DVC_FAILED, ("no column 'question_text'", "restored from the DVC cache")),
    Case("missing prompt file", lambda repo: _params(repo, prompts={"file": {"path": "nope.jsonl"}}),
         _dvc("repro", "prepare_prompts"), DVC_FAILED,
         ("prompt file not found", "nope.jsonl", "restored from the DVC cache")),
    Case("prompt file dvc.yaml does not list", _other_file_unsynced, _dvc("repro", "prepare_prompts"), DVC_FAILED,
         ("other.jsonl", "foresight dvc-yaml > dvc.yaml", "restored from the DVC cache")),
    # not errors: what the stage does with them
    Case("prompt file edited in place", lambda repo: _write_rows(repo / "prompts.jsonl", ROWS[4:]),
         _foresight("run", "prepare_prompts"), 0, ("prepare_prompts: started",), intact=False,
         check=_only_the_file_rows),
    Case("over-long prompt", lambda repo: _write_rows(repo / "prompts.jsonl", [*ROWS, {"prompt": LONG, "answer": "1"}]),
         _foresight("run", "prepare_prompts"), 0, ("prepare_prompts: started",), intact=False,
         check=_long_prompt_dropped),
    Case("multi-turn prompt set", _multi_turn, _foresight("run", "prepare_prompts"), 0,
         ("the later turns are dropped",), intact=False, check=_first_turns_kept),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_named_and_loses_nothing(workspace, case):
    repo, env = workspace
    before = _snapshot(repo)
    case.mutate(repo)
    try:
        proc = _run(case.command, repo, env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == case.returncode, out[-4000:]
        for message in case.messages:
            assert message in out, f"{message!r} not in:\n{out[-4000:]}"
        assert "Traceback" not in proc.stderr.splitlines()[-1:], out[-3000:]
        if case.intact:
            assert _snapshot(repo) == before, f"outputs changed after: {case.name}"
        if case.check:
            case.check(repo, out)
    finally:  # back to the committed params, files, dvc.lock and outputs for the next case
        subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, env=env, check=True)
        subprocess.run(["git", "clean", "-qfx", "--", "other.jsonl"], cwd=repo, env=env, check=True)
        restored = _run(_dvc("checkout", "--force", *STAGES_RUN), repo, env)
        assert restored.returncode == 0, restored.stdout + restored.stderr


def test_params_file_runs_its_values_as_a_dvc_experiment(workspace, tmp_path):
    """``foresight run prepare_prompts --params study.yaml`` (a file outside the project) with another prompt count
    runs it: DVC's experiment sets the changed key on params.yaml, the stage writes that many prompts, ``dvc.lock``
    records it, ``dvc status`` finds params, lock and outputs agreeing, DVC lists the experiment, and the MLflow
    parent run logs the params the stage read."""
    import mlflow

    from foresight.config import load_config
    from foresight.tracking import flatten

    repo, env = workspace
    study = tmp_path / "study.yaml"
    study.write_text("prompts:\n  num_train: 4\n  num_eval: 2\n")  # num_eval as in params.yaml: not set
    try:
        ran = _run(_foresight("run", "prepare_prompts", "--params", str(study)), repo, env)
        out = ran.stdout + ran.stderr
        assert ran.returncode == 0, out[-4000:]
        assert "prompts.num_train=4" in ran.stdout and "prompts.num_eval" not in ran.stdout, out[-4000:]
        assert len((repo / "data/prompts/train.jsonl").read_text().splitlines()) == 4  # 6 before
        assert yaml.safe_load((repo / "params.yaml").read_text())["prompts"]["num_train"] == 4
        lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["prepare_prompts"]
        assert lock["params"]["params.yaml"]["prompts"]["num_train"] == 4
        status = _run(_dvc("status", "prepare_prompts", "--json"), repo, env)
        assert status.returncode == 0 and json.loads(status.stdout) == {}, status.stdout + status.stderr
        exps = subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], cwd=repo, env=env,
                              capture_output=True, text=True, check=True)
        assert exps.stdout.split(), "DVC recorded no experiment (dvc exp show)"
        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
        runs = client.search_runs([client.get_experiment_by_name("test").experiment_id],
                                  "tags.`foresight.kind` = 'pipeline'", order_by=["attributes.start_time DESC"],
                                  max_results=1)
        ran_with = flatten(load_config(repo / "params.yaml").model_dump(mode="json", by_alias=True))
        assert runs[0].data.params["prompts.num_train"] == "4" and runs[0].data.params == ran_with
    finally:  # back to the committed params, dvc.lock and outputs
        subprocess.run(["git", "checkout", "-q", "--", "."], cwd=repo, env=env, check=True)
        restored = _run(_dvc("checkout", "--force", *STAGES_RUN), repo, env)
        assert restored.returncode == 0, restored.stdout + restored.stderr
