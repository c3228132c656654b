"""``pip install`` of the project: the wheel setuptools builds from pyproject.toml holds every package, module and
package data file of the source tree and the LICENSE; installed into a fresh venv, ``foresight --help`` runs and every
module's package imports from it.

The fresh venv has no dependencies of its own: a ``.pth`` line puts this venv's site-packages on its path (site.py
adds such a folder but does not process the ``.pth`` files in it, so this checkout's editable install stays inactive
there and the project can only come from the wheel).
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.helpers import REPO, subprocess_env

PACKAGES = ("foresight", "models", "tasks", "flows")
"""The project's top-level packages (pyproject.toml's ``[tool.setuptools.packages.find]``)."""


def _source_files() -> list[str]:
    """The files a fresh clone has, plus the new ones not yet committed (not those git ignores), that exist."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return [path for path in listed if path and (REPO / path).is_file()]


def test_wheel_installs_every_package_its_data_and_the_licence(tmp_path):
    files = _source_files()
    # build from a copy of the source, so the build's own folders (build/, *.egg-info) stay out of the checkout
    source = tmp_path / "source"
    for path in files:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_bytes((REPO / path).read_bytes())
    env = subprocess_env()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], env=env, check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("foresight-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
        licence = next(name for name in in_wheel if name.endswith(".dist-info/licenses/LICENSE"))
        assert archive.read(licence) == (REPO / "LICENSE").read_bytes()
        metadata = archive.read(next(name for name in in_wheel if name.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    shipped = [path for path in files if path.split("/")[0] in PACKAGES]
    assert "foresight/instructions/general.jsonl" in shipped
    assert sorted(set(shipped) - in_wheel) == []  # every module and data file of the packages

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], env=env, check=True, capture_output=True)

    outside = tmp_path / "elsewhere"  # no checkout on the path: the current folder comes first on sys.path
    outside.mkdir()
    helped = subprocess.run([str(venv / "bin" / "foresight"), "--help"], cwd=outside, env=env, capture_output=True,
                            text=True)
    assert helped.returncode == 0 and "usage: foresight" in helped.stdout, helped.stderr[-3000:]
    # every module the wheel installed, found by walking the installed packages (importing each package on the way)
    walk = ("import importlib, json, pkgutil, sys\n"
            "failed = []\n"
            f"packages = [importlib.import_module(name) for name in {PACKAGES!r}]\n"
            "names = [p.__name__ for p in packages] + [m.name for p in packages for m in pkgutil.walk_packages("
            "p.__path__, p.__name__ + '.', onerror=failed.append)]\n"
            "print(json.dumps({'names': names, 'failed': failed, 'files': [p.__file__ for p in packages]}))\n")
    walked = subprocess.run([str(python), "-c", walk], cwd=outside, env=env, capture_output=True, text=True)
    assert walked.returncode == 0, walked.stderr[-3000:]
    found = json.loads(walked.stdout.splitlines()[-1])
    assert found["failed"] == [], found["failed"]  # a package that does not import from the wheel
    assert all(Path(file).is_relative_to(venv) for file in found["files"]), found["files"]
    modules = {path[:-len(".py")].removesuffix("/__init__").replace("/", ".") for path in shipped
               if path.endswith(".py")}
    assert sorted(found["names"]) == sorted(modules)
