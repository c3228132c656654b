"""COrAL's two-stage order-agnostic training (§2.2, §4 "two-stage training", Appendix D; docs/coral.md).

Every step runs two target-aware forwards of one batch: forward prediction (offsets +1 … +k_f) on the
clean sequences, backward reconstruction (offsets −k_b … 0) on a freshly corrupted copy, loss on the
corrupted tokens only; the step's loss is their sum. Stage 1 trains the last decoder layer alone (the
one whose queries became target-aware); stage 2 trains everything else, the last layer frozen. The
backward loss never reaches below the last layer (the reference code detaches there), so in stage 2
only forward prediction — which includes ordinary next-token SFT at offset +1 — moves the trunk, and
stage 2 skips the corrupted forward altogether.

Both stages run in the shared loop of :mod:`models.common.training`, through :class:`CoralObjective`: the
step is one call of the prepared (under DDP: wrapped) model, so gradients are all-reduced across processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.common.sequences import Sequences, padding_id, right_pad
from models.common.training import train
from models.coral.config import CoralTraining
from models.coral.target_aware import (
    backward_reconstruction_loss,
    corrupt,
    forward_prediction_loss,
    weighted_offset_loss,
)
from models.engine.policy import Policy

if TYPE_CHECKING:
    from accelerate import Accelerator



def corrupt_batch(batch: dict[str, torch.Tensor], cfg: CoralTraining, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A corrupted copy of each right-padded row's response and the mask of its changed tokens, both (B, T)."""
    corrupted, changed = batch["input_ids"].clone(), torch.zeros_like(batch["response_mask"], dtype=torch.bool)
    for row in range(len(corrupted)):
        response = batch["response_mask"][row].nonzero()
        if len(response) == 0:
            continue
        result = corrupt(batch["input_ids"][row], int(response[0]), int(response[-1]) + 1, cfg.max_patch_size,
                         cfg.corruption_ratio, cfg.replace_probability, generator)
        corrupted[row], changed[row] = result.input_ids, result.corrupted
    return corrupted, changed


def coral_step_loss(model, batch: dict[str, torch.Tensor], cfg: CoralTraining, generator: torch.Generator,
                    reconstruct: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """One step's loss, forward prediction + backward reconstruction (each a weighted mean of its offsets'
    cross-entropies; offset +1 weighs ``cfg.next_token_weight``), and every offset's cross-entropy.
    ``reconstruct=False`` skips backward reconstruction (stage 2: it cannot reach the trained parameters)."""
    forward_offsets = tuple(range(1, cfg.forward_window + 1))
    backward_offsets = tuple(range(-cfg.backward_window, 1))
    forward_per_offset, forward_counts = forward_prediction_loss(
        model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], forward_offsets)
    forward_weights = torch.tensor([cfg.next_token_weight if o == 1 else 1.0 for o in forward_offsets])
    forward_loss = weighted_offset_loss(forward_per_offset, forward_counts, forward_weights)
    stats = {"forward_loss": forward_loss.item(),
             **{f"ce_forward_{o}": v for o, v in zip(forward_offsets, _per_offset(forward_per_offset, forward_counts),
                                                    strict=True)}}
    if not reconstruct:
        return forward_loss, {"loss": forward_loss.item(), **stats}
    corrupted, changed = corrupt_batch(batch, cfg, generator)
    device = batch["input_ids"].device
    backward_per_offset, backward_counts = backward_reconstruction_loss(
        model, corrupted.to(device), batch["input_ids"], batch["attention_mask"], changed.to(device), backward_offsets)
    backward_loss = weighted_offset_loss(backward_per_offset, backward_counts, torch.ones(len(backward_offsets)))
    loss = forward_loss + backward_loss
    return loss, {"loss": loss.item(), **stats,
                  "backward_loss": backward_loss.item() if backward_counts.sum() > 0 else math.nan,
                  **{f"ce_reconstruct_{-o}": v for o, v in zip(backward_offsets,
                                                              _per_offset(backward_per_offset, backward_counts),
                                                              strict=True)}}


def _per_offset(values: torch.Tensor, counts: torch.Tensor) -> list[float]:
    """Per-offset values as floats, NaN where the offset had no target."""
    return [v if c > 0 else math.nan for v, c in zip(values.tolist(), counts.tolist(), strict=True)]


def stage_parameters(model, stage: int) -> list[torch.nn.Parameter]:
    """Stage 1: the last decoder layer's parameters; stage 2: every other parameter."""
    last = {id(p) for p in model.get_decoder().layers[-1].parameters()}
    return [p for p in model.parameters() if (id(p) in last) == (stage == 1)]


class CoralObjective(nn.Module):
    """The step's loss as a module's forward, so that it runs through the prepared model (DDP's forward)."""

    def __init__(self, model: nn.Module, cfg: CoralTraining, generator: torch.Generator, reconstruct: bool):
        super().__init__()
        self.model, self.cfg, self.generator, self.reconstruct = model, cfg, generator, reconstruct

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return coral_step_loss(self.model, batch, self.cfg, self.generator, self.reconstruct)


def train_coral(policy: Policy, sequences: Sequences, cfg: CoralTraining, accelerator: Accelerator | None = None,
                on_step: Callable[[str, int, int, dict[str, float]], None] | None = None) -> dict[str, list]:
    """Both stages on ``sequences``; the policy's model is trained in place. Returns the history: per step, the
    stage, the learning rate, the loss and every offset's cross-entropy."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not sequences:
        raise ValueError("no sequences to train COrAL on")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)  # the corruption, across both stages
    pad = padding_id(policy.tokenizer)
    history: dict[str, list] = {"stage": []}
    model = policy.model
    for stage, learning_rate, epochs in ((1, cfg.stage1_learning_rate, cfg.stage1_epochs),
                                         (2, cfg.stage2_learning_rate, cfg.stage2_epochs)):
        if epochs == 0:
            continue
        model.requires_grad_(False)
        parameters = stage_parameters(model, stage)
        for p in parameters:
            p.requires_grad_(True)
        objective = CoralObjective(model, cfg, generator, reconstruct=stage == 1).train()
        report = partial(on_step, f"stage {stage}") if on_step is not None else None
        objective, stage_history = train(
            objective, sequences, lambda objective, batch: objective(batch), parameters,
            partial(torch.optim.AdamW, lr=learning_rate, weight_decay=0.0), accelerator=accelerator, epochs=epochs,
            batch_size=cfg.batch_size, seed=cfg.seed + stage, warmup_ratio=cfg.warmup_ratio,
            collate_fn=partial(right_pad, pad_token_id=pad), desc=f"COrAL stage {stage}", on_step=report)
        model = objective.model
        history["stage"] += [stage] * len(stage_history["loss"])
        for key, values in stage_history.items():
            history.setdefault(key, []).extend(values)
    model.requires_grad_(False)
    model.eval()
    return history


@torch.no_grad()
def offset_accuracy(policy: Policy, sequences: Sequences, forward_window: int, batch_size: int = 8
                    ) -> dict[str, float]:
    """Held-out top-1 accuracy of forward prediction per offset (+1 … +k_f) on clean response tokens."""
    from models.coral.target_aware import offset_targets, target_aware_hidden

    offsets = tuple(range(1, forward_window + 1))
    lm_head = policy.model.get_output_embeddings()
    hits, counts = torch.zeros(len(offsets)), torch.zeros(len(offsets))
    for start in range(0, len(sequences), batch_size):
        batch = {k: v.to(policy.device) for k, v in right_pad(sequences[start : start + batch_size],
                                                               padding_id(policy.tokenizer)).items()}
        hidden = target_aware_hidden(policy.model, batch["input_ids"], offsets, attention_mask=batch["attention_mask"])
        targets, valid = offset_targets(batch["input_ids"], batch["response_mask"], offsets)
        rows = valid.nonzero(as_tuple=True)
        correct = (lm_head(hidden[rows]).argmax(-1) == targets[rows]).float().cpu()
        offset_index = rows[1].cpu()
        hits += torch.zeros(len(offsets)).index_add(0, offset_index, correct)
        counts += torch.bincount(offset_index, minlength=len(offsets)).float()
    return {f"top1_forward_{o}": float(h / c) if c else math.nan for o, h, c in zip(offsets, hits, counts, strict=True)}

