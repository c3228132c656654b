"""The frozen configs of policy loading, sampling, the classical decoders and typical acceptance
(docs/pipeline.md, docs/medusa.md).

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

HFDecoder = Literal["greedy", "temperature", "top_p", "top_k", "beam"]


HF_DECODERS: tuple[HFDecoder, ...] = get_args(HFDecoder)


@dataclass(frozen=True)
class ClassicalDecoding:
    """The one knob of each sampling decoder and the beam count (the SLA paper's settings)."""

    temperature: float = 0.8  # of the ``temperature`` decoder
    top_p: float = 0.9  # of the ``top_p`` decoder
    top_k: int = 50  # of the ``top_k`` decoder
    num_beams: int = 4  # of the ``beam`` decoder


@dataclass(frozen=True)
class Sampling:
    """How :func:`models.engine.generation.sample` draws: N samples per prompt at this temperature / top-p / top-k, in seeded batches."""

    num_samples: int = 4  # N: samples per prompt
    temperature: float = 0.8
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    batch_size: int = 24  # prompts per generate call, each bringing num_samples sequences
    seed: int = 0  # batch b is seeded with seed + b


DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
"""A model's weights dtype; ``auto`` = bfloat16 on CUDA, float32 on CPU (see :func:`models.engine.policy.resolve_dtype`)."""


DeviceName = Literal["auto", "cpu", "cuda"]
"""Where a model runs; ``auto`` = CUDA when present (see :func:`models.engine.policy.resolve_device`)."""


DraftDtypeName = Literal["float32", "bfloat16"]
"""The precision of a speculative decoder's drafts (copies of the policy's parts made for drafting)."""


@dataclass(frozen=True)
class PolicySpec:
    """Which policy to load and how: the model (embedded alias, local folder or hub id) and its revision, and
    the dtype, device and code trust it is loaded with."""

    model: str = "smollm2-135m-instruct"
    revision: str | None = None  # hub revision when ``model`` is a hub id
    dtype: DtypeName = "float32"
    device: DeviceName = "auto"
    trust_remote_code: bool = False  # let the model folder's own Python code run


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance (§2.3.1) — LOSSY: output may differ from greedy.

    A node is accepted when its parent's distribution gives its token p > min(ε, α·exp(−H(p))).
    """

    posterior_threshold: float = 0.09  # ε
    posterior_alpha: float = 0.3  # α (Medusa's default is √ε)
    temperature: float = 1.0
