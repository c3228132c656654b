"""COrAL's two-stage order-agnostic training (§2.2, §4 "two-stage training", Appendix D; docs/coral.md).

Every step runs two target-aware forwards of one batch: forward prediction (offsets +1 … +k_f) on the
clean sequences, backward reconstruction (offsets −k_b … 0) on a corrupted copy, loss on the corrupted
tokens only; the step's loss is their sum. Stage 1 trains the last decoder layer alone (the one whose
queries became target-aware), so the frozen trunk's outputs — of the clean sequences and of a few fixed
corruption draws — are computed once (:class:`TrunkCache`) and each step runs the last layer alone; with
validation sequences it stops early on their loss. Stage 2 trains everything else, the last layer frozen.
The backward loss never reaches below the last layer (the reference code detaches there), so in stage 2
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.common.lora import memory_saving, merged
from models.common.sequences import Sequences, padding_id, right_pad
from models.common.training import EarlyStopping, half_dtype, held_out_mean, step_precision, train
from models.coral.config import CoralTraining
from models.coral.target_aware import (
    backward_reconstruction_loss,
    corrupt,
    forward_prediction_loss,
    last_layer_inputs,
    logit_chunks,
    offset_targets,
    target_aware_hidden,
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


HELD_OUT_KEY = -1
"""The corruption key of held-out sequences: one fixed draw per sequence, never one a training epoch uses (0, 1, …)."""


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


@dataclass(frozen=True)
class CachedBatch:
    """A batch's trunk outputs from a :class:`TrunkCache`, right-padded like its ids."""

    clean: torch.Tensor  # (B, T, H) of the clean sequences
    corrupted_ids: torch.Tensor  # (B, T) the epoch's corruption draw
    changed: torch.Tensor  # (B, T) bool: its changed tokens
    corrupted: torch.Tensor  # (B, T, H) of the corrupted sequences


@dataclass(frozen=True)
class TrunkCache:
    """The frozen trunk's outputs (the last decoder layer's inputs) of every sequence, computed once: stage 1
    trains the last layer alone, so they never change. Of the clean sequence, and of one corruption per key in
    ``keys``; epoch e reads the draw of ``keys[e % len(keys)]`` (training: keys 0 … D − 1, so with D ≥ epochs
    every epoch draws afresh, exactly as without the cache; held-out: the one key :data:`HELD_OUT_KEY`)."""

    keys: tuple[int, ...]
    clean: list[torch.Tensor]  # per sequence (T_j, H)
    corrupted_ids: list[list[torch.Tensor]]  # [draw][sequence] (T_j,)
    changed: list[list[torch.Tensor]]  # [draw][sequence] (T_j,) bool
    corrupted: list[list[torch.Tensor]]  # [draw][sequence] (T_j, H)

    def batch(self, indices: Sequence[int], epoch: int, length: int, device: torch.device) -> CachedBatch:
        """The rows ``indices`` (sequences' indices in the data), padded to ``length`` (zeros past each sequence)."""
        draw = epoch % len(self.keys)

        def stack(rows: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([nn.functional.pad(rows[i], (0, 0) * (rows[i].dim() - 1) + (0, length - len(rows[i])))
                                for i in indices]).to(device)

        return CachedBatch(stack(self.clean), stack(self.corrupted_ids[draw]), stack(self.changed[draw]),
                           stack(self.corrupted[draw]))


@torch.no_grad()
def trunk_cache(model, sequences: Sequences, cfg: CoralTraining, keys: Sequence[int], pad_token_id: int,
                accelerator: Accelerator) -> TrunkCache:
    """The trunk's outputs of ``sequences`` (sequence i has index i) and of their corruptions keyed ``keys``, each
    kept in the trunk's dtype on the CPU (B · T · H values per draw; at 8B with many sequences, more than RAM).
    Computed in the training step's precision, so that a cached step equals an uncached one."""
    device, half = next(model.parameters()).device, half_dtype(model)
    clean: list[torch.Tensor] = []
    corrupted_ids, changed, corrupted = ([[] for _ in keys] for _ in range(3))
    for start in range(0, len(sequences), cfg.batch_size):
        chunk = sequences[start : start + cfg.batch_size]
        batch = {**right_pad(chunk, pad_token_id), "index": torch.arange(start, start + len(chunk))}
        lengths = [len(ids) for ids, _ in chunk]
        mask = batch["attention_mask"].to(device)
        with step_precision(accelerator, half):
            clean += _rows(last_layer_inputs(model, batch["input_ids"].to(device), mask), lengths)
            for draw, key in enumerate(keys):
                ids, changes = corrupt_batch(batch, cfg, key)
                corrupted_ids[draw] += _rows(ids, lengths)
                changed[draw] += _rows(changes, lengths)
                corrupted[draw] += _rows(last_layer_inputs(model, ids.to(device), mask), lengths)
    return TrunkCache(tuple(keys), clean, corrupted_ids, changed, corrupted)


def _rows(padded: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Each row of a right-padded (B, T, …) tensor cut to its sequence's length, on the CPU."""
    return [row[:length].cpu() for row, length in zip(padded, lengths, strict=True)]


def coral_step_loss(model, batch: dict[str, torch.Tensor], cfg: CoralTraining, epoch: int,
                    reconstruct: bool = True, cache: TrunkCache | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One step's loss, forward prediction + backward reconstruction (each a weighted mean of its offsets'
    cross-entropies; offset +1 weighs ``cfg.next_token_weight``), and every offset's cross-entropy.
    ``batch`` holds :func:`right_pad`'s tensors and each row's ``index`` in the data (its corruption's key).
    ``reconstruct=False`` skips backward reconstruction (stage 2: it cannot reach the trained parameters).
    ``cache``: the trunk's outputs of the data (stage 1): only the last layer runs, on the cached corruptions."""
    forward_offsets = tuple(range(1, cfg.forward_window + 1))
    backward_offsets = tuple(range(-cfg.backward_window, 1))
    device = batch["input_ids"].device
    cached = (cache.batch(batch["index"].tolist(), epoch, batch["input_ids"].shape[1], device)
              if cache is not None else None)
    forward_per_offset, forward_counts = forward_prediction_loss(
        model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], forward_offsets,
        layer_input=cached.clean if cached else None)
    forward_weights = torch.tensor([cfg.next_token_weight if o == 1 else 1.0 for o in forward_offsets])
    forward_loss = weighted_offset_loss(forward_per_offset, forward_counts, forward_weights)
    stats = {"forward_loss": forward_loss.item(),
             **{f"ce_forward_{o}": v for o, v in zip(forward_offsets, _per_offset(forward_per_offset, forward_counts),
                                                    strict=True)}}
    if not reconstruct:
        return forward_loss, {"loss": forward_loss.item(), **stats}
    corrupted, changed = (cached.corrupted_ids, cached.changed) if cached else corrupt_batch(batch, cfg, epoch)
    backward_per_offset, backward_counts = backward_reconstruction_loss(
        model, corrupted.to(device), batch["input_ids"], batch["attention_mask"], changed.to(device), backward_offsets,
        layer_input=cached.corrupted if cached else None)
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
    ``epoch`` (set between epochs) keys the corruption; ``cache``: the trunk's outputs of the data (stage 1)."""

    def __init__(self, model: nn.Module, cfg: CoralTraining, reconstruct: bool, cache: TrunkCache | None = None):
        super().__init__()
        self.model, self.cfg, self.reconstruct, self.cache, self.epoch = model, cfg, reconstruct, cache, 0

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        return coral_step_loss(self.model, batch, self.cfg, self.epoch, self.reconstruct, self.cache)

    def get_extra_state(self) -> torch.Tensor:
        """The epoch travels in the state dict, so a run resumed from a checkpoint (models/common/training.py)
        corrupts as the interrupted one did."""
        return torch.tensor(self.epoch)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.epoch = int(state)


def held_out_loss(sequences: Sequences, cfg: CoralTraining, cache: TrunkCache, pad_token_id: int
                  ) -> Callable[[nn.Module], float]:
    """Stage 1's objective (forward prediction + backward reconstruction) of a model on held-out ``sequences`` from
    their cached trunk outputs (one fixed corruption each), averaged over sequences: what early stopping watches."""
    batches = [_collate(list(enumerate(sequences[start : start + cfg.batch_size], start=start)), pad_token_id)
               for start in range(0, len(sequences), cfg.batch_size)]

    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        device = next(model.parameters()).device
        return coral_step_loss(model, {k: v.to(device) for k, v in batch.items()}, cfg, 0, cache=cache)

    return held_out_mean(step, batches, lambda batch: len(batch["index"]))


def _collate(items: list[tuple[int, tuple[list[int], list[int]]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """(index, sequence) pairs as a right-padded batch with each row's ``index`` (N,)."""
    indices, sequences = zip(*items, strict=True)
    return {**right_pad(sequences, pad_token_id), "index": torch.tensor(indices)}


def _run_stage(model: nn.Module, *, stage: int, parameters: list[nn.Parameter], data: list, cfg: CoralTraining,
               accelerator: Accelerator, pad_token_id: int, on_step: Callable[[int, int, dict[str, float]], None] | None,
               cache: TrunkCache | None = None, early_stopping: EarlyStopping | None = None
               ) -> tuple[nn.Module, dict[str, list[float]]]:
    """One stage in the shared loop; returns the trained model (unwrapped) and the stage's history."""
    learning_rate, epochs = ((cfg.stage1_learning_rate, cfg.stage1_epochs) if stage == 1
                             else (cfg.stage2_learning_rate, cfg.stage2_epochs))
    objective = CoralObjective(model, cfg, reconstruct=stage == 1, cache=cache).train()

    def next_epoch(epoch: int) -> None:
        objective.epoch = epoch + 1

    objective, history = train(
        objective, data, lambda prepared, batch: prepared(batch), parameters,
        partial(torch.optim.AdamW, lr=learning_rate, weight_decay=0.0), accelerator=accelerator, epochs=epochs,
        batch_size=cfg.batch_size, seed=cfg.seed + stage, warmup_ratio=cfg.warmup_ratio,
        collate_fn=partial(_collate, pad_token_id=pad_token_id), desc=f"COrAL stage {stage}", on_step=on_step,
        on_epoch_end=next_epoch, loop=cfg,
        early_stopping=replace(early_stopping, held_out_loss=lambda o: early_stopping.held_out_loss(o.model))
        if early_stopping is not None else None)
    return objective.model, history


PER_EPOCH = ("held_out_loss", "best_epoch")
"""The shared loop's early-stopping entries (per epoch, once): kept apart from the per-step history, prefixed
``stage1_``."""


def train_coral(policy: Policy, sequences: Sequences, cfg: CoralTraining, accelerator: Accelerator | None = None,
                on_step: Callable[[str, int, int, dict[str, float]], None] | None = None,
                validation: Sequences = (),
                on_trained: Callable[[int, nn.Module], None] | None = None) -> dict[str, list]:
    """Both stages on ``sequences``; ``policy.model`` ends trained (with ``lora_rank``: the adapters merged into
    it, a plain model again), in its own dtype. ``on_trained(stage, model)`` runs after each stage's training with the
    model it trained, before stage 2's adapters are merged away (what trained, and the adapters, are read there).
    Stage 1 runs on the trunk's cached outputs (:class:`TrunkCache`,
    ``stage1_corruption_draws`` corruptions per sequence) and, given ``validation`` sequences (never trained on),
    stops early on their loss (``stage1_patience``), keeping its best epoch. Returns the history: per step, the
    stage, the learning rate, the loss and every offset's cross-entropy; with ``validation``,
    ``stage1_held_out_loss`` (on them) per epoch and ``stage1_best_epoch``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not sequences:
        raise ValueError("no sequences to train COrAL on")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu",
                                             gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    set_seed(cfg.seed)
    data = list(enumerate(sequences))
    pad = padding_id(policy.tokenizer)
    history: dict[str, list] = {"stage": []}
    for stage, epochs in ((1, cfg.stage1_epochs), (2, cfg.stage2_epochs)):
        if epochs == 0:
            continue
        run = partial(_run_stage, stage=stage, data=data, cfg=cfg, accelerator=accelerator, pad_token_id=pad,
                      on_step=partial(on_step, f"stage {stage}") if on_step is not None else None)
        policy.model.requires_grad_(False)
        trained_hook = partial(on_trained, stage) if on_trained is not None else None
        policy.model, stage_history = (
            _train_last_layer(policy.model, sequences, validation, cfg, pad, accelerator, run, trained_hook)
            if stage == 1 else _train_trunk(policy.model, cfg, run, trained_hook))
        history["stage"] += [stage] * len(stage_history["loss"])
        for key, values in stage_history.items():
            if key in PER_EPOCH:
                history[f"stage1_{key}"] = values
            else:
                history.setdefault(key, []).extend(values)
    policy.model.requires_grad_(False)
    policy.model.eval()
    return history


def _train_last_layer(model: nn.Module, sequences: Sequences, validation: Sequences, cfg: CoralTraining, pad: int,
                      accelerator: Accelerator, run: Callable,
                      on_trained: Callable[[nn.Module], None] | None) -> tuple[nn.Module, dict[str, list[float]]]:
    """Stage 1: the last decoder layer's own weights, on the trunk's cached outputs; early stopping on
    ``validation`` (if any) with its own cache (one fixed corruption per sequence)."""
    cache = trunk_cache(model, sequences, cfg, range(cfg.stage1_corruption_draws), pad, accelerator)
    early_stopping = None
    if validation:
        validation_cache = trunk_cache(model, validation, cfg, (HELD_OUT_KEY,), pad, accelerator)
        early_stopping = EarlyStopping(held_out_loss(validation, cfg, validation_cache, pad),
                                       patience=cfg.stage1_patience)
    parameters = stage_parameters(model, 1)
    for p in parameters:
        p.requires_grad_(True)
    model, history = run(model, parameters=parameters, cache=cache, early_stopping=early_stopping)
    if on_trained is not None:
        on_trained(model)
    return model, history


def _train_trunk(model: nn.Module, cfg: CoralTraining, run: Callable,
                 on_trained: Callable[[nn.Module], None] | None) -> tuple[nn.Module, dict[str, list[float]]]:
    """Stage 2: every other weight, or (``lora_rank`` > 0) adapters on every linear layer but the last decoder
    layer's, merged into the weights at the end; under gradient checkpointing if asked."""
    with memory_saving(model, cfg.lora_rank, cfg.gradient_checkpointing,
                       exclude=[last_layer_pattern(model)]) as trained:
        if cfg.lora_rank == 0:
            for p in stage_parameters(trained, 2):
                p.requires_grad_(True)
        parameters = [p for p in trained.parameters() if p.requires_grad]  # with LoRA: the adapters alone
        trained, history = run(trained, parameters=parameters)
        if on_trained is not None:
            on_trained(trained)
    return merged(trained), history


def evaluated_offsets(cfg: CoralTraining) -> tuple[tuple[str, int], ...]:
    """The (kind, offset) columns of :func:`offset_hits`: ``forward`` +1 … +k_f on clean text; ``confirm`` −k_b … 0
    on clean text (what verification sees of a right block: the token at m + o is in the context); ``reconstruct``
    −k_b … 0 of the corrupted tokens of a corrupted copy (what it sees of a wrong one)."""
    backward = range(-cfg.backward_window, 1)
    return (*(("forward", o) for o in range(1, cfg.forward_window + 1)), *(("confirm", o) for o in backward),
            *(("reconstruct", o) for o in backward))


@torch.no_grad()
def offset_hits(policy: Policy, sequences: Sequences, cfg: CoralTraining) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out top-1 hits per sequence and column of :func:`evaluated_offsets`, the corruption one fixed draw per
    sequence (key :data:`HELD_OUT_KEY`): ``hits`` and ``counts`` (targets), both (S, C). Per sequence, so that the
    accuracy Σ hits / Σ counts can get an interval over sequences (the tokens of one response are not independent
    units)."""
    columns = evaluated_offsets(cfg)
    hits, counts = torch.zeros(len(sequences), len(columns)), torch.zeros(len(sequences), len(columns))
    for start in range(0, len(sequences), cfg.batch_size):
        chunk = sequences[start : start + cfg.batch_size]
        batch = {**right_pad(chunk, padding_id(policy.tokenizer)), "index": torch.arange(start, start + len(chunk))}
        corrupted, changed = corrupt_batch(batch, cfg, HELD_OUT_KEY)
        inputs = {"forward": (batch["input_ids"], batch["response_mask"]),
                  "confirm": (batch["input_ids"], batch["response_mask"]), "reconstruct": (corrupted, changed)}
        for kind, (ids, target_mask) in inputs.items():
            which = [i for i, (k, _) in enumerate(columns) if k == kind]
            hits[start : start + len(chunk), which], counts[start : start + len(chunk), which] = _batch_hits(
                policy, ids, batch["input_ids"], batch["attention_mask"], target_mask, [columns[i][1] for i in which])
    return hits, counts


def _batch_hits(policy: Policy, input_ids: torch.Tensor, target_ids: torch.Tensor, attention_mask: torch.Tensor,
                target_mask: torch.Tensor, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 hits and targets (B, O) of each row at each offset: the prediction from ``input_ids`` ≤ m of the
    ``target_ids`` token at m + o where ``target_mask`` marks it."""
    device, lm_head = policy.device, policy.model.get_output_embeddings()
    attention_mask = attention_mask.to(device)
    hidden = target_aware_hidden(policy.model, input_ids.to(device), offsets, attention_mask=attention_mask)
    targets, valid = offset_targets(target_ids.to(device), target_mask.to(device), offsets)
    valid &= attention_mask.bool()[:, None, :]  # (B, O, T): the predicting position is a real token
    rows = valid.nonzero(as_tuple=True)  # (sequence, offset, position) of every target
    predicted = torch.cat([lm_head(chunk).argmax(-1) for chunk in logit_chunks(hidden[rows])])  # (N,)
    correct = (predicted == targets[rows]).float().cpu()
    cell = rows[0].cpu() * len(offsets) + rows[1].cpu()  # flat (sequence, offset) index
    hits, counts = torch.zeros(input_ids.shape[0] * len(offsets)), torch.zeros(input_ids.shape[0] * len(offsets))
    hits.index_add_(0, cell, correct)
    counts.index_add_(0, cell, torch.ones_like(correct))
    return hits.view(-1, len(offsets)), counts.view(-1, len(offsets))
