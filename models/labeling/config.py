"""The frozen configs of the reward labelers (docs/pipeline.md).

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.engine.config import DeviceName, DtypeName

LabelerName = Literal["verifiable", "armorm", "hf-classifier"]


@dataclass(frozen=True)
class LabelerSpec:
    """Which labeler :func:`models.labeling.labelers.build_labeler` builds and, for the model-based ones, the reward model and how it runs."""

    labeler: LabelerName = "verifiable"
    model: str | None = None  # reward model path or hub id (``armorm`` / ``hf-classifier``)
    trust_remote_code: bool = False  # ArmoRM needs it; never enabled implicitly
    batch_size: int = 8  # responses scored per forward pass
    max_length: int = 4096  # (prompt + response) tokens kept
    dtype: DtypeName = "auto"
    device: DeviceName = "auto"
