"""The knobs of COrAL's two-stage training and its sliding blockwise decoder (Xie et al. 2024, "COrAL:
Order-Agnostic Language Modeling for Efficient Iterative Refinement", §2.2, §3, Appendix C and D; docs/coral.md).

Each knob is declared once, here (:class:`models.common.config.Knobs`): the components the model code takes
(:class:`CoralTraining`, :class:`CoralDecoding`) and the ``params.yaml`` sections that subclass them (``coral``,
``coral_benchmark``), adding only the knobs their task reads beside the model code. Pydantic and names only, no
heavy imports: loading the params never loads model code.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from models.common.config import Knobs, MixedPrecision, SFTData, TrainingLoop


class CoralDecoding(Knobs):
    """Settings of one sliding-blockwise decoder (Appendix D's are block 64, windows 4 / 8, ε 0.2)."""

    block_size: int = Field(8, ge=1)
    """b: the most tentative tokens in flight in the sliding block (the paper: 64, for 512-token GPU outputs)."""
    forward_window: int = Field(4, ge=1)
    """k_f: new positions predicted ahead of the last tentative token per step (1 = w/o multi-forward;
    ≤ coral.forward_window, the offsets the model learned)."""
    backward_window: int = Field(8, ge=0)
    """k_b: later tokens whose backward predictions refine a token, its backward dependencies in eq. 6 and eq. 8
    (≤ coral.backward_window)."""
    epsilon: float = Field(0.2, gt=0.0, lt=1.0)
    """ε of eq. 8 (the paper: 0.2 for reasoning)."""
    decay: float = Field(0.8, gt=0.0, le=1.0)
    """λ_δ = decay^|δ − 1|: the weight of a prediction made δ positions before its target (eq. 5, 6, 7), so
    next-token predictions weigh most, longer dependencies less."""
    gamma: tuple[float, ...] = (1.1, 1.2, 1.3)
    """Appendix C's confidence scaling of the 2nd, 3rd, 4th new token in the candidate tree."""
    tree_size: int = Field(8, ge=1)
    """Candidate-tree nodes besides the top-1 chain (full COrAL; ignored without the verifier)."""
    verify: bool = True
    """Select the kept path by eq. 6 + 7 over a candidate tree (full COrAL); false = the ensemble's top-1 chain
    only (the ``no_verifier`` ablation)."""
    confidence_over: Literal["window", "available"] = "window"
    """Eq. 8's denominator: window (k_b + 2, the paper's) or available (the kept path's). ``window`` = k_b + 2
    dependencies (the paper's); ``available`` = those the kept path supplies for the token (a token near the end of
    a block has few: in a block of 8, the last one's score could never pass 0.2 under ``window``)."""
    accept_next_token: bool = False
    """Accept each token with the larger of eq. 8's score and its next-token probability (COrAL's public code: a
    token is rejected only when the draw beats both); false = eq. 8 alone (the paper's Algorithm 1)."""
    seed: int = 0
    """Seeds the generator of eq. 8's acceptance draws (decoding is deterministic)."""

    def offsets(self) -> tuple[int, ...]:
        """Target offsets of the last layer: backward −k_b … 0, then forward +1 … +k_f."""
        return tuple(range(-self.backward_window, 1)) + tuple(range(1, self.forward_window + 1))

    def weight(self, distance: int) -> float:
        """λ_δ for a prediction of position j from the context ≤ j − δ."""
        return self.decay ** abs(distance - 1)


class CoralTraining(TrainingLoop):
    """COrAL's objective (Appendix D's offsets and corruption) and its two training stages."""

    forward_window: int = Field(4, ge=1, le=8)
    """k_f: forward prediction offsets +1 … +forward_window on clean sequences (Appendix D: 4)."""
    backward_window: int = Field(8, ge=0, le=16)
    """k_b: backward reconstruction offsets −backward_window … 0 on corrupted sequences (Appendix D: 8)."""
    max_patch_size: int = Field(4, ge=1)
    """Corruption granularity: each sequence's patch size is drawn in 1 … max_patch_size (Appendix D: 4)."""
    corruption_ratio: float = Field(0.25, ge=0.0, le=1.0)
    """Probability that a patch is corrupted (Appendix D: 0.25)."""
    next_token_weight: float = Field(4.0, gt=0.0)
    """Weight of offset +1 (ordinary next-token prediction) among the forward offsets, which otherwise weigh
    alike. The last layer serves every offset: on little data, learning +2 … +4 erodes next-token accuracy."""
    replace_probability: float = Field(0.5, ge=0.0, le=1.0)
    """Probability that a corrupted patch is replaced by a same-length span from elsewhere in the response.
    Otherwise its first token is repeated over it."""
    stage1_learning_rate: float = Field(1.0e-3, gt=0.0)
    """Learning rate of stage 1 (the last decoder layer only, on the frozen trunk's cached outputs). The paper's
    5e-6 suits 3 epochs of ~100k examples, not ~100; at 2e-4 for one epoch (16 steps) offsets +2 … +4 stayed at
    chance (docs/coral.md, "Two-stage training")."""
    stage1_epochs: int = Field(4, ge=0)
    """The most stage-1 epochs (0 skips the stage). Training stops earlier once the validation loss has not
    improved for ``stage1_patience`` epochs, and keeps its best epoch."""
    stage1_patience: int = Field(2, ge=1)
    """Stage-1 epochs without a new best validation loss (the objective on the validation responses) before it
    stops."""
    stage1_corruption_draws: int = Field(2, ge=1)
    """Corruptions per sequence whose trunk outputs stage 1 caches. Stage 1 trains on the frozen trunk's outputs,
    computed once: of each clean sequence and of this many corruptions of it (each a trunk forward over the data);
    epoch e trains on draw e mod this."""
    stage2_learning_rate: float = Field(1.0e-6, gt=0.0)
    """Learning rate of stage 2 (every parameter except the last decoder layer): the paper's 1e-6. Measured here:
    1e-5 pulls the trunk towards the far offsets and wrecks next-token accuracy (held-out greedy accuracy 44 % →
    6 %)."""
    stage2_epochs: int = Field(0, ge=0)
    """Stage-2 epochs (0, the default, skips the stage; 1 = the paper's recipe). At 1e-6 an epoch of ~16 steps can
    change at most 2 % of a bf16 trunk's weights, each by one rounding step (docs/coral.md, "Two-stage training")."""
    batch_size: int = Field(8, ge=1)
    """Sequences per step."""
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)
    """Linear warm-up share of each stage's steps (cosine decay after)."""
    lora_rank: int = Field(0, ge=0)
    """Rank of the PEFT LoRA adapters stage 2 trains instead of its weights (0: none, it trains them in full).
    Adapters of this rank go on every linear layer but the last decoder layer's (alpha = 2 × rank,
    models/common/lora.py) and are merged into the saved weights. What makes stage 2 fit one 80 GB GPU at 8B
    (``foresight plan``)."""
    gradient_checkpointing: bool = False
    """Recompute the policy's activations in the backward pass: less memory for ~30 % more compute."""
    seed: int = 0
    """Seeds the split, the shuffling and the corruption."""


class CoralConfig(CoralTraining):
    """COrAL order-agnostic training with target-aware RoPE (stage ``train_coral``)."""

    data: SFTData = "distilled"
    """SFT data: distilled (the distill stage's greedy responses) or correct (the samples labeled correct).
    ``distilled`` = the responses of the ``distill`` stage (the policy's greedy responses to the
    training prompts by default: what the model itself would write); ``correct`` = the generated samples the
    labeler marked correct."""
    max_length: int = Field(256, ge=8)
    """Longest prompt + response (+ end token) sequence, in tokens: a longer one is dropped, never truncated, and
    counted in the stage's ``*_dropped_too_long`` metrics."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of prompts held out for the per-offset accuracy (``data: correct`` only). ``distilled`` responses take
    the ``distill`` stage's split, so that every drafter is measured on the same held-out sequences."""
    validation_fraction: float = Field(0.15, gt=0.0, lt=1.0)
    """Share of the training prompts whose responses decide when stage 1 stops (early stopping), never trained on;
    the held-out responses the stage reports on never choose the epoch."""
    mixed_precision: MixedPrecision = "bf16"
    """accelerate's autocast for the training forward passes."""


class CoralBenchmarkConfig(CoralDecoding):
    """Sliding blockwise order-agnostic decoding and its benchmark (stage ``benchmark_coral``)."""

    num_prompts: int = Field(24, ge=1)
    """Held-out prompts decoded by next-token greedy and full COrAL (accuracy, with intervals over them). 24 on the
    2-core CPU default (40 until issue #34: about 35 s of its 30-minute budget, at accuracies near 0 for both);
    docs/study.md's study scale uses 120."""
    speed_prompts: int = Field(8, ge=1)
    """The first prompts, decoded by every decoder (the ablations too) at batch 1, interleaved: speed and its
    intervals are over these."""
    max_new_tokens: int = Field(40, ge=1)
    """Longest output."""
    ablations: list[Literal["no_verifier", "no_multi_forward"]] = Field(default_factory=lambda: ["no_verifier"])
    """Fixed ablations of full COrAL, timed on the speed prompts (no_verifier, no_multi_forward). ``no_verifier``
    accepts the forward drafts unverified; ``no_multi_forward`` has forward window 1 (~50 s on the 2-core CPU, hence
    in the study profile)."""
    ablation_block_sizes: list[int] = Field(default_factory=list)
    """Extra block sizes for COrAL w/o verifier (the speed setting), e.g. [16] (the study profile); [] (the default,
    for the time budget) skips the ablation."""
    ablation_forward_windows: list[int] = Field(default_factory=list)
    """Extra forward windows for COrAL w/o verifier, e.g. [2]; [] (the default, for the time budget) skips it."""


def decodes_what_it_learned(benchmark: CoralBenchmarkConfig, training: CoralConfig) -> None:
    """``coral_benchmark``'s decoders use only offsets the ``coral`` model learned (a ValueError naming the keys)."""
    windows = [benchmark.forward_window, *benchmark.ablation_forward_windows]
    if max(windows) > training.forward_window:
        raise ValueError(f"coral_benchmark forward windows {windows} exceed coral.forward_window "
                         f"{training.forward_window}: the model never learned those offsets")
    if benchmark.backward_window > training.backward_window:
        raise ValueError(f"coral_benchmark.backward_window {benchmark.backward_window} exceeds coral.backward_window "
                         f"{training.backward_window}: the model never learned those offsets")
    if any(w < 1 for w in windows) or any(s < 1 for s in benchmark.ablation_block_sizes):
        raise ValueError("coral_benchmark ablation block sizes and forward windows must be ≥ 1")
