"""Atomic writes: an output appears whole or not at all.

Everything is written to a temporary sibling and renamed into place (``os.replace`` is atomic on one
filesystem), so a crash never leaves a half-written file or folder over the previous good one. Model code
saves checkpoints through these; the pipeline's tables go through :mod:`foresight.storage`, built on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success rename it over ``target``.

    Works for files and folders. On an exception the temporary is removed and ``target`` is untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)) / target.name
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


CHECKPOINTS_DIR = Path(".foresight/checkpoints")
"""Where a pipeline stage's training checkpoints go (``<dir>/<stage>/<fingerprint>/step-N``, beside the params file;
gitignored): outside the stage's DVC outputs, which DVC deletes before it runs the stage."""

CHECKPOINTS_ENV = "FORESIGHT_CHECKPOINTS"
"""The environment variable naming the folder the shared training loop checkpoints under
(:func:`models.common.training.train`); an environment variable, so the processes of an ``accelerate launch`` see it."""


@contextlib.contextmanager
def training_checkpoints(folder: Path) -> Iterator[None]:
    """Training inside the block (with a ``checkpoint_every`` knob) checkpoints under ``folder``, which is removed
    when the block succeeds: a block that fails or is interrupted leaves its checkpoints for the next run."""
    previous = os.environ.get(CHECKPOINTS_ENV)
    os.environ[CHECKPOINTS_ENV] = str(folder)
    try:
        yield
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        if previous is None:
            os.environ.pop(CHECKPOINTS_ENV, None)
        else:
            os.environ[CHECKPOINTS_ENV] = previous


def write_json(data: dict, target: Path) -> Path:
    """Write JSON atomically (metrics files, manifests)."""
    with atomic_path(Path(target)) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return Path(target)
