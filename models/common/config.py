"""The base of every component's knobs, and the shared training loop's precision setting.

A knob is declared once: a field of a :class:`Knobs` subclass in the method's own ``config.py``, with its type,
default, range (``Field(ge=…)``) and docstring. The pipeline's ``params.yaml`` sections subclass these classes (a
section adds only the knobs its task reads beside the model code), and ``params.yaml`` itself is generated from
them (``foresight params-yaml``). Light modules: pydantic and names only, so reading the params never loads model
code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MixedPrecision = Annotated[Literal["no", "bf16"], BeforeValidator(lambda value: "no" if value is False else value)]
"""accelerate's ``mixed_precision`` for a stage's forward passes: ``bf16`` (bfloat16 autocast) or ``no``. YAML 1.1
reads a bare ``no`` as false, and ``dvc exp run -S`` rewrites params.yaml without the quotes that keep it a string:
false is read back as ``no``."""

SFTData = Literal["distilled", "correct"]
"""The responses COrAL and the MTP module train on: the policy's greedy responses of the ``distill`` stage
(self-distillation), or the generated samples the labeler marked correct (:func:`tasks.distilled.sft_responses`)."""


class Knobs(BaseModel):
    """Frozen, validated settings of one component. Attribute docstrings become the fields' descriptions (shown by
    ``foresight check`` and the Prefect UI, and written as comments into the generated ``params.yaml``); unknown
    keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, validate_default=True)


class TrainingLoop(Knobs):
    """The shared training loop's own knobs (:func:`models.common.training.train`; TRL's ``TrainingArguments`` for
    DPO), in the section of every component it trains. The defaults leave a run as it was: no clipping, one batch
    per optimizer step, no checkpoints."""

    max_grad_norm: float | None = Field(None, gt=0.0)
    """Clip the gradients' global L2 norm to this before each optimizer step (``accelerator.clip_grad_norm_``); the
    norm before clipping is logged per step as ``grad_norm``. null: no clipping."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Batches of ``batch_size`` whose gradients are summed into one optimizer step (accelerate's gradient
    accumulation): the step sees ``gradient_accumulation_steps`` × ``batch_size`` examples (× processes) for the
    memory of one batch. The schedule, the step count and the logged stats are per optimizer step."""
    checkpoint_every: int | None = Field(None, ge=1)
    """Save the training state (weights, optimizer, schedule, RNG states, data position, early stopping) every this
    many optimizer steps under ``.foresight/checkpoints/<stage>/``: a stage killed mid-training and run again
    resumes from its last checkpoint and ends with the same weights. Removed when the stage succeeds. null: none."""


class FileSourceConfig(Knobs):
    """A local ``jsonl``/``parquet``/``csv`` file (``prompts.file``)."""

    path: Path
    """The file. Its extension picks the reader."""
    text_column: str = "prompt"
    """Column holding the prompt text; a list-valued column uses its first element."""
    answer_column: str | None = None
    """Optional column with the reference answer."""
