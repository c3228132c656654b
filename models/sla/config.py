"""The frozen configs of the reward heads' training, SLA search and DPO (docs/sla.md).

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LeafScore = Literal["mean", "last"]
"""How SLA scores a leaf: ``mean`` R' over its response so far (the authors' code), or ``last``: R' at its last
token (Algorithm 2's text)."""


@dataclass(frozen=True)
class DPOTraining:
    """DPO's β and the schedule of :func:`models.sla.dpo.train_dpo`."""

    beta: float = 0.1  # DPO temperature β
    learning_rate: float = 5e-6
    epochs: int = 1
    batch_size: int = 4  # pairs per optimizer step
    max_length: int = 512  # longest prompt + response + end token; longer pairs are dropped, not cut
    lora_rank: int = 0  # > 0: train PEFT LoRA adapters of this rank instead of the weights (models/common/lora.py)
    gradient_checkpointing: bool = False  # recompute the backbone's activations in the backward pass
    seed: int = 0


@dataclass(frozen=True)
class RewardTraining:
    """How reward heads are trained and evaluated (§5: Adam at 5e-5, cosine schedule with warm-up)."""

    learning_rate: float = 5e-5
    epochs: int = 2
    batch_size: int = 4  # pairs per optimizer step (2 × that many sequences per forward)
    warmup_ratio: float = 0.1
    max_length: int = 512  # longest prompt + response + end token; longer pairs are dropped, not cut
    curve_points: int = 100  # x = 1 … 100 % of the response for the token-level reward curve
    # the frozen policy's hidden states of every distinct training sequence, kept in memory when they fit in this many
    # GB: one policy forward per sequence instead of one per sequence, pair and epoch (else the forward runs per step)
    state_cache_gb: float = 4.0
    seed: int = 0  # head initialisation and shuffling


@dataclass(frozen=True)
class SLASearch:
    """SLA(d, k, n): the shape of the look-ahead tree."""

    depth: int = 2  # d: levels searched below the committed text (0 = plain greedy)
    width: int = 2  # k: children per expanded node
    step: int = 10  # n: tokens decoded greedily per node
    leaf_score: LeafScore = "mean"  # a leaf's score: mean R' over its response so far | R' at its last token
