"""Atomic writes: a stage's outputs appear whole or not at all.

Everything is written to a temporary sibling and renamed into place (``os.replace`` is atomic on
one filesystem), so a crash or a failed validation never leaves a half-written file over the
previous good one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd


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


def write_table(df: pd.DataFrame, target: Path) -> Path:
    """Write a DataFrame atomically; the extension (.parquet, .jsonl, .csv) picks the format."""
    target = Path(target)
    with atomic_path(target) as tmp:
        if target.suffix == ".parquet":
            df.to_parquet(tmp, index=False)
        elif target.suffix == ".jsonl":
            df.to_json(tmp, orient="records", lines=True, force_ascii=False)
        elif target.suffix == ".csv":
            df.to_csv(tmp, index=False)
        else:
            raise ValueError(f"unsupported table format: {target}")
    return target


def read_table(path: Path, what: str) -> pd.DataFrame:
    """Read a table written by :func:`write_table`, with a clear error when an upstream stage has not run."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found at {path}: run the stage that produces it first")
    if path.suffix == ".parquet":
        return pd.read_parquet(path)
    if path.suffix == ".jsonl":
        return pd.read_json(path, orient="records", lines=True, dtype=False)
    if path.suffix == ".csv":
        return pd.read_csv(path)
    raise ValueError(f"unsupported table format: {path}")


def write_json(data: dict, target: Path) -> Path:
    """Write JSON atomically (metrics files, manifests)."""
    with atomic_path(Path(target)) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return Path(target)
