"""The knobs of the reward heads' training, SLA search and DPO, and of the SLA decoder benchmark (Zhang, Hong & Yu,
"Streaming Looking Ahead with Token-level Self-reward", §4.3, §5, Algorithm 2; Rafailov et al., "Direct Preference
Optimization", NeurIPS 2023; docs/sla.md).

Each knob is declared once, here (:class:`models.common.config.Knobs`): the components the model code takes
(:class:`RewardTraining`, :class:`DPOTraining`, :class:`SLASearch`; the benchmark's classical decoders take
:class:`models.engine.config.ClassicalDecoding`) and the ``params.yaml`` sections that subclass them (``reward``,
``dpo``, ``sla``, ``sla_benchmark``), adding only the knobs their task reads beside the model code. Pydantic and
names only, no heavy imports: loading the params never loads model code.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from models.common.config import Knobs, TrainingLoop
from models.engine.config import ClassicalDecoding, HFDecoder

LeafScore = Literal["mean", "last"]
"""How SLA scores a leaf: ``mean`` R' over its response so far (the authors' code), or ``last``: R' at its last
token (Algorithm 2's text)."""


class DPOTraining(TrainingLoop):
    """DPO's β and the schedule of :func:`models.sla.dpo.train_dpo`."""

    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the gradients' global L2 norm to this before each optimizer step (TRL's ``max_grad_norm``; its default
    1.0, which DPO has always run with); the norm before clipping is logged as ``grad_norm``. null: no clipping."""
    beta: float = Field(0.1, gt=0.0)
    """DPO temperature β."""
    learning_rate: float = Field(5e-6, gt=0.0)
    """Learning rate."""
    epochs: int = Field(1, ge=1)
    """Passes over the training pairs."""
    batch_size: int = Field(4, ge=1)
    """Pairs per optimizer step."""
    max_length: int = Field(512, ge=16)
    """Longest prompt + response + end token, in tokens, of either side of a pair: a longer pair is dropped, never
    truncated, and counted in the stage's ``*_dropped_too_long`` metrics (training and held-out pairs apart). Fit it
    to the data: the longest templated prompt + ``generate.max_new_tokens`` + 1."""
    lora_rank: int = Field(0, ge=0)
    """Rank of the PEFT LoRA adapters DPO trains instead of the policy's weights (0: none, it trains the policy in
    full). A rank above 0 puts adapters of this rank on every linear layer (alpha = 2 × rank,
    models/common/lora.py); the frozen reference is the same model with its adapters disabled (no second copy),
    and the adapters are merged into the saved weights. What makes 8B fit one 80 GB GPU (``foresight plan``)."""
    gradient_checkpointing: bool = False
    """Recompute the policy's (the backbone's) activations in the backward pass: less memory for ~30 % more
    compute."""
    seed: int = 0
    """Training seed."""


class RewardTraining(TrainingLoop):
    """How reward heads are trained and evaluated (§5: Adam at 5e-5, cosine schedule with warm-up)."""

    learning_rate: float = Field(5e-5, gt=0.0)
    """Adam learning rate (the paper's 5e-5)."""
    epochs: int = Field(2, ge=1)
    """Passes over the training pairs."""
    batch_size: int = Field(4, ge=1)
    """Pairs per optimizer step (2 × that many sequences per forward)."""
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of steps with linear warm-up before the cosine decay."""
    max_length: int = Field(512, ge=16)
    """Longest prompt + response + end token, in tokens, of either side of a pair: a longer pair is dropped, never
    truncated, and counted in the stage's ``*_dropped_too_long`` metrics (training and held-out pairs apart). Fit it
    to the data: the longest templated prompt + ``generate.max_new_tokens`` + 1."""
    curve_points: int = Field(100, ge=2)
    """Points x = 1..100 % of the response at which the token-level reward curve is evaluated."""
    state_cache_gb: float = Field(4.0, ge=0.0)
    """The frozen policy's hidden states of the training sequences are kept in memory up to this many GB (0 never
    caches). The policy is frozen, so its hidden states (every layer's, which the channel reads) of each distinct
    training sequence are computed once and kept when they fit: one policy forward per sequence instead of one per
    sequence, pair and epoch (a response sits in several pairs and every epoch: on the default data one policy
    forward per sequence instead of ~3 per epoch). Larger data (8B: ~270 KB per token) run the policy at every
    step instead."""
    seed: int = 0
    """Seed for the heads' initialisation, the shuffling and the held-out split."""


class SLASearch(Knobs):
    """SLA(d, k, n): the shape of the look-ahead tree."""

    depth: int = Field(2, ge=0, le=6)
    """Search depth d: levels searched below the committed text (0 = plain greedy)."""
    width: int = Field(2, ge=1, le=16)
    """Search width k: children per expanded node."""
    step: int = Field(10, ge=1)
    """Step size n: tokens decoded greedily per node."""
    leaf_score: LeafScore = "mean"
    """A leaf's score, ``mean`` R' over its response so far (the authors' code; what eq. 17 trains) or ``last``, R'
    at its last token (Algorithm 2's text). The benchmark reports the tuned setting with the other one as an
    ablation."""


class RewardConfig(RewardTraining):
    """Token-level reward heads trained with the Bradley–Terry loss (stages ``train_reward*``; SLA §4.3): the
    reward channel and the adapter baselines."""

    hidden_size: int = Field(256, ge=1)
    """Width of the reward channel (the paper uses 256 for an 8B policy)."""
    eval_fraction: float = Field(0.25, gt=0.0, lt=1.0)
    """Share of the pairs held out (by prompt, deterministically) for pair accuracy and AuTRC."""
    adapter_layers: list[int] = Field(default_factory=lambda: [1, 4])
    """Adapter baselines to train for comparison: MLPs on the final hidden state, one per depth listed."""


class DPOConfig(DPOTraining):
    """Direct preference optimisation of the policy on the same pairs (stage ``dpo``)."""

    pairs: Literal["best_worst", "all"] = "best_worst"
    """Which training pairs DPO trains on: one per prompt (its best–worst pair, the usual DPO data) or ``all`` the
    pairs ``validate.pairing`` built (the reward heads always train on all of them)."""


class SLAConfig(SLASearch):
    """Streaming Looking-Ahead decoding (Algorithm 2): depth d, width k, step n."""


class SLABenchmarkConfig(ClassicalDecoding):
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
    seed: int = 0
    """Seed of the sampling decoders."""
    batch_size: int = Field(32, ge=1)
    """Prompts decoded at a time, untimed: per ``generate`` call of the classical decoders (beam search holds
    ``num_beams`` rows per prompt) and per SLA search (k^d rows per prompt): lower it when decoding runs out of
    GPU memory."""
    sweep_depth: list[int] = Field(default_factory=list)
    """Optional SLA sweep (Figure 3): depths to try (e.g. [1, 3]) with the other settings at their defaults, one
    knob at a time."""
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
    """Largest step n a chosen setting may have, so that ``sla_tuned`` streams. SLA streams a committed segment every
    n tokens, so a step as long as the answer (n = max_new_tokens) is reranking whole responses, not streaming. Grid
    settings above it are still decoded and reported."""
    leaf_score_ablation: bool = False
    """Also decode the held-out prompts with ``sla_tuned`` under the other leaf score (``sla.leaf_score``'s
    alternative): the leaf-scoring ablation, untimed. Off by default since issue #34 (about 25 s of the 2-core CPU
    run's 30-minute budget, docs/sla.md); the 8B configs keep it on."""

    @model_validator(mode="after")
    def _a_streaming_setting_to_choose(self) -> SLABenchmarkConfig:
        if self.tuning_prompts > 0 and all(step > self.tuning_max_step for _, _, step in self.tuning_grid):
            raise ValueError(f"tuning_grid has no setting with step ≤ tuning_max_step ({self.tuning_max_step}) to "
                             "choose")
        return self
