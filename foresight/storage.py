"""Tables and JSON of the pipeline's stages, written atomically (:mod:`models.common.files`): a stage's
outputs appear whole or not at all.
A failed validation or a crash never leaves a half-written file over the previous good one.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from models.common.files import atomic_path, write_json  # noqa: F401  (re-exported for the tasks)


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
