"""The frozen configs of COrAL's two-stage training and its sliding blockwise decoder (docs/coral.md).

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoralDecoding:
    """Settings of one sliding-blockwise decoder (Appendix D's are block 64, windows 4 / 8, ε 0.2)."""

    block_size: int = 8  # b: the most tentative tokens in flight
    forward_window: int = 4  # k_f: new positions predicted ahead of the last tentative token (1 = w/o multi-forward)
    backward_window: int = 8  # k_b: later tokens whose backward predictions refine a token
    epsilon: float = 0.2  # ε of eq. 8
    decay: float = 0.8  # λ_δ = decay^|δ − 1|: next-token predictions weigh most, longer dependencies less
    gamma: tuple[float, ...] = (1.1, 1.2, 1.3)  # Appendix C scaling of the 2nd, 3rd, 4th new token's confidence
    tree_size: int = 8  # candidate nodes besides the top-1 chain (ignored without the verifier)
    verify: bool = True  # eq. 6 + 7 selection over a candidate tree; False = the ensemble's top-1 chain only
    # Eq. 8's denominator: "window" = k_b + 2 dependencies (the paper's), "available" = those the path supplies (a
    # token near a block's end has few: in a block of 8, the last one's score could never pass 0.2 otherwise).
    confidence_over: str = "window"
    # Accept a token with the larger of eq. 8's score and its next-token probability (COrAL's public code rejects a
    # token only when the draw beats both); False: eq. 8 alone (the paper's Algorithm 1).
    accept_next_token: bool = False
    seed: int = 0  # the generator of eq. 8's acceptance draws

    def offsets(self) -> tuple[int, ...]:
        """Target offsets of the last layer: backward −k_b … 0, then forward +1 … +k_f."""
        return tuple(range(-self.backward_window, 1)) + tuple(range(1, self.forward_window + 1))

    def weight(self, distance: int) -> float:
        """λ_δ for a prediction of position j from the context ≤ j − δ."""
        return self.decay ** abs(distance - 1)


@dataclass(frozen=True)
class CoralTraining:
    """COrAL's objective (Appendix D's offsets and corruption) and its two training stages."""

    forward_window: int = 4  # k_f: forward prediction offsets +1 … +k_f on clean sequences
    backward_window: int = 8  # k_b: backward reconstruction offsets −k_b … 0 on corrupted sequences
    max_patch_size: int = 4  # each sequence's corruption patch size is drawn in 1 … max_patch_size
    corruption_ratio: float = 0.25  # probability that a patch is corrupted
    # Offset +1 (next-token prediction) outweighs the other forward offsets: the last layer serves every
    # offset, and on little data learning +2 … +4 erodes next-token accuracy.
    next_token_weight: float = 4.0
    replace_probability: float = 0.5  # a corrupted patch is another span of the response, else its first token repeated
    # The paper's 5e-6 suits 3 epochs of ~100k examples, not ~100 (docs/coral.md, "Two-stage training").
    stage1_learning_rate: float = 1.0e-3
    stage1_epochs: int = 4  # the last decoder layer only: the most epochs (early stopping on held-out data); 0 skips
    stage1_patience: int = 2  # epochs without a new best validation loss before stage 1 stops
    # Corruptions per sequence whose trunk outputs stage 1 caches; epoch e trains on draw e mod this.
    stage1_corruption_draws: int = 2
    # The paper's 1e-6: 1e-5 pulls the trunk towards the far offsets and wrecks next-token accuracy.
    stage2_learning_rate: float = 1.0e-6
    # Every parameter but the last decoder layer; 0 (the default) skips the stage: at 1e-6 one epoch (~16 steps)
    # can change at most 2 % of a bf16 trunk's weights, by one rounding step (docs/coral.md, "Two-stage training").
    stage2_epochs: int = 0
    batch_size: int = 8  # sequences per step
    warmup_ratio: float = 0.1  # linear warm-up share of each stage's steps, cosine decay after
    lora_rank: int = 0  # > 0: train PEFT LoRA adapters of this rank instead of stage 2's weights (models/common/lora.py)
    gradient_checkpointing: bool = False  # recompute the backbone's activations in the backward pass
    seed: int = 0  # shuffling and corruption
