"""The MTP-equipped stage (MTP-RL §3.1; docs/mtp.md): train a shared-parameter MTP module on the main
model's own responses with eq. 1's weighted cross-entropy, the main model frozen; and measure how many tokens
its chained drafts would get accepted.

The main model is frozen, so its final hidden states of the data are computed once (:func:`frozen_states`)
and reused by every epoch and by every K of the depth ablation. Training touches only the module's projection,
norms and decoder layer (embedding, final norm and LM head are the main model's, frozen here).

Acceptance without decoding (:func:`chain_acceptance`). On the policy's own greedy responses, the token after
position i is the main model's greedy choice, so under greedy verification a chain drafted at i is accepted
while depth k's argmax equals t_{i+k+1} — and as long as it is accepted, the chained draft inputs equal the
teacher-forced ones. The run length of consecutive hits of one teacher-forced pass therefore *is* the number
of accepted drafts a cycle starting at i would get; τ ≈ 1 + its mean (the bonus token counts), α = its mean / K.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from models.common.sequences import Sequences, padding_id, right_pad
from models.common.training import train
from models.engine.policy import Policy
from models.mtp.config import MTPTraining
from models.mtp.module import MTPModule, MTPModuleConfig, depth_targets, mtp_cross_entropy, mtp_logits

if TYPE_CHECKING:
    from accelerate import Accelerator



def depth_weights(weights: Sequence[float], num_depths: int) -> list[float]:
    """λ_1 … λ_K: the configured weights, the last one repeated for deeper depths (the K = 4 ablation)."""
    if not weights:
        raise ValueError("at least one cross-entropy weight is needed")
    return [float(weights[min(k, len(weights) - 1)]) for k in range(num_depths)]


@torch.no_grad()
def frozen_states(policy: Policy, sequences: Sequences, batch_size: int = 8) -> list[torch.Tensor]:
    """The main model's final hidden states of each sequence, (T_j, H) each, on the policy's device."""
    states = []
    pad = padding_id(policy.tokenizer)
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        batch = right_pad(chunk, pad)
        out = policy.model(input_ids=batch["input_ids"].to(policy.device),
                           attention_mask=batch["attention_mask"].to(policy.device), output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (B, T, H)
        states += [hidden[row, : len(ids)] for row, (ids, _) in enumerate(chunk)]
    return states


def _collate(rows: list[tuple[list[int], list[int], torch.Tensor]], pad: int) -> dict[str, torch.Tensor]:
    batch = right_pad([(ids, mask) for ids, mask, _ in rows], pad)
    length = batch["input_ids"].shape[1]
    batch["hidden"] = torch.stack([torch.nn.functional.pad(h, (0, 0, 0, length - len(h))) for _, _, h in rows])
    return batch  # hidden: (B, T, H), zero past each sequence


def train_mtp_module(policy: Policy, sequences: Sequences, hidden: list[torch.Tensor], num_depths: int,
                     cfg: MTPTraining, accelerator: Accelerator | None = None,
                     on_step: Callable[[int, int, dict[str, float]], None] | None = None
                     ) -> tuple[MTPModule, dict[str, list[float]]]:
    """A fresh K-depth module trained on ``sequences`` (response tokens as targets) with the main model frozen.
    Returns it (eval mode, no gradients) and the per-step history: the learning rate, the loss and each
    depth's cross-entropy."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if not sequences:
        raise ValueError("no sequences to train the MTP module on")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)
    base = policy.model.requires_grad_(False).eval()
    module = MTPModule(base, MTPModuleConfig(num_depths=num_depths, init=cfg.init)).train()
    weights = depth_weights(cfg.ce_weights, num_depths)

    def step(module: MTPModule, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        states = module(base, batch["input_ids"], batch["hidden"].to(base.dtype))
        loss, per_depth = mtp_cross_entropy(base, states, batch["input_ids"], batch["response_mask"], weights)
        return loss, {"loss": loss.detach(), **{f"ce_depth_{k}": v for k, v in enumerate(per_depth, start=1)}}

    rows = [(ids, mask, h.cpu()) for (ids, mask), h in zip(sequences, hidden, strict=True)]
    module, history = train(
        module, rows, step, module.parameters(),
        partial(torch.optim.AdamW, lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=0.0),
        accelerator=accelerator, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed,
        warmup_ratio=cfg.warmup_ratio, collate_fn=partial(_collate, pad=padding_id(policy.tokenizer)),
        desc=f"MTP equip (K = {num_depths})", on_step=on_step)
    return module.eval().requires_grad_(False), history


@torch.no_grad()
def chain_acceptance(policy: Policy, module: MTPModule, sequences: Sequences, hidden: list[torch.Tensor],
                     batch_size: int = 8) -> dict[str, float]:
    """Held-out top-1 accuracy per depth (teacher-forced) and the greedy chain's expected τ and α (module
    docstring) over every response position with a full chain of K targets ahead."""
    base, num_depths = policy.model, module.config.num_depths
    pad = padding_id(policy.tokenizer)
    hits, counts = torch.zeros(num_depths), torch.zeros(num_depths)
    run_lengths = []
    for start in range(0, len(sequences), batch_size):
        chunk = [(ids, mask, h) for (ids, mask), h in
                 zip(sequences[start : start + batch_size], hidden[start : start + batch_size], strict=True)]
        batch = _collate(chunk, pad)
        input_ids = batch["input_ids"].to(policy.device)
        states = module(base, input_ids, batch["hidden"].to(device=policy.device, dtype=base.dtype))
        correct, valid = [], []
        for k, state in enumerate(states, start=1):
            targets, ok = depth_targets(input_ids, batch["response_mask"].to(policy.device), k)
            hit = (mtp_logits(base, state).argmax(-1) == targets) & ok  # (B, T)
            hits[k - 1] += hit.sum().item()
            counts[k - 1] += ok.sum().item()
            correct.append(hit)
            valid.append(ok)
        full_chain = valid[-1]  # the deepest target exists, so every shallower one does
        consecutive = torch.stack(correct, dim=-1).long().cumprod(dim=-1).sum(dim=-1)  # (B, T)
        run_lengths.append(consecutive[full_chain].float().cpu())
    runs = torch.cat(run_lengths) if run_lengths else torch.zeros(0)
    mean_run = runs.mean().item() if len(runs) else math.nan
    return {**{f"top1_depth_{k}": (hits[k - 1] / counts[k - 1]).item() if counts[k - 1] else math.nan
               for k in range(1, num_depths + 1)},
            "expected_tau": 1 + mean_run, "expected_acceptance_rate": mean_run / num_depths,
            "positions": int(len(runs))}
