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
    trust_remote_code: bool = False  # ``hf-classifier`` models that ship their own code; never enabled implicitly
    batch_size: int = 8  # responses scored per forward pass
    max_length: int = 4096  # (prompt + response) tokens kept
    dtype: DtypeName = "auto"
    device: DeviceName = "auto"
    score_min: float = -100.0  # plausible range of a reward model's scores (validation), not used by ``verifiable``
    score_max: float = 100.0

    @property
    def score_range(self) -> tuple[float, float]:
        """The scores this labeler can give: 0 or 1 for ``verifiable``, a plausible ``[score_min, score_max]`` for
        reward models (a score outside it means a broken model: a wrong dtype, a mis-pooled token)."""
        return (0.0, 1.0) if self.labeler == "verifiable" else (self.score_min, self.score_max)

    @property
    def score_values(self) -> tuple[float, ...] | None:
        """The only scores a discrete labeler gives (``verifiable``: 0 and 1); None for continuous ones."""
        return (0.0, 1.0) if self.labeler == "verifiable" else None
