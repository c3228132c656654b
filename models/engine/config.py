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


SamplingEngineName = Literal["hf", "vllm"]
"""What samples the generate stage's responses (:mod:`models.engine.generation`, :mod:`models.engine.vllm_sampling`)."""


@dataclass(frozen=True)
class Sampling:
    """How :func:`models.engine.generation.sample` draws: N samples per prompt at this temperature / top-p / top-k, in seeded batches."""

    num_samples: int = 4  # N: samples per prompt
    temperature: float = 0.8
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    batch_size: int = 24  # prompts per batch, each bringing num_samples sequences
    chunk_tokens: int = 8  # new tokens per generate call; then rows that have ended drop out
    max_batch_tokens: int | None = None  # hf: a batch's rows × (longest prompt + max_new_tokens) at most; None = off
    seed: int = 0  # batch b is seeded with seed + b (vLLM: prompt i with seed + i·num_samples; sample s: + s)
    engine: SamplingEngineName = "hf"  # hf (generate, the reference) | vllm (GPU machines, a worker in vLLM's venv)
    tensor_parallel_size: int = 1  # vllm: GPUs one model is split over
    vllm_python: str | None = None  # vllm: the python of the separate venv holding vLLM (runs the worker script)


DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
"""A model's weights dtype; ``auto`` = bfloat16 on CUDA and on a CPU with native bf16 units (AVX512-BF16 or AMX),
else float32 (see :func:`models.engine.policy.resolve_dtype`)."""


DeviceName = Literal["auto", "cpu", "cuda"]
"""Where a model runs; ``auto`` = CUDA when present (see :func:`models.engine.policy.resolve_device`)."""


DraftDtypeName = Literal["float32", "bfloat16"]
"""The precision of a speculative decoder's drafts (copies of the policy's parts made for drafting)."""


@dataclass(frozen=True)
class PolicySpec:
    """Which policy to load and how: the model (embedded alias, local folder or hub id) and its revision, and
    the dtype, device and code trust it is loaded with.

    ``dtype`` defaults to ``auto`` (bf16 where the hardware computes it natively), like ``policy.dtype``; code and
    tests that need float32's exact arithmetic (token-for-token identity with greedy) ask for ``float32``."""

    model: str = "smollm2-135m-instruct"
    revision: str | None = None  # hub revision when ``model`` is a hub id
    dtype: DtypeName = "auto"
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


@dataclass(frozen=True)
class Adaptation:
    """When speculative decoding drafts (:func:`models.engine.speculative.speculative_stream`): while it pays.

    A draft–verify cycle costs ``c`` plain one-token steps and gains τ tokens; drafting pays while τ ≥ c. The
    engine keeps τ as the mean tokens gained per cycle over the last ``window`` cycles; once ``first_decision``
    cycles are measured and τ < c, it decodes plainly (the root alone, no drafter forward), and after
    ``probe_every`` plain tokens it drafts one cycle again, which re-measures τ; each probe that still does not pay
    doubles the gap to the next (up to ``max_probe_every``), one that pays resets it; a decision state carried to
    the next prompt opens it with a probe. Lossless either way: greedy verification and a plain greedy step both
    emit greedy's token, and a plain sampling step samples the model itself.
    """

    window: int = 8
    """Draft cycles whose mean gain is τ: fewer react sooner, more are steadier. Measured on the 2-core CPU (Medusa,
    bf16, 8 prompts × 3, interleaved): with 4, short hard stretches inside task responses (four cycles gaining one
    token each) sent 27 % of the steps plain and left Medusa at 1.89× greedy, against 2.08× drafting always; 6 and 8
    drafted on 99.7 % of the steps (2.10×, 2.07×) and still decoded general instructions 96 % plain, at 0.99×
    greedy like 4 (drafting always: 0.90×)."""
    first_decision: int = 4
    """Draft cycles measured before the first decision (at most ``window``); τ is their mean until the window is
    full. A drafter that does not pay is stopped after this many cycles (each costs c − τ plain steps: on general
    instructions at batch 16, a fresh decision state's first 8 cycles cost ~4 % of the curve's 3 timed batches,
    0.947× HF greedy), while the steady state still averages over the whole window."""
    probe_every: int = 8
    """Plain tokens between two probing cycles while drafting does not pay (each probe costs c − τ steps). Measured
    on the 2-core CPU (Medusa, 8 + 8 prompts): 8 instead of 16 lost no speed on general instructions (0.97× against
    0.94× greedy) and drafted more on task prompts (1.59× against 1.51×; intervals overlap)."""
    max_probe_every: int = 64
    """The longest gap between probes (= ``probe_every``: no doubling). Where drafting never pays (MTP drafts
    verified by the float32 policy of GRPO on the 2-core CPU: a cycle took 160 ms against 77 ms for a plain step, c ≈
    2.1, for τ ≈ 1.5 per cycle), probes every 8 tokens cost ~10 % of the decoding time; doubling gaps bound that
    waste by (c − τ) / ``max_probe_every``."""
    cycle_cost: float | None = None
    """c, a cycle's cost in plain steps; None: measured during the run (the median wall time of the window's
    cycles over that of the last plain steps; the first step is plain, to time one). A fixed c makes the decisions
    depend on acceptance alone, so sampled output repeats exactly under a seed."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.first_decision < 1 or self.probe_every < 1:
            raise ValueError("adaptation needs window, first_decision and probe_every ≥ 1, got "
                             f"{self.window}, {self.first_decision}, {self.probe_every}")
        if self.max_probe_every < self.probe_every:
            raise ValueError(f"max_probe_every ({self.max_probe_every}) must be ≥ probe_every ({self.probe_every})")
        if self.cycle_cost is not None and self.cycle_cost <= 0:
            raise ValueError(f"a cycle's cost in plain steps must be > 0, got {self.cycle_cost}")
