"""Each output stored once (issue #31, item 2): DVC's cache linked to the workspace, not copied; MLflow given a
manifest instead of a second copy (``tests/test_tracking_storage.py``); no push into the checkout unless asked.

The DVC test runs a real one-stage git + DVC repository with this project's ``.dvc/config`` cache settings: after
``dvc repro`` every output file is its cache object (one inode, or a symlink to it); a re-run after a param change,
``dvc exp run`` and ``dvc checkout`` leave every cache object intact (its content still hashes to its name).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, project_cache_type, subprocess_env

WRITER = '''\
"""Writes out/ from params.yaml's n, as the stages do: into a temporary folder, then renamed over the output."""
import json, os, shutil, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
shutil.rmtree("out.tmp", ignore_errors=True)
os.makedirs("out.tmp/weights")
with open("out.tmp/weights/model.bin", "wb") as f:
    f.write(bytes([n]) * 300_000)
with open("out.tmp/config.json", "w") as f:
    json.dump({"n": n}, f)
os.replace("out.tmp", "out")
'''


def _dvc(repo: Path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _cache_object(repo: Path, md5: str) -> Path:
    return repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def _assert_linked(repo: Path) -> None:
    """Every file of ``out/`` is its cache object: the same inode (hard link) or a symlink to it."""
    for path in (repo / "out").rglob("*"):
        if path.is_file():
            cached = _cache_object(repo, _md5(path))
            assert cached.is_file(), f"{path} has no cache object"
            assert os.path.samefile(path, cached), f"{path} is a copy of its cache object, not a link to it"


def _assert_cache_sound(repo: Path) -> int:
    """Every cache object still hashes to its name (a ``.dir`` object: the md5 of its JSON listing)."""
    objects = [p for p in (repo / ".dvc" / "cache" / "files" / "md5").rglob("*") if p.is_file()]
    for path in objects:
        name = (path.parent.name + path.name).removesuffix(".dir")
        assert _md5(path) == name, f"cache object {path} was changed in place"
    return len(objects)


def test_dvc_outputs_are_links_into_the_cache_and_reruns_keep_the_cache_sound(tmp_path):
    from foresight.config import parse_config
    from foresight.tracking import folder_manifest

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "write.py").write_text(WRITER)
    (repo / "params.yaml").write_text("n: 1\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump(
        {"stages": {"make": {"cmd": f"{sys.executable} write.py", "deps": ["write.py"], "params": ["n"],
                             "outs": ["out"]}}}))
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    _dvc(repo, "config", "cache.type", project_cache_type())
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one stage"], cwd=repo, check=True)

    _dvc(repo, "repro")
    _assert_linked(repo)
    first = (repo / "out/weights/model.bin").read_bytes()
    # the manifest MLflow gets names the folder by the hash dvc.lock records for it, and its size and file count
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["make"]["outs"][0]
    manifest = folder_manifest(parse_config({}, root=repo), repo / "out")
    assert (manifest["path"], manifest["md5"], manifest["size"], manifest["nfiles"]) == (
        "out", lock["md5"], lock["size"], lock["nfiles"])
    assert all(_cache_object(repo, f["md5"]).is_file() for f in manifest["files"])

    # a param change re-runs the stage: a new output, linked again; the first version's objects are untouched
    (repo / "params.yaml").write_text("n: 2\n")
    assert "Running stage 'make'" in _dvc(repo, "repro")
    _assert_linked(repo)
    assert (repo / "out/weights/model.bin").read_bytes() == bytes([2]) * 300_000
    assert "Data and pipelines are up to date" in _dvc(repo, "status")
    # dvc exp run: a new run in the workspace, then back to n=1 from the run cache, linked, byte for byte
    assert "Running stage 'make'" in _dvc(repo, "exp", "run", "-S", "n=3")
    assert "is cached - skipping run" in _dvc(repo, "exp", "run", "-S", "n=1")
    _assert_linked(repo)
    assert (repo / "out/weights/model.bin").read_bytes() == first
    # the restore a manifest prints: dvc checkout of a folder inside the output brings back its files, linked
    (repo / "out/weights/model.bin").unlink()
    _dvc(repo, "checkout", "out/weights")
    assert (repo / "out/weights/model.bin").read_bytes() == first
    _assert_linked(repo)
    assert "Data and pipelines are up to date" in _dvc(repo, "status")
    # 3 versions × (model, config, .dir listing) objects, each still what its name says
    assert _assert_cache_sound(repo) == 9


def test_pipeline_pushes_only_when_asked(monkeypatch):
    """``foresight pipeline`` does not push to the DVC remote (a folder in the checkout: a second copy of every
    output) unless ``--push`` is given; ``foresight deploy``'s deployments push (workers in other clones share
    results through the remote), ``foresight serve``'s do not."""
    import flows.pipeline
    from flows.serve import _deployment_specs, deployments
    from flows.cli import main

    assert inspect.signature(flows.pipeline.pipeline_flow.fn).parameters["push"].default is False
    calls = []

    def fake_flow(**kwargs):
        calls.append(kwargs)
        return {"stages": [], "claims": [], "mlflow_run_id": "run"}

    monkeypatch.setattr(flows.pipeline, "pipeline_flow", fake_flow)
    params = str(REPO / "params.yaml")
    assert main(["pipeline", "--params", params]) == 0
    assert main(["pipeline", "--push", "--params", params]) == 0
    assert main(["run", "generate", "--push", "--params", params]) == 0
    assert [call["push"] for call in calls] == [False, True, True]
    with pytest.raises(SystemExit):
        main(["pipeline", "--no-push", "--params", params])

    assert all(spec[1]["push"] is True for spec in _deployment_specs(REPO / "params.yaml", push=True))
    assert not any(d.parameters.get("push") for d in deployments(REPO / "params.yaml"))
