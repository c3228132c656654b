"""The knobs of the reward labelers: the verifiable answer check, ArmoRM (Wang et al. 2024, "Interpretable
Preferences via Multi-Objective Reward Modeling and Mixture-of-Experts") and any sequence-classification reward
model (docs/pipeline.md).

Each knob is declared once, here (:class:`models.common.config.Knobs`): the component the model code takes
(:class:`LabelerSpec`) and the ``params.yaml`` section that subclasses it (``label``). Pydantic and names only, no
heavy imports: loading the params never loads model code.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from models.common.config import Knobs
from models.engine.config import DeviceName, DtypeName

LabelerName = Literal["verifiable", "armorm", "hf-classifier"]


class LabelerSpec(Knobs):
    """Which labeler :func:`models.labeling.labelers.build_labeler` builds and, for the model-based ones, the reward model and how it runs."""

    labeler: LabelerName = "verifiable"
    """``verifiable`` | ``armorm`` | ``hf-classifier``. ``verifiable``: the final answer against the reference answer
    (1 or 0); ``armorm``: ArmoRM's gated score, loaded natively by :mod:`models.labeling.armorm`; ``hf-classifier``:
    any sequence-classification reward model, its first logit."""
    model: str | None = None
    """Reward model path or hub id for ``armorm`` / ``hf-classifier``, such as ``RLHFlow/ArmoRM-Llama3-8B-v0.1``
    with ``labeler: armorm`` (loaded natively)."""
    trust_remote_code: bool = False
    """Run an ``hf-classifier`` model's own code (``auto_map``), for models that ship their own code. Never enabled
    implicitly; ``armorm`` never needs it."""
    batch_size: int = Field(8, ge=1)
    """Responses scored per forward pass."""
    max_length: int = Field(4096, ge=16)
    """Longest (prompt + response) scored, in tokens. A longer conversation loses the tail of its response (the
    prompt and the end of the assistant turn are kept; ``truncated_responses`` in the stage's metrics counts them);
    a prompt that leaves no room for a response is an error (``prompts.max_prompt_tokens`` drops such prompts)."""
    dtype: DtypeName = "auto"
    """Reward model dtype: ``auto`` = bfloat16 where the policy's is (on CUDA and on a CPU with native bf16 units),
    else float32."""
    device: DeviceName = "auto"
    """Where the reward model runs."""
    score_min: float = -100.0
    """Lowest plausible score of a reward model: validation fails below it. Not used by ``verifiable``, which gives
    0 or 1."""
    score_max: float = 100.0
    """Highest plausible score of a reward model: validation fails above it."""

    @property
    def score_range(self) -> tuple[float, float]:
        """The scores this labeler can give: 0 or 1 for ``verifiable``, a plausible ``[score_min, score_max]`` for
        reward models (a score outside it means a broken model: a wrong dtype, a mis-pooled token)."""
        return (0.0, 1.0) if self.labeler == "verifiable" else (self.score_min, self.score_max)

    @property
    def score_values(self) -> tuple[float, ...] | None:
        """The only scores a discrete labeler gives (``verifiable``: 0 and 1); None for continuous ones."""
        return (0.0, 1.0) if self.labeler == "verifiable" else None


class LabelConfig(LabelerSpec):
    """Reward labeling (stage ``label``)."""

    @model_validator(mode="after")
    def _model_given_for_model_labelers(self) -> LabelConfig:
        if self.labeler != "verifiable" and not self.model:
            raise ValueError(f"labeler '{self.labeler}' needs 'model' (a path or hub id of the reward model)")
        if self.labeler == "armorm" and self.trust_remote_code:
            raise ValueError("labeler 'armorm' is loaded natively and runs no remote code: drop trust_remote_code "
                             "(ArmoRM's own code is reachable as labeler 'hf-classifier' with trust_remote_code: true)")
        if self.score_min >= self.score_max:
            raise ValueError(f"score_min ({self.score_min}) must be below score_max ({self.score_max})")
        return self
