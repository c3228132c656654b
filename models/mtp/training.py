"""The MTP-equipped stage (MTP-RL §3.1; docs/mtp.md): train a shared-parameter MTP module on the main
model's own responses with eq. 1's weighted cross-entropy, the main model frozen; and measure how many tokens
its chained drafts would get accepted.

The main model is frozen, so its final hidden states of the data are computed once (:func:`frozen_states`)
and reused by every epoch and by every K of the depth ablation. They are written to disk in the policy's dtype
and read back one sequence at a time (:class:`HiddenStates`, memory-mapped safetensors): for an 8B policy
(H = 4096, bf16) 100k responses of 256 tokens are ~200 GB, far more than RAM. Training touches only the module's
projection, norms and decoder layer (embedding, final norm and LM head are the main model's, frozen here).

Acceptance without decoding (:func:`chain_acceptance`). On the policy's own greedy responses, the token after
position i is the main model's greedy choice, so under greedy verification a chain drafted at i is accepted
while depth k's argmax equals t_{i+k+1} — and as long as it is accepted, the chained draft inputs equal the
teacher-forced ones. The run length of consecutive hits of one teacher-forced pass therefore *is* the number
of accepted drafts a cycle starting at i would get; τ ≈ 1 + its mean (the bonus token counts), α = its mean / K.
Everything is counted per response (:class:`ChainAcceptance`), the unit the stage's intervals resample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models.common.sequences import Sequences, padding_id, right_pad
from models.common.training import EarlyStopping, held_out_mean, train
from models.engine.policy import Policy
from models.mtp.config import MTPTraining
from models.mtp.module import MTPModule, MTPModuleConfig, depth_targets, mtp_cross_entropy, vocab_logits

if TYPE_CHECKING:
    from accelerate import Accelerator


def depth_weights(weights: Sequence[float], num_depths: int) -> list[float]:
    """λ_1 … λ_K: the configured weights, the last one repeated for deeper depths (the K = 4 ablation)."""
    if not weights:
        raise ValueError("at least one cross-entropy weight is needed")
    return [float(weights[min(k, len(weights) - 1)]) for k in range(num_depths)]


class HiddenStates(Sequence[torch.Tensor]):
    """The frozen main model's final hidden states, (T_j, H) per sequence in the policy's dtype, read on demand
    from the safetensors files :func:`frozen_states` wrote to ``folder`` (one file per batch of ``batch_size``
    sequences; a read maps just that tensor). ``rows``: which sequences, in order (default: all ``count``)."""

    def __init__(self, folder: Path, count: int, batch_size: int, rows: Sequence[int] | None = None):
        self.folder, self.count, self.batch_size = Path(folder), count, batch_size
        self.rows = list(range(count)) if rows is None else list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        from safetensors import safe_open

        row = self.rows[index]
        with safe_open(self.folder / _states_file(row // self.batch_size), framework="pt") as states:
            return states.get_tensor(str(row))

    def select(self, indices: Sequence[int]) -> HiddenStates:
        """The states of ``indices`` (positions in this selection), still on disk."""
        return HiddenStates(self.folder, self.count, self.batch_size, [self.rows[i] for i in indices])


def _states_file(batch: int) -> str:
    return f"states-{batch:06d}.safetensors"


@torch.no_grad()
def frozen_states(policy: Policy, sequences: Sequences, folder: Path, batch_size: int = 8,
                  accelerator: Accelerator | None = None) -> HiddenStates:
    """The main model's final hidden states of each sequence, written to ``folder`` in the policy's dtype.

    Under several processes each computes every P-th batch and all wait for the others (``folder`` must be one
    they all see); the returned :class:`HiddenStates` reads any sequence."""
    from safetensors.torch import save_file

    pad = padding_id(policy.tokenizer)
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    Path(folder).mkdir(parents=True, exist_ok=True)
    for batch_index in range(rank, math.ceil(len(sequences) / batch_size), processes):
        start = batch_index * batch_size
        chunk = sequences[start : start + batch_size]
        batch = right_pad(chunk, pad)
        # the decoder stack only: the LM head over every position (B, T, V) would cost more than the layers
        with torch.no_grad():
            hidden = policy.model.base_model(input_ids=batch["input_ids"].to(policy.device),
                                             attention_mask=batch["attention_mask"].to(policy.device)
                                             ).last_hidden_state  # (B, T, H): final-normed, what the LM head reads
        save_file({str(start + row): hidden[row, : len(ids)].contiguous().cpu() for row, (ids, _) in enumerate(chunk)},
                  Path(folder) / _states_file(batch_index))
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return HiddenStates(folder, len(sequences), batch_size)


class _Rows(torch.utils.data.Dataset):
    """(ids, response mask, hidden states) per sequence; the states read from disk when a batch needs them."""

    def __init__(self, sequences: Sequences, hidden: Sequence[torch.Tensor]):
        if len(sequences) != len(hidden):
            raise ValueError(f"{len(sequences)} sequences but {len(hidden)} hidden states")
        self.sequences, self.hidden = sequences, hidden

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[list[int], list[int], torch.Tensor]:
        ids, mask = self.sequences[index]
        return ids, mask, self.hidden[index]


def _collate(rows: list[tuple[list[int], list[int], torch.Tensor]], pad: int) -> dict[str, torch.Tensor]:
    batch = right_pad([(ids, mask) for ids, mask, _ in rows], pad)
    length = batch["input_ids"].shape[1]
    batch["hidden"] = torch.stack([torch.nn.functional.pad(h, (0, 0, 0, length - len(h))) for _, _, h in rows])
    return batch  # hidden: (B, T, H), zero past each sequence


def train_mtp_module(policy: Policy, sequences: Sequences, hidden: Sequence[torch.Tensor], num_depths: int,
                     cfg: MTPTraining, accelerator: Accelerator | None = None,
                     on_step: Callable[[int, int, dict[str, float]], None] | None = None,
                     held_out: tuple[Sequences, Sequence[torch.Tensor]] | None = None,
                     draft_vocab: torch.Tensor | None = None) -> tuple[MTPModule, dict[str, list[float]]]:
    """A fresh K-depth module trained on ``sequences`` (response tokens as targets) with the main model frozen.
    ``draft_vocab`` (sorted token ids, :func:`models.mtp.module.frequent_tokens`): the module drafts only those
    tokens, so it learns over them alone (:func:`models.mtp.module.mtp_cross_entropy`) and carries them.
    With ``held_out`` (sequences and their states) ``cfg.epochs`` is a budget: training stops once eq. 1's loss on
    them has not fallen for ``cfg.patience`` epochs, and the module keeps its best epoch's weights.
    Returns it (eval mode, no gradients) and the per-step history: the learning rate, the loss and each
    depth's cross-entropy (with ``held_out``: also ``held_out_loss`` per epoch and ``best_epoch``)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not sequences:
        raise ValueError("no sequences to train the MTP module on")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu",
                                             gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    set_seed(cfg.seed)
    base = policy.model.requires_grad_(False).eval()
    module = MTPModule(base, MTPModuleConfig(num_depths=num_depths, init=cfg.init)).train()
    module.draft_vocab = draft_vocab
    weights = depth_weights(cfg.ce_weights, num_depths)
    collate = partial(_collate, pad=padding_id(policy.tokenizer))

    def step(module: MTPModule, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        states = module(base, batch["input_ids"], batch["hidden"].to(base.dtype))
        loss, per_depth = mtp_cross_entropy(base, states, batch["input_ids"], batch["response_mask"], weights,
                                            vocab=draft_vocab)
        return loss, {"loss": loss.detach(), **{f"ce_depth_{k}": v for k, v in enumerate(per_depth, start=1)}}

    early_stopping = None
    if held_out is not None:  # eq. 1's loss over the held-out sequences, batch losses weighted by their tokens
        loader = torch.utils.data.DataLoader(_Rows(*held_out), batch_size=cfg.batch_size, collate_fn=collate)
        early_stopping = EarlyStopping(held_out_mean(step, loader, lambda batch: batch["response_mask"].sum()),
                                       cfg.patience)
    module, history = train(
        module, _Rows(sequences, hidden), step, module.parameters(),
        partial(torch.optim.AdamW, lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=0.0),
        accelerator=accelerator, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed,
        warmup_ratio=cfg.warmup_ratio, collate_fn=collate, desc=f"MTP equip (K = {num_depths})", on_step=on_step,
        early_stopping=early_stopping, count_changes="MTP module", loop=cfg)
    return module.eval().requires_grad_(False), history


@dataclass(frozen=True)
class ChainAcceptance:
    """:func:`chain_acceptance`'s counts per held-out response (the unit an interval resamples: the tokens of one
    response are not independent): top-1 ``hits`` and ``targets`` per depth, (S, K); ``accepted``, the drafts a
    greedy chain would get accepted summed over the response's positions with a full chain of K targets ahead,
    and ``positions``, how many those are, (S,). Accuracy at depth k = Σ hits / Σ targets; expected τ =
    1 + Σ accepted / Σ positions (the bonus token counts); α = (τ − 1) / K."""

    hits: torch.Tensor
    targets: torch.Tensor
    accepted: torch.Tensor
    positions: torch.Tensor


@torch.no_grad()
def chain_acceptance(policy: Policy, module: MTPModule, sequences: Sequences, hidden: Sequence[torch.Tensor],
                     batch_size: int = 8) -> ChainAcceptance:
    """Held-out top-1 hits per depth (teacher-forced) and the greedy chain's accepted drafts (module docstring),
    counted per response. With a draft vocabulary (``module.draft_vocab``) the top-1 is taken among its tokens, as
    the drafters take it."""
    base, num_depths = policy.model, module.config.num_depths
    vocab = module.draft_vocab
    vocab = None if vocab is None else vocab.to(policy.device)

    def top1(state: torch.Tensor) -> torch.Tensor:
        best = vocab_logits(base, state, vocab).argmax(-1)
        return best if vocab is None else vocab[best]
    pad = padding_id(policy.tokenizer)
    hits, targets = torch.zeros(len(sequences), num_depths), torch.zeros(len(sequences), num_depths)
    accepted, positions = torch.zeros(len(sequences)), torch.zeros(len(sequences))
    rows = _Rows(sequences, hidden)
    for start in range(0, len(rows), batch_size):
        batch = _collate([rows[i] for i in range(start, min(start + batch_size, len(rows)))], pad)
        this = slice(start, start + len(batch["input_ids"]))
        input_ids = batch["input_ids"].to(policy.device)
        states = module(base, input_ids, batch["hidden"].to(device=policy.device, dtype=base.dtype))
        correct, valid = [], []
        for k, state in enumerate(states, start=1):
            target, ok = depth_targets(input_ids, batch["response_mask"].to(policy.device), k)
            hit = (top1(state) == target) & ok  # (B, T)
            hits[this, k - 1] = hit.sum(dim=1).float().cpu()
            targets[this, k - 1] = ok.sum(dim=1).float().cpu()
            correct.append(hit)
            valid.append(ok)
        # a cycle starts at i when its root t_{i+1} is a decoded (response) token — the prefill decides the first, so
        # no draft ever targets it — and runs its whole chain where the deepest target is one too
        _, decoded_root = depth_targets(input_ids, batch["response_mask"].to(policy.device), 0)
        full_chain = decoded_root & valid[-1]
        consecutive = torch.stack(correct, dim=-1).long().cumprod(dim=-1).sum(dim=-1)  # (B, T): accepted drafts
        accepted[this] = (consecutive * full_chain).sum(dim=1).float().cpu()
        positions[this] = full_chain.sum(dim=1).float().cpu()
    return ChainAcceptance(hits, targets, accepted, positions)
