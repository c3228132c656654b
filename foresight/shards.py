"""Resumable output of a long stage: one parquet shard per unit of work, written as each unit finishes.

A generation job at paper scale (~60k prompts × 5 samples from an 8B policy) runs for hours; written once at the
end, a crash or a pre-empted GPU loses all of it. :class:`ShardStore` keeps each finished unit (a batch of prompts)
in its own file, written atomically (temp file, then rename), so a killed run leaves whole shards only, and a re-run
skips the units whose shards exist. The shards carry the settings that decided their contents (``spec.json``):
shards written under other settings (another seed, model or prompt set) are removed, never mixed in. The stage
concatenates the shards in unit order into its output and then removes the folder, so the output is the same as
an uninterrupted run's, row for row (``tests/test_generation_engines.py``).

The folder sits next to the stage's output, outside what DVC tracks: DVC clears a stage's outputs before it runs
it, and the shards must outlive a failed run.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pandas as pd

from foresight.storage import read_table, write_table
from models.common.files import atomic_path

SPEC = "spec.json"
logger = logging.getLogger(__name__)


def shard_folder(output: Path) -> Path:
    """Where the shards of ``output`` live while it is produced: ``<dir>/.<name>.shards/``."""
    output = Path(output)
    return output.parent / f".{output.name}.shards"


class ShardStore:
    """The finished units of one job (``spec``: JSON-serialisable settings that decide the shards' contents)."""

    def __init__(self, folder: Path, spec: dict):
        self.folder = Path(folder)
        spec = json.loads(json.dumps(spec, sort_keys=True))  # as it reads back from disk
        spec_path = self.folder / SPEC
        self.discarded = 0
        if self.folder.exists():
            written = json.loads(spec_path.read_text()) if spec_path.is_file() else None
            if written != spec:
                self.discarded = len(self._shard_paths())
                logger.warning("removing %d shards in %s written under other settings", self.discarded, self.folder)
                shutil.rmtree(self.folder)
        if not spec_path.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            with atomic_path(spec_path) as tmp:
                tmp.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")

    def _shard_paths(self) -> list[Path]:
        return sorted(self.folder.glob("shard-*.parquet"))

    def path(self, unit: int) -> Path:
        return self.folder / f"shard-{unit:06d}.parquet"

    def done(self) -> set[int]:
        """The units whose shards exist (each complete: a shard appears only by an atomic rename)."""
        return {int(p.stem.split("-")[1]) for p in self._shard_paths()}

    def write(self, unit: int, table: pd.DataFrame) -> None:
        write_table(table, self.path(unit))

    def read(self, units: range) -> pd.DataFrame:
        """Every unit's shard in unit order, one table; a missing shard is an error that names it."""
        missing = [u for u in units if not self.path(u).is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} shards missing in {self.folder} (units {missing[:10]})")
        return pd.concat([read_table(self.path(u), f"shard {u}") for u in units], ignore_index=True)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
