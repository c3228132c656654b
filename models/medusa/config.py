"""The frozen configs of Medusa-1 training and RLMedusa (docs/medusa.md).

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.common.config import MixedPrecision


@dataclass(frozen=True)
class RLMedusaCandidates:
    """RLMedusa's data collection, done during Medusa's self-distillation pass: the trajectory states and the
    candidate tokens whose t + 2 probabilities the reward model is fitted to."""

    trajectory_tokens: int = 20  # RL states per response (the paper's 20-token trajectories)
    top_candidates: int = 3  # candidates per state drawn from ranks 2 … top_pool (plus the top-1 itself)
    top_pool: int = 50  # the paper's "top-50"
    random_candidates: int = 5  # candidates per state drawn uniformly from the rest of the vocabulary


@dataclass(frozen=True)
class RLMedusaTraining:
    """RLMedusa's reward model r(e, h) and policy-gradient t + 2 head."""

    reward_width: int = 512  # hidden width of the reward network
    reward_learning_rate: float = 1e-3
    reward_epochs: int = 8
    reward_batch_size: int = 256  # states per reward-model step, each with all its candidates
    num_actions: int = 8  # G: tokens sampled per state, whose mean reward is the baseline
    beta: float = 0.5  # KL coefficient (the paper advises a small one; 0.02 let the head exploit r, docs/medusa.md)
    learning_rate: float = 1e-4  # head 1's
    epochs: int = 5
    batch_size: int = 64  # states per policy-gradient step
    seed: int = 0  # initialisation, shuffling and action sampling


Targets = Literal["greedy", "sampled"]
"""Head k's target at t + k + 1: the backbone's greedy choice there given the prefix, or the token in the data."""


@dataclass(frozen=True)
class MedusaTraining:
    """Medusa-1: the heads, their self-distilled targets and their training (AdamW, cosine schedule)."""

    num_heads: int = 4  # K: head k predicts token t + k + 1 from the hidden state at t
    num_layers: int = 1  # residual blocks per head
    untie: bool = False  # each head gets its own trainable copy of the LM head
    targets: Targets = "greedy"
    loss_decay: float = 0.8  # head k's loss weight is loss_decay^(k−1) (Medusa's 0.8)
    learning_rate: float = 1e-3  # Medusa-1's
    epochs: int = 4
    batch_size: int = 64  # positions per step
    warmup_ratio: float = 0.05
    distill_batch_size: int = 40  # sequences per batch of the frozen self-distillation pass
    max_length: int = 512  # longest prompt + response (+ end token); longer ones are dropped, not cut
    mixed_precision: MixedPrecision = "bf16"
    seed: int = 0  # initialisation, shuffling and the RL candidates
