"""The frozen configs of the MTP module's equip stage and MTP-RL (docs/mtp.md).

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.engine.config import DraftDtypeName

MTPInit = Literal["last_layer", "scratch"]
"""How the module's decoder layer starts: a copy of the main model's last layer, or at random."""


VariantName = Literal["vanilla", "mtp_rl", "mtp_rl_detached", "frozen_mtp", "ce_only", "no_backprop"]


@dataclass(frozen=True)
class MTPRLTraining:
    """Everything one variant's RL run reads: rollouts, the GRPO update, and the MTP loss weights."""

    steps: int = 3  # RL steps (one rollout phase and one update each)
    prompts_per_step: int = 1  # a multiple of the number of processes: each rolls out an equal share
    group_size: int = 8  # G: rollouts per prompt, advantages normalised within each group
    temperature: float = 0.8  # rollout sampling temperature (no top-k / top-p)
    max_new_tokens: int = 64  # longest rollout
    rollout_batch_size: int | None = None  # rollouts sampled together (None: a step's share in one batch)
    update_batch_size: int | None = None  # rollouts per forward/backward of the update (None: all of a step's)
    learning_rate: float = 3.0e-5  # AdamW, the policy (2e-6 left a 135M policy where it was, docs/mtp.md)
    mtp_learning_rate: float = 1.0e-4  # AdamW, the MTP module (variants that train it)
    epsilon_low: float = 0.2  # ratio clipped below at 1 − ε_low
    epsilon_high: float = 0.28  # ratio clipped above at 1 + ε_high (DAPO's clip-higher)
    iterations: int = 1  # μ: optimisation passes over each step's rollouts
    kl_beta: float = 0.0  # β of the k3 KL to the starting policy (0: no reference model)
    beta: float = 0.2  # β of eq. 4: the MTP cross-entropy's weight next to the advantage-aware KL
    ce_only_weight: float = 1.0  # the MTP cross-entropy's weight in ``ce_only``
    advantage_epsilon: float = 1.0e-4  # ε in A = (r − mean) / (std + ε)
    draft_temperature: float = 0.0  # 0: top-1 drafts; > 0: drafts sampled at this temperature
    draft_dtype: DraftDtypeName = "bfloat16"  # the drafts' precision only: never what is sampled
    adaptive: bool = True  # draft only while drafting pays (models.engine.config.Adaptation), else sample plainly
    cycle_cost: float | None = None  # a draft cycle's cost in plain steps for ``adaptive``; None: measured
    lora_rank: int = 0  # > 0: train PEFT LoRA adapters of this rank instead of the policy's weights (models/common/lora.py)
    gradient_checkpointing: bool = False  # recompute the backbone's activations in the backward pass
    seed: int = 0  # prompt order and every rollout's sampling stream (the same for every variant)


@dataclass(frozen=True)
class MTPTraining:
    """The MTP-equipped stage's training: eq. 1's weights, AdamW (β 0.9 / 0.95) with a cosine schedule."""

    ce_weights: tuple[float, ...] = (0.6, 0.3, 0.1)  # λ_1 … λ_K (the paper's); deeper depths reuse the last
    init: MTPInit = "last_layer"
    learning_rate: float = 1.0e-3  # peak rate (the paper: 5e-5 over 5 epochs of ~113k responses)
    epochs: int = 4  # the most epochs: with a held-out split, training stops when its loss stops falling
    patience: int = 1  # epochs without a new best held-out loss before training stops
    batch_size: int = 8  # sequences per step
    warmup_ratio: float = 0.1  # linear warm-up share of the steps, cosine decay after
    seed: int = 0  # shuffling and the module's initialisation
