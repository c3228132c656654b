"""The knobs of the MTP module's equip stage and of MTP-RL (MTP-RL, Wang et al., Findings of ACL 2026: eq. 1 for
the equip stage, §3.2 eq. 2–5 and Table 6 for GRPO with MTP-drafted rollouts; docs/mtp.md), and their params.yaml
sections ``mtp`` and ``mtp_rl``.

Pydantic models and names with no heavy imports: the model code takes the components (:class:`MTPTraining`,
:class:`MTPRLTraining`), the pipeline's params sections subclass them (:class:`MTPConfig`, :class:`MTPRLConfig`),
so loading the params never loads model code.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from models.common.config import Knobs, MixedPrecision, SFTData, TrainingLoop
from models.engine.config import Adaptation, DraftDtypeName, DynamicTree

MTPInit = Literal["last_layer", "scratch"]
"""How the module's decoder layer starts: a copy of the main model's last layer, or at random."""


VariantName = Literal["vanilla", "mtp_rl", "mtp_rl_detached", "frozen_mtp", "ce_only", "no_backprop"]


class MTPRLTraining(Knobs):
    """Everything one variant's RL run reads: rollouts, the GRPO update, and the MTP loss weights."""

    steps: int = Field(3, ge=1)
    """RL steps per variant (one rollout phase and one update each)."""
    prompts_per_step: int = Field(1, ge=1)
    """Training prompts per step; each gets ``group_size`` rollouts. A multiple of the number of processes: each
    rolls out an equal share."""
    group_size: int = Field(8, ge=2)
    """G: rollouts per prompt; advantages are normalised within each group. 8: with ``prompt_filter: spread``,
    ~90 % of groups carry a gradient (the paper: 32)."""
    temperature: float = Field(0.8, gt=0.0)
    """Rollout sampling temperature (no top-k / top-p: speculative sampling preserves exactly this)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest rollout; a rollout cut off before its answer earns reward 0."""
    rollout_batch_size: int | None = Field(None, ge=1)
    """Rollouts sampled together, as a batch: vanilla by HF batched sampling, the drafting variants by batched
    speculative sampling (``models/engine/batched.py``). null: a step's share (its prompts × G) in one batch (lower
    on OOM); 1: one rollout at a time."""
    update_batch_size: int | None = Field(None, ge=1)
    """Rollouts per forward/backward of the update (gradients accumulate over a step's micro-batches, every loss
    normalised by the step's global counts, so the update is the whole batch's); null: all of a step's at once.
    What makes the paper's 8 prompts × 32 rollouts fit a GPU (``foresight plan`` proposes it)."""
    learning_rate: float = Field(3.0e-5, gt=0.0)
    """AdamW learning rate of the policy. The rollouts sample from the bf16 policy, rounded afresh from float32
    master weights before each step: an early AdamW step moves a weight by about the learning rate, and a bf16
    weight of magnitude ~0.015 has a spacing of 6e-5, so smaller rates mostly round away (2e-6 left a 135M policy
    where it was). Measured on the pipeline's policy (vanilla GRPO, 3 steps of 8 rollouts of prompts with a reward
    spread; docs/mtp.md): bf16 weights changed 0.74 % / 2.8 % / 9.0 %, KL(π₀ ‖ π) per token 0.0019 / 0.0020 /
    0.0073 at 2e-6 / 1e-5 / 3e-5. Earlier, at 1e-5, four steps of L_Adv back-propagated from a weak MTP module (CE
    ≈ 5) cut held-out accuracy from 0.44 to 0.13 (MTP-RL) and 0.31 (CE only) — when 72 % of groups had equal
    rewards, so most updates were L_Adv alone; MTP-RL's held-out accuracy at this rate is to be read from the
    stage's ``mtp_rl.accuracy_change``."""
    mtp_learning_rate: float = Field(1.0e-4, gt=0.0)
    """AdamW learning rate of the MTP module (variants that train it)."""
    epsilon_low: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip of the probability ratio (1 − ε_low)."""
    epsilon_high: float = Field(0.28, gt=0.0)
    """Upper clip of the probability ratio (1 + ε_high; DAPO's clip-higher)."""
    iterations: int = Field(1, ge=1)
    """μ: optimisation passes over each step's rollouts (1: the ratio is 1 and the clip only matters from the
    second pass)."""
    kl_beta: float = Field(0.0, ge=0.0)
    """β of the k3 KL to the starting policy (0: no reference model is kept, as in DAPO)."""
    beta: float = Field(0.2, ge=0.0)
    """β of eq. 4: the weight of the MTP cross-entropy next to the advantage-aware KL."""
    ce_only_weight: float = Field(1.0, gt=0.0)
    """Weight of the MTP cross-entropy in the ``ce_only`` baseline (the equip stage's loss)."""
    advantage_epsilon: float = Field(1.0e-4, gt=0.0)
    """ε in A = (r − mean) / (std + ε)."""
    draft_temperature: float = Field(0.0, ge=0.0)
    """0: the MTP module drafts its top-1 tokens (the paper's drafting); > 0: drafts sampled at this temperature.
    Speculative sampling keeps the rollouts exact either way; only the acceptance rate differs."""
    draft_dtype: DraftDtypeName = "bfloat16"
    """Precision of the drafts only (copies made per rollout phase): never changes what is sampled."""
    dynamic_tree: DynamicTree | None = None
    """null: the module drafts chains of K top-1 tokens (the paper's drafting, verified by speculative sampling
    against the draft law). An EAGLE-2 dynamic tree (depth, top_k, frontier, budget; ``budget: auto`` is measured
    at batch 1 at the stage's start): each rollout drafts its own tree of the module's top-k tokens, verified by
    the tree rule (SpecInfer's, point-mass drafts: exact in distribution, ``models.engine.speculative.
    verify_tree_rows``); ``draft_temperature`` must then be 0. τ then counts tree cycles."""
    adaptive: bool = True
    """Drafted rollouts draft only while drafting pays: where the last cycles gained fewer tokens than a cycle
    costs in plain forwards (measured in the run), they sample plainly, probing again after a few tokens, then
    ever fewer (``models.engine.config.Adaptation``, set by ``adaptation``); one decision state per variant,
    carried from rollout to rollout. Exact in distribution either way; τ counts the draft cycles only."""
    adaptation: Adaptation = Field(default_factory=Adaptation)
    """When ``adaptive`` drafted rollouts draft: the rule's window, probing gaps and a draft cycle's cost. Its
    ``cycle_cost``: a draft cycle's cost in plain sampling steps; null: measured as the rollouts run (then which
    steps draft depends on timing, and so do the exact tokens sampled, though never their distribution); a number
    (~2 for K = 3 on the 2-core CPU) makes the rollouts repeat exactly under the seed."""
    lora_rank: int = Field(0, ge=0)
    """0: train the policy in full. > 0: train PEFT LoRA adapters of this rank on every linear layer instead
    (alpha = 2 × rank, models/common/lora.py); the frozen reference is the same model with its adapters disabled
    (no second copy), and the adapters are merged into the saved weights. What makes 8B fit one 80 GB GPU
    (``foresight plan``)."""
    gradient_checkpointing: bool = False
    """Recompute the policy's (the backbone's) activations in the backward pass: less memory for ~30 % more
    compute."""
    seed: int = 0
    """Seeds the prompt order and every rollout's sampling stream (the same streams for every variant)."""

    @model_validator(mode="after")
    def _tree_drafts_are_top_k(self) -> MTPRLTraining:
        if self.dynamic_tree is not None and self.draft_temperature > 0:
            raise ValueError(f"mtp_rl.dynamic_tree drafts the module's top-k tokens; draft_temperature "
                             f"{self.draft_temperature} samples chain drafts only (set it to 0, or dynamic_tree to null)")
        return self


class MTPTraining(TrainingLoop):
    """The MTP-equipped stage's training: eq. 1's weights, AdamW (β 0.9 / 0.95) with a cosine schedule."""

    ce_weights: tuple[float, ...] = Field((0.6, 0.3, 0.1), min_length=1)
    """λ_1 … λ_K of eq. 1 (the paper's: 0.6 / 0.3 / 0.1); deeper depths reuse the last weight."""
    init: MTPInit = "last_layer"
    """How the module starts. ``last_layer``: as the identity on the normed hidden state — its decoder layer a copy
    of the policy's last layer with both output projections zeroed, its projection passing the hidden half through
    (docs/mtp.md#mtp-module); ``scratch`` = random (the paper's choice, for ~100k training responses, not ~100)."""
    learning_rate: float = Field(1.0e-3, gt=0.0)
    """AdamW (β 0.9 / 0.95) peak learning rate (the paper: 5e-5 over 5 epochs of ~113k responses: ~70k steps; the
    default data make ~16 steps an epoch, where 5e-4 over 2 epochs left the loss falling steeply, docs/mtp.md)."""
    epochs: int = Field(6, ge=1)
    """The most passes over the training responses: with a held-out split, training stops earlier once the
    held-out loss has not fallen for ``patience`` epochs, and keeps the best epoch's module. The default data (354
    training responses, draft vocabulary 8,192): 4 epochs left the validation loss falling (1.78 → 1.65 in the
    last) at held-out expected τ 1.905 (task text 3.00); 6 reach 1.57 (1.60 → 1.57 in the last) and τ 2.00 (task
    3.19, general 1.36), in less time than 4 over the whole vocabulary took."""
    patience: int = Field(1, ge=1)
    """Epochs without a new best held-out loss (eq. 1 on the held-out responses) before training stops."""
    batch_size: int = Field(8, ge=1)
    """Sequences per step."""
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    """Linear warm-up share of the steps (cosine decay after)."""
    seed: int = 0
    """Seeds the split, the shuffling and the module's initialisation."""


class MTPConfig(MTPTraining):
    """The MTP-equipped stage (stage ``train_mtp``): a shared-parameter MTP module on the frozen policy."""

    data: SFTData = "distilled"
    """Self-distilled data: ``distilled`` = the policy's greedy responses of the ``distill`` stage;
    ``correct`` = the generated samples the labeler marked correct."""
    further_prompts: bool = True
    """``data: distilled``: learn from the greedy responses to the further task prompts too, which the ``distill``
    stage wrote for Medusa's heads (``distill.task_prompts``), so that the module sees the text Medusa's heads see. Measured
    on the default data (docs/mtp.md, "Budgets"): 109 → 354 training responses raised held-out depth-1 top-1 on task
    text from 0.65 to 0.83 (Medusa head 1: 0.73) and the expected τ from 2.24 to 2.90."""
    samples_per_prompt: int = Field(0, ge=0)
    """``data: distilled``: also learn from this many of each training prompt's sampled responses (the ``generate``
    stage's, at ``generate.temperature``: the text GRPO's rollouts are), except those of the prompts the distilled
    split holds out; 0: greedy text alone. A module trained on greedy text alone drafts badly where a sampled token
    has left the greedy path: on T 0.8 rollouts its depth-1 top-1 draft was the policy's top-1 at 52 % of the
    positions (88 % on greedy text) and passed speculative sampling 44 % of the time, where the policy's own top-1
    would pass 71 %."""
    num_depths: int = Field(3, ge=1, le=8)
    """K: chained predictions per draft, one shared layer applied K times (the paper: 3)."""
    max_length: int = Field(256, ge=8)
    """Longest prompt + response (+ end token) sequence, in tokens: a longer one is dropped, never truncated, and
    counted in the stage's ``*_dropped_too_long`` metrics."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of prompts held out for early stopping, the per-depth accuracy and the expected acceptance length, with
    ``data: correct``; ``distilled`` responses take the ``distill`` stage's split, so that every drafter is measured on
    the same held-out sequences."""
    validation_fraction: float = Field(0.15, gt=0.0, lt=1.0)
    """Share of the training prompts whose responses decide when training stops (early stopping), never trained on;
    the held-out responses the stage reports on never choose the epoch."""
    ablation_depths: list[Annotated[int, Field(ge=1, le=8)]] = Field(default_factory=list)
    """Further K trained the same way for Table 2's ablation (expected initial τ per K), e.g. [1, 2, 4] (the study
    profile: ~90 s more on a 2-core CPU); [] skips it."""
    data_curve: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list)
    """Training-response counts of the data curve: for each n, a module trained as the main one on n of its training
    responses (the first n of a seeded shuffle, task and general mixed as in the whole set) and measured on the
    same held-out responses, per prompt set (``data_curve.csv`` / ``.png``, metrics ``data_curve_<n>_…``; the main
    module is the last point): does acceptance still rise with more of the policy's text? [] (the default: each
    point is another training run) skips it; the study profile's recipe sets it (docs/study.md)."""
    draft_vocab_size: int | None = Field(8192, ge=1)
    """Tokens a draft may take, saved with the module: the most frequent of the training responses (EAGLE-3's draft
    vocabulary). The dynamic-tree drafter then reads that many rows of the LM head instead of the whole vocabulary
    (49,152 for SmolLM2: 2.3 ms per draft depth on the 2-core CPU against 0.5 ms for 8,192); a token outside it is
    never drafted, the output is unchanged. null: the whole vocabulary."""
    mixed_precision: MixedPrecision = "bf16"
    """accelerate's autocast for the training forward passes."""

    @model_validator(mode="after")
    def _samples_join_distilled_data(self) -> MTPConfig:
        if self.samples_per_prompt and self.data != "distilled":
            raise ValueError(f"mtp.samples_per_prompt ({self.samples_per_prompt}) adds sampled responses to the "
                             f"distilled ones; with mtp.data: {self.data} set it to 0")
        return self


class MTPRLConfig(MTPRLTraining):
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

    @model_validator(mode="after")
    def _variants_listed_once(self) -> MTPRLConfig:
        if not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"mtp_rl.variants must name at least one variant, each once, got {self.variants}")
        return self
