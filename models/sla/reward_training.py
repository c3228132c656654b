"""Training and evaluation of token-level reward heads (SLA paper, §4.3 and §5.3).

Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward" (papers/sla-streaming-looking-ahead.txt).

Training (§4.3, eq. 17). The policy stays frozen; only the head (the reward channel, or an adapter
baseline) learns, with the Bradley–Terry loss on the *mean* token reward of each response:

    L = −E[ log σ( (1/T_w) Σ_t R'(τ^w_≤t) − (1/T_l) Σ_t R'(τ^l_≤t) ) ]

A sequence is the chat-templated prompt followed by the response and the end token; the end token
belongs to the response (it is the action that ends the trajectory, and SLA scores it like any other),
the prompt is masked. Adam, cosine schedule with linear warm-up, as in §5. The loop is written with
``accelerate`` so the same code runs on a CPU, one GPU or several (``accelerate launch``).

Evaluation (§5.3). On held-out pairs: *pair accuracy* (the mean response reward ranks chosen above
rejected) and the *token-level reward curve*: the paper defines AuTRC only in words and its code has
none, so we use the reading of NOTES.md. For x = 1..100 % of each response, the accuracy of
[R'(chosen prefix of ⌈x·T_w⌉ response tokens) > R'(rejected prefix of ⌈x·T_l⌉ tokens)]; AuTRC is the
area under that curve, normalised to [0, 1]. It measures what SLA needs: whether the reward of a
*partial* response already ranks the eventual winner first.

One causal forward over a whole sequence gives R' of every prefix (a prefix's reward depends on its own
tokens only), so evaluation scores each pair once (:func:`score_pairs`) and the metrics are pure
functions of those per-token rewards (:func:`pair_accuracy`, :func:`token_reward_curve`, :func:`autrc`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from foresight.config import RewardConfig
from foresight.plots import line_plot
from models.engine.policy import Policy
from models.sla.reward_transformer import (
    RewardHeadConfig,
    RewardTransformer,
    bradley_terry_loss,
    build_reward_head,
    mean_response_reward,
)

if TYPE_CHECKING:
    from accelerate import Accelerator

TokenizedPair = dict[str, list[int]]
"""``chosen_input_ids``, ``chosen_response_mask``, ``rejected_input_ids``, ``rejected_response_mask``."""


def tokenize_pairs(tokenizer, pairs: pd.DataFrame, max_length: int) -> list[TokenizedPair]:
    """Token ids and response masks of each pair's chosen and rejected sequence (``prompt`` is already templated)."""
    tokenized = []
    for prompt, chosen, rejected in zip(pairs["prompt"], pairs["chosen"], pairs["rejected"], strict=True):
        item: TokenizedPair = {}
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            item[f"{side}_input_ids"], item[f"{side}_response_mask"] = tokenize_sequence(
                tokenizer, prompt, response, max_length)
        tokenized.append(item)
    return tokenized


def collate_pairs(batch: Sequence[TokenizedPair], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad B pairs into one batch of 2B sequences: the B chosen rows, then the B rejected rows.

    One forward then scores both sides; ``rewards.chunk(2)`` splits them again. Padding has attention 0
    and response mask 0, so it changes neither the policy states of real tokens nor the reward means.
    """
    sequences = [(p["chosen_input_ids"], p["chosen_response_mask"]) for p in batch]
    sequences += [(p["rejected_input_ids"], p["rejected_response_mask"]) for p in batch]
    return right_pad(sequences, pad_token_id)


def _pair_loader(tokenizer, pairs: pd.DataFrame, max_length: int, batch_size: int,
                 generator: torch.Generator | None = None) -> DataLoader:
    """Batches of pairs; shuffled (reproducibly, by ``generator``) when a generator is given."""
    return DataLoader(tokenize_pairs(tokenizer, pairs, max_length), batch_size=batch_size,
                      shuffle=generator is not None, generator=generator,
                      collate_fn=partial(collate_pairs, pad_token_id=padding_id(tokenizer)))


class StackedHeads(nn.ModuleDict):
    """Several reward heads over the same policy states: rewards (B, T, H), one policy forward for all.

    The policy is frozen, so every head sees exactly the states it would see alone; training them
    together costs one policy pass per batch instead of one per head (the policy dominates the cost).
    """

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.stack([head(hidden_states) for head in self.values()], dim=-1)  # (B, T, H)


def train_reward_heads(policy: Policy, train_pairs: pd.DataFrame, cfg: RewardConfig,
                       head_configs: dict[str, RewardHeadConfig], accelerator: Accelerator | None = None,
                       on_step: Callable[[int, int, dict[str, float]], None] | None = None,
                       ) -> tuple[dict[str, RewardTransformer], dict[str, dict[str, list[float]]]]:
    """Fit reward heads on the frozen policy with the Bradley–Terry loss of eq. 17, all in one pass.

    The heads share nothing but the policy's states: the summed loss gives each head exactly the
    gradient of its own loss, and Adam is element-wise, so this equals training each head alone (same
    initialisation order, data order and schedule) at a fraction of the policy forwards.

    ``accelerator``: an ``accelerate.Accelerator``; by default one on the policy's device. Under
    ``accelerate launch`` every process runs this function and batches are split between them.
    ``on_step(step, num_steps, losses)`` is called after each optimizer step on the main process.

    Returns one model (the policy + that trained head) per name, and per name its history: ``loss`` and
    ``learning_rate`` per step, ``train_pair_accuracy`` per epoch (pairs ranked right *while* training).
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_cosine_schedule_with_warmup

    if len(train_pairs) == 0:
        raise ValueError("no training pairs: the reward heads have nothing to learn from")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)  # head initialisation (in the order of head_configs) and shuffling
    heads = StackedHeads({name: build_reward_head(c, policy.model.config) for name, c in head_configs.items()})
    model = RewardTransformer(policy.model, head=heads)
    # Adam moves each weight by about lr per step; in bfloat16 (spacing ≈ 2.4e-4 at the heads' initial scale
    # ≈ 0.03) a 5e-5 step rounds away and most weights never move. So the heads train in float32 (master
    # weights) under autocast when the policy runs in half precision, and are cast back at the end.
    policy_dtype = next(policy.model.parameters()).dtype
    model.head.float()
    # The frozen policy stays in eval mode (no dropout: it must compute the states it will have at decoding
    # time), and the heads have no train-only behaviour, so the whole model stays in eval mode.
    model.eval()
    loader = _pair_loader(policy.tokenizer, train_pairs, cfg.max_length, cfg.batch_size,
                          generator=torch.Generator().manual_seed(cfg.seed))
    optimizer = torch.optim.Adam(model.head.parameters(), lr=cfg.learning_rate)
    # Counted before prepare(): the schedule spans the global number of steps (accelerate steps a prepared
    # scheduler once per process for every optimizer step when batches are split between processes).
    num_steps = cfg.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(cfg.warmup_ratio * num_steps), num_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    names = list(head_configs)
    histories = {name: {"loss": [], "learning_rate": [], "train_pair_accuracy": []} for name in names}
    local_steps = cfg.epochs * len(loader)  # this process's share of num_steps
    bar = tqdm(total=local_steps, desc=f"reward heads ({', '.join(names)})", unit="step",
               disable=not accelerator.is_local_main_process)
    for _ in range(cfg.epochs):
        correct = torch.zeros(len(names), device=accelerator.device)
        seen = torch.zeros((), device=accelerator.device)
        for batch in loader:
            with torch.autocast(accelerator.device.type, dtype=policy_dtype, enabled=policy_dtype != torch.float32):
                rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).rewards
            chosen_rewards, rejected_rewards = rewards.float().chunk(2)  # (B, T, H) each
            chosen_mask, rejected_mask = batch["response_mask"].chunk(2)  # (B, T) each
            losses = torch.stack([bradley_terry_loss(chosen_rewards[..., h], chosen_mask,
                                                     rejected_rewards[..., h], rejected_mask)
                                  for h in range(len(names))])  # (H,)
            accelerator.backward(losses.sum())
            learning_rate = scheduler.get_last_lr()[0]  # the rate this step applies
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

            with torch.no_grad():
                margins = torch.stack([mean_response_reward(chosen_rewards[..., h], chosen_mask)
                                       - mean_response_reward(rejected_rewards[..., h], rejected_mask)
                                       for h in range(len(names))])  # (H, B)
            correct += (margins > 0).sum(dim=1)
            seen += margins.shape[1]
            step_losses = dict(zip(names, accelerator.reduce(losses.detach(), "mean").tolist(), strict=True))
            for name in names:
                histories[name]["loss"].append(step_losses[name])
                histories[name]["learning_rate"].append(learning_rate)
            bar.update(1)
            bar.set_postfix({name: f"{loss:.4f}" for name, loss in step_losses.items()})
            if on_step is not None and accelerator.is_main_process:
                on_step(len(histories[names[0]]["loss"]), local_steps, step_losses)
        accuracy = (accelerator.reduce(correct, "sum") / accelerator.reduce(seen, "sum")).tolist()
        for name, value in zip(names, accuracy, strict=True):
            histories[name]["train_pair_accuracy"].append(value)
    bar.close()
    heads = accelerator.unwrap_model(model).head.to(policy_dtype)
    models = {name: RewardTransformer(policy.model, head_configs[name], head=heads[name]) for name in names}
    return models, histories


@dataclass
class PairRewards:
    """R' of every response prefix of each pair: entry t = the reward after response token t (end token last)."""

    chosen: list[torch.Tensor]  # each (T_w,)
    rejected: list[torch.Tensor]  # each (T_l,)


@torch.no_grad()
def score_pairs(model: RewardTransformer, tokenizer, pairs: pd.DataFrame, max_length: int,
                batch_size: int = 8) -> PairRewards:
    """One forward per pair (both sides batched): the per-prefix rewards of each chosen and rejected response.

    Runs on the model's device in one process (held-out sets are small).
    """
    loader = _pair_loader(tokenizer, pairs, max_length, batch_size)
    device = next(model.head.parameters()).device
    scored = PairRewards(chosen=[], rejected=[])
    for batch in loader:
        rewards = model(input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device)).rewards.float().cpu()  # (2B, T)
        per_response = [row[mask.bool()] for row, mask in zip(rewards, batch["response_mask"], strict=True)]
        half = len(per_response) // 2
        scored.chosen += per_response[:half]
        scored.rejected += per_response[half:]
    return scored


def pair_accuracy(scored: PairRewards) -> float:
    """Share of pairs whose chosen response has the higher mean token reward (the eq. 17 sequence score)."""
    wins = [chosen.mean() > rejected.mean() for chosen, rejected in zip(scored.chosen, scored.rejected, strict=True)]
    return float(np.mean(wins))


def token_reward_curve(scored: PairRewards, points: int = 100) -> tuple[list[float], list[float]]:
    """Accuracy of R'(chosen prefix) > R'(rejected prefix) at x = 1/points … 1 of each response's length.

    At fraction x the chosen prefix has ⌈x·T_w⌉ response tokens and the rejected one ⌈x·T_l⌉ (at least
    one, and the whole response with its end token at x = 1). Returns (xs, accuracies).
    """
    xs = [i / points for i in range(1, points + 1)]
    accuracies = []
    for i in range(1, points + 1):
        # ⌈i·T/points⌉ in integers (no float rounding at the steps); a prefix of k tokens is index k − 1
        wins = [chosen[-(-i * len(chosen) // points) - 1] > rejected[-(-i * len(rejected) // points) - 1]
                for chosen, rejected in zip(scored.chosen, scored.rejected, strict=True)]
        accuracies.append(float(np.mean(wins)))
    return xs, accuracies


def autrc(xs: Sequence[float], accuracies: Sequence[float]) -> float:
    """Area under the token-level reward curve: the trapezoid rule over x ∈ [x_first, 1], divided by the
    width of that range, so 1.0 = always right and 0.5 = chance (with 100 points ≈ the mean accuracy)."""
    return float(np.trapezoid(accuracies, xs) / (xs[-1] - xs[0]))


def evaluate_reward_head(model: RewardTransformer, tokenizer, pairs: pd.DataFrame, cfg: RewardConfig) -> dict:
    """Pair accuracy, the token-level reward curve and its AuTRC on (held-out) pairs."""
    scored = score_pairs(model, tokenizer, pairs, cfg.max_length, cfg.batch_size)
    xs, accuracies = token_reward_curve(scored, cfg.curve_points)
    return {"pair_accuracy": pair_accuracy(scored), "x": xs, "accuracy": accuracies, "autrc": autrc(xs, accuracies)}


def plot_reward_curves(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path) -> Path:
    """One token-level reward curve per head (Figure 4 of the paper), AuTRC in the legend."""
    series = {f"{name} (AuTRC {autrc(xs, accuracies):.3f})": ([100 * x for x in xs], accuracies)
              for name, (xs, accuracies) in curves.items()}
    return line_plot(series, "Token-level reward curve", "share of the response read (%)",
                     "held-out accuracy of\nR'(chosen prefix) > R'(rejected prefix)", path,
                     reference=(0.5, "chance"), ylim=(0, 1))


def plot_losses(histories: dict[str, dict[str, list[float]]], path: Path) -> Path:
    """Training loss per optimizer step of each head; ln 2 marks an untrained (indifferent) head."""
    series = {name: (range(1, len(h["loss"]) + 1), h["loss"]) for name, h in histories.items()}
    return line_plot(series, "Reward-head training", "optimizer step", "Bradley–Terry loss (eq. 17)", path,
                     reference=(math.log(2), "ln 2 (margin 0)"))
