"""COrAL's two-stage order-agnostic training (§2.2, §4 "two-stage training", Appendix D; docs/coral.md).

Every step runs two target-aware forwards of one batch: forward prediction (offsets +1 … +k_f) on the
clean sequences, backward reconstruction (offsets −k_b … 0) on a freshly corrupted copy, loss on the
corrupted tokens only; the step's loss is their sum. Stage 1 trains the last decoder layer alone (the
one whose queries became target-aware); stage 2 trains everything else, the last layer frozen. The
backward loss never reaches below the last layer (the reference code detaches there), so in stage 2
only forward prediction — which includes ordinary next-token SFT at offset +1 — moves the trunk, and
stage 2 skips the corrupted forward altogether.

Both stages run in the shared loop of :mod:`models.common.training`, through :class:`CoralObjective`: the
step is one call of the prepared (under DDP: wrapped) model, so gradients are all-reduced across processes,
and a half-precision policy trains float32 master weights (stage 2's 1e-6 steps would round away in bf16).
Stage 2 honours the memory knobs (``lora_rank``, ``gradient_checkpointing``; :mod:`models.common.lora`):
LoRA adapters on every linear layer but the last decoder layer's, merged into the weights afterwards.
Stage 1 needs neither: it trains one layer and keeps no activations below it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.common.lora import memory_saving, merged
from models.common.sequences import Sequences, padding_id, right_pad
from models.common.training import train
from models.coral.config import CoralTraining
from models.coral.target_aware import (
    backward_reconstruction_loss,
    corrupt,
    forward_prediction_loss,
    logit_chunks,
    weighted_offset_loss,
)
from models.engine.policy import Policy

if TYPE_CHECKING:
    from accelerate import Accelerator


def corruption_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The draws corrupting sequence ``index`` in ``epoch``: fresh each epoch, and the same whichever process
    and batch the sequence lands in (one generator per process would corrupt each rank's rows alike, and a
    batch split across processes differently from one process's). On the CPU, like the corruption itself."""
    return torch.Generator().manual_seed(hash((seed, epoch, index)) % 2**63)


def corrupt_batch(batch: dict[str, torch.Tensor], cfg: CoralTraining, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A corrupted copy of each right-padded row's response and the mask of its changed tokens, both (B, T), on
    the CPU. The patch loop runs on the CPU on purpose: on a GPU each of its small steps would synchronise."""
    input_ids, response_mask = batch["input_ids"].cpu(), batch["response_mask"].cpu()
    corrupted, changed = input_ids.clone(), torch.zeros_like(response_mask, dtype=torch.bool)
    for row, index in enumerate(batch["index"].tolist()):
        response = response_mask[row].nonzero()
        if len(response) == 0:
            continue
        result = corrupt(input_ids[row], int(response[0]), int(response[-1]) + 1, cfg.max_patch_size,
                         cfg.corruption_ratio, cfg.replace_probability, corruption_generator(cfg.seed, epoch, index))
        corrupted[row], changed[row] = result.input_ids, result.corrupted
    return corrupted, changed


def coral_step_loss(model, batch: dict[str, torch.Tensor], cfg: CoralTraining, epoch: int,
                    reconstruct: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """One step's loss, forward prediction + backward reconstruction (each a weighted mean of its offsets'
    cross-entropies; offset +1 weighs ``cfg.next_token_weight``), and every offset's cross-entropy.
    ``batch`` holds :func:`right_pad`'s tensors and each row's ``index`` in the data (its corruption's key).
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
    corrupted, changed = corrupt_batch(batch, cfg, epoch)
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


def last_layer_pattern(model) -> str:
    """A regex of the last decoder layer's module names (``model.layers.31.`` in Llama-3-8B, escaped): what
    stage 2's LoRA adapters leave out."""
    last = model.get_decoder().layers[-1]
    name = next(name for name, module in model.named_modules() if module is last)
    return re.escape(name) + r"\."


class CoralObjective(nn.Module):
    """The step's loss as a module's forward, so that it runs through the prepared model (DDP's forward).
    ``epoch`` (set between epochs) keys the corruption."""

    def __init__(self, model: nn.Module, cfg: CoralTraining, reconstruct: bool):
        super().__init__()
        self.model, self.cfg, self.reconstruct, self.epoch = model, cfg, reconstruct, 0

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return coral_step_loss(self.model, batch, self.cfg, self.epoch, self.reconstruct)


def _collate(items: list[tuple[int, tuple[list[int], list[int]]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """(index, sequence) pairs as a right-padded batch with each row's ``index`` (N,)."""
    indices, sequences = zip(*items, strict=True)
    return {**right_pad(sequences, pad_token_id), "index": torch.tensor(indices)}


def _run_stage(model: nn.Module, *, stage: int, parameters: list[nn.Parameter], data: list, cfg: CoralTraining,
               accelerator: Accelerator, pad_token_id: int, on_step: Callable[[int, int, dict[str, float]], None] | None
               ) -> tuple[nn.Module, dict[str, list[float]]]:
    """One stage in the shared loop; returns the trained model (unwrapped) and the stage's history."""
    learning_rate, epochs = ((cfg.stage1_learning_rate, cfg.stage1_epochs) if stage == 1
                             else (cfg.stage2_learning_rate, cfg.stage2_epochs))
    objective = CoralObjective(model, cfg, reconstruct=stage == 1).train()

    def next_epoch(epoch: int) -> None:
        objective.epoch = epoch + 1

    objective, history = train(
        objective, data, lambda prepared, batch: prepared(batch), parameters,
        partial(torch.optim.AdamW, lr=learning_rate, weight_decay=0.0), accelerator=accelerator, epochs=epochs,
        batch_size=cfg.batch_size, seed=cfg.seed + stage, warmup_ratio=cfg.warmup_ratio,
        collate_fn=partial(_collate, pad_token_id=pad_token_id), desc=f"COrAL stage {stage}", on_step=on_step,
        on_epoch_end=next_epoch)
    return objective.model, history


def train_coral(policy: Policy, sequences: Sequences, cfg: CoralTraining, accelerator: Accelerator | None = None,
                on_step: Callable[[str, int, int, dict[str, float]], None] | None = None) -> dict[str, list]:
    """Both stages on ``sequences``; ``policy.model`` ends trained (with ``lora_rank``: the adapters merged into
    it, a plain model again), in its own dtype. Returns the history: per step, the stage, the learning rate, the
    loss and every offset's cross-entropy."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not sequences:
        raise ValueError("no sequences to train COrAL on")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)
    data = list(enumerate(sequences))
    history: dict[str, list] = {"stage": []}
    for stage, epochs in ((1, cfg.stage1_epochs), (2, cfg.stage2_epochs)):
        if epochs == 0:
            continue
        run = partial(_run_stage, stage=stage, data=data, cfg=cfg, accelerator=accelerator,
                      pad_token_id=padding_id(policy.tokenizer),
                      on_step=partial(on_step, f"stage {stage}") if on_step is not None else None)
        policy.model.requires_grad_(False)
        policy.model, stage_history = (_train_last_layer(policy.model, run) if stage == 1
                                       else _train_trunk(policy.model, cfg, run))
        history["stage"] += [stage] * len(stage_history["loss"])
        for key, values in stage_history.items():
            history.setdefault(key, []).extend(values)
    policy.model.requires_grad_(False)
    policy.model.eval()
    return history


def _train_last_layer(model: nn.Module, run: Callable) -> tuple[nn.Module, dict[str, list[float]]]:
    """Stage 1: the last decoder layer's own weights."""
    parameters = stage_parameters(model, 1)
    for p in parameters:
        p.requires_grad_(True)
    return run(model, parameters=parameters)


def _train_trunk(model: nn.Module, cfg: CoralTraining, run: Callable) -> tuple[nn.Module, dict[str, list[float]]]:
    """Stage 2: every other weight, or (``lora_rank`` > 0) adapters on every linear layer but the last decoder
    layer's, merged into the weights at the end; under gradient checkpointing if asked."""
    with memory_saving(model, cfg.lora_rank, cfg.gradient_checkpointing,
                       exclude=[last_layer_pattern(model)]) as trained:
        if cfg.lora_rank == 0:
            for p in stage_parameters(trained, 2):
                p.requires_grad_(True)
        parameters = [p for p in trained.parameters() if p.requires_grad]  # with LoRA: the adapters alone
        trained, history = run(trained, parameters=parameters)
    return merged(trained), history


@torch.no_grad()
def offset_hits(policy: Policy, sequences: Sequences, forward_window: int, batch_size: int = 8
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out top-1 hits of forward prediction per sequence and offset (+1 … +k_f) on clean response tokens:
    ``hits`` and ``counts`` (targets), both (S, k_f). Per sequence, so that the accuracy Σ hits / Σ counts can
    get an interval over sequences (the tokens of one response are not independent units)."""
    from models.coral.target_aware import offset_targets, target_aware_hidden

    offsets = tuple(range(1, forward_window + 1))
    lm_head = policy.model.get_output_embeddings()
    hits, counts = torch.zeros(len(sequences), len(offsets)), torch.zeros(len(sequences), len(offsets))
    for start in range(0, len(sequences), batch_size):
        batch = {k: v.to(policy.device) for k, v in right_pad(sequences[start : start + batch_size],
                                                               padding_id(policy.tokenizer)).items()}
        hidden = target_aware_hidden(policy.model, batch["input_ids"], offsets, attention_mask=batch["attention_mask"])
        targets, valid = offset_targets(batch["input_ids"], batch["response_mask"], offsets)
        rows = valid.nonzero(as_tuple=True)  # (sequence, offset, position) of every target
        predicted = torch.cat([lm_head(chunk).argmax(-1) for chunk in logit_chunks(hidden[rows])])  # (N,)
        correct = (predicted == targets[rows]).float().cpu()
        cell = (rows[0].cpu() + start) * len(offsets) + rows[1].cpu()  # flat (sequence, offset) index
        hits.view(-1).index_add_(0, cell, correct)
        counts.view(-1).index_add_(0, cell, torch.ones_like(correct))
    return hits, counts
