"""Training and evaluation of token-level reward heads (SLA paper, §4.3 and §5.3; docs/sla.md).

Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward".

Training (§4.3, eq. 17). The policy stays frozen; only the head (the reward channel, or an adapter
baseline) learns, with the Bradley–Terry loss on the *mean* token reward of each response:

    L = −E[ log σ( (1/T_w) Σ_t R'(τ^w_≤t) − (1/T_l) Σ_t R'(τ^l_≤t) ) ]

A sequence is the chat-templated prompt followed by the response and the end token; the end token
belongs to the response (it is the action that ends the trajectory, and SLA scores it like any other),
the prompt is masked. Adam, cosine schedule with linear warm-up, as in §5, in the shared loop of
:mod:`models.common.training` (``accelerate``: a CPU, one GPU or several).

Evaluation (§5.3). On held-out pairs: *pair accuracy* (the mean response reward ranks chosen above
rejected) and the *token-level reward curve*: the paper defines AuTRC only in words and its code has
none, so we read it as follows (docs/sla.md). For x = 1..100 % of each response, the accuracy of
[R'(chosen prefix of ⌈x·T_w⌉ response tokens) > R'(rejected prefix of ⌈x·T_l⌉ tokens)]; AuTRC is the
area under that curve, normalised to [0, 1]. It measures what SLA needs: whether the reward of a
*partial* response already ranks the eventual winner first.

One causal forward over a whole sequence gives R' of every prefix (a prefix's reward depends on its own
tokens only), so evaluation scores each pair once (:func:`score_pairs`) and the metrics are pure
functions of those per-token rewards (:func:`pair_accuracy`, :func:`token_reward_curve`, :func:`autrc`),
per pair first (:func:`pair_wins`, :func:`pair_curves`), so that the stage can give them 95 % intervals over
the held-out prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader

from models.common.sequences import padding_id, right_pad, tokenize_sequence
from models.common.training import train
from models.engine.policy import Policy
from models.sla.config import RewardTraining
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


def _pair_loader(tokenizer, pairs: pd.DataFrame, max_length: int, batch_size: int) -> DataLoader:
    """Batches of pairs in their order (for scoring)."""
    return DataLoader(tokenize_pairs(tokenizer, pairs, max_length), batch_size=batch_size,
                      collate_fn=partial(collate_pairs, pad_token_id=padding_id(tokenizer)))


class StackedHeads(nn.ModuleDict):
    """Several reward heads over the same policy states: rewards (B, T, H), one policy forward for all.

    The policy is frozen, so every head sees exactly the states it would see alone; training them
    together costs one policy pass per batch instead of one per head (the policy dominates the cost).
    """

    def forward(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.stack([head(hidden_states) for head in self.values()], dim=-1)  # (B, T, H)


def train_reward_heads(policy: Policy, train_pairs: pd.DataFrame, cfg: RewardTraining,
                       head_configs: dict[str, RewardHeadConfig], accelerator: Accelerator | None = None,
                       on_step: Callable[[int, int, dict[str, float]], None] | None = None,
                       ) -> tuple[dict[str, RewardTransformer], dict[str, dict[str, list[float]]]]:
    """Fit reward heads on the frozen policy with the Bradley–Terry loss of eq. 17, all in one pass.

    The heads share nothing but the policy's states: the summed loss gives each head exactly the
    gradient of its own loss, and Adam is element-wise, so this equals training each head alone (same
    initialisation order, data order and schedule) at a fraction of the policy forwards.

    ``accelerator``: an ``accelerate.Accelerator``; by default one on the policy's device. Under
    ``accelerate launch`` every process runs this function, batches are split between them and the
    heads' gradients are all-reduced; the policy and the heads live on ``accelerator.device``. A
    half-precision policy trains float32 master weights of the heads under autocast (the shared loop),
    and the heads come back in the policy's dtype.
    ``on_step(step, num_steps, losses)`` is called after each optimizer step on the main process.

    Returns one model (the policy + that trained head) per name, and per name its history: ``loss`` and
    ``learning_rate`` per step, ``train_pair_accuracy`` per epoch (pairs ranked right *while* training).
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    if len(train_pairs) == 0:
        raise ValueError("no training pairs: the reward heads have nothing to learn from")
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu")
    set_seed(cfg.seed)  # head initialisation, in the order of head_configs
    heads = StackedHeads({name: build_reward_head(c, policy.model.config) for name, c in head_configs.items()})
    # the heads in the policy's dtype, beside the policy on this process's device
    model = RewardTransformer(policy.model, head=heads).to(accelerator.device)
    # The frozen policy stays in eval mode (no dropout: it must compute the states it will have at decoding
    # time), and the heads have no train-only behaviour, so the whole model stays in eval mode.
    model.eval()
    names = list(head_configs)
    correct = torch.zeros(len(names), device=accelerator.device)  # this epoch's pairs ranked right, per head
    seen = torch.zeros((), device=accelerator.device)
    accuracies: dict[str, list[float]] = {name: [] for name in names}

    def step(model: RewardTransformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # logits of one position only: the loss needs the hidden states, not the (2B, T, V) logits
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=1).rewards
        chosen_rewards, rejected_rewards = rewards.float().chunk(2)  # (B, T, H) each
        chosen_mask, rejected_mask = batch["response_mask"].chunk(2)  # (B, T) each
        losses = torch.stack([bradley_terry_loss(chosen_rewards[..., h], chosen_mask,
                                                 rejected_rewards[..., h], rejected_mask)
                              for h in range(len(names))])  # (H,)
        with torch.no_grad():
            margins = torch.stack([mean_response_reward(chosen_rewards[..., h], chosen_mask)
                                   - mean_response_reward(rejected_rewards[..., h], rejected_mask)
                                   for h in range(len(names))])  # (H, B)
        correct.add_((margins > 0).sum(dim=1))
        seen.add_(margins.shape[1])
        return losses.sum(), dict(zip(names, losses.detach(), strict=True))

    def on_epoch_end(epoch: int) -> None:
        accuracy = (accelerator.reduce(correct, "sum") / accelerator.reduce(seen, "sum")).tolist()
        for name, value in zip(names, accuracy, strict=True):
            accuracies[name].append(value)
        correct.zero_()
        seen.zero_()

    model, history = train(
        model, tokenize_pairs(policy.tokenizer, train_pairs, cfg.max_length), step, model.head.parameters(),
        partial(torch.optim.Adam, lr=cfg.learning_rate), accelerator=accelerator, epochs=cfg.epochs,
        batch_size=cfg.batch_size, seed=cfg.seed, warmup_ratio=cfg.warmup_ratio,
        collate_fn=partial(collate_pairs, pad_token_id=padding_id(policy.tokenizer)),
        desc=f"reward heads ({', '.join(names)})", show=names, on_step=on_step, on_epoch_end=on_epoch_end)
    models = {name: RewardTransformer(policy.model, head_configs[name], head=model.head[name]) for name in names}
    histories = {name: {"loss": history[name], "learning_rate": list(history["learning_rate"]),
                        "train_pair_accuracy": accuracies[name]} for name in names}
    return models, histories


@dataclass
class PairRewards:
    """R' of every response prefix of each pair: entry t = the reward after response token t (end token last)."""

    chosen: list[torch.Tensor]  # each (T_w,), or (T_w, H) for stacked heads
    rejected: list[torch.Tensor]  # each (T_l,), or (T_l, H)


@torch.no_grad()
def score_pairs(model: RewardTransformer, tokenizer, pairs: pd.DataFrame, max_length: int,
                batch_size: int = 8) -> PairRewards:
    """One forward per pair (both sides batched): the per-prefix rewards of each chosen and rejected response,
    (T,) each, or (T, H) for :class:`StackedHeads`.

    Runs on the model's device in one process (held-out sets are small).
    """
    device = next(model.head.parameters()).device
    scored = PairRewards(chosen=[], rejected=[])
    for batch in _pair_loader(tokenizer, pairs, max_length, batch_size):
        rewards = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                        logits_to_keep=1).rewards.float().cpu()  # (2B, T) or (2B, T, H)
        _add_sides(scored, [row[mask.bool()] for row, mask in zip(rewards, batch["response_mask"], strict=True)])
    return scored


@torch.no_grad()
def score_pairs_by_logprob(policy: nn.Module, tokenizer, pairs: pd.DataFrame, max_length: int,
                           batch_size: int = 8) -> PairRewards:
    """The policy's own token-level score of each pair: log π(y_t | x, y_<t) of every response token (end token
    included), (T,) per response. Its mean ranks a pair the way eq. 17's mean reward does (:func:`pair_wins`): the
    baseline ranker a trained reward head has to beat."""
    device = next(policy.parameters()).device
    scored = PairRewards(chosen=[], rejected=[])
    for batch in _pair_loader(tokenizer, pairs, max_length, batch_size):
        input_ids = batch["input_ids"].to(device)  # (2B, T)
        logits = policy(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device)).logits[:, :-1]
        token_logps = logits.float().log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0].cpu()  # (2B, T − 1)
        masks = batch["response_mask"][:, 1:].bool()  # token t is predicted at t − 1; token 0 is never a response's
        _add_sides(scored, [row[mask] for row, mask in zip(token_logps, masks, strict=True)])
    return scored


def _add_sides(scored: PairRewards, per_response: list[torch.Tensor]) -> None:
    """Append a batch's per-response values (the B chosen rows, then the B rejected rows) to ``scored``."""
    half = len(per_response) // 2
    scored.chosen += per_response[:half]
    scored.rejected += per_response[half:]


def pair_wins(scored: PairRewards) -> np.ndarray:
    """Per pair: 1 when the chosen response has the higher mean token reward (the eq. 17 sequence score), else 0."""
    return np.array([float(chosen.mean() > rejected.mean())
                     for chosen, rejected in zip(scored.chosen, scored.rejected, strict=True)])


def pair_accuracy(scored: PairRewards) -> float:
    """Share of pairs whose chosen response has the higher mean token reward (the eq. 17 sequence score)."""
    return float(pair_wins(scored).mean())


def pair_curves(scored: PairRewards, points: int = 100) -> tuple[list[float], np.ndarray]:
    """Per pair and x = 1/points … 1 of each response's length: 1 when R'(chosen prefix) > R'(rejected prefix).

    At fraction x the chosen prefix has ⌈x·T_w⌉ response tokens and the rejected one ⌈x·T_l⌉ (at least
    one, and the whole response with its end token at x = 1). Returns (xs, a (pairs, points) 0/1 array).
    """
    xs = [i / points for i in range(1, points + 1)]
    wins = np.zeros((len(scored.chosen), points))
    for p, (chosen, rejected) in enumerate(zip(scored.chosen, scored.rejected, strict=True)):
        for i in range(1, points + 1):
            # ⌈i·T/points⌉ in integers (no float rounding at the steps); a prefix of k tokens is index k − 1
            wins[p, i - 1] = chosen[-(-i * len(chosen) // points) - 1] > rejected[-(-i * len(rejected) // points) - 1]
    return xs, wins


def token_reward_curve(scored: PairRewards, points: int = 100) -> tuple[list[float], list[float]]:
    """Accuracy of R'(chosen prefix) > R'(rejected prefix) over the pairs at x = 1/points … 1 of each response's
    length (:func:`pair_curves`). Returns (xs, accuracies)."""
    xs, wins = pair_curves(scored, points)
    return xs, wins.mean(axis=0).tolist()


def autrc(xs: Sequence[float], accuracies: Sequence[float]) -> float:
    """Area under the token-level reward curve: the trapezoid rule over x ∈ [x_first, 1], divided by the
    width of that range, so 1.0 = always right and 0.5 = chance (with 100 points ≈ the mean accuracy)."""
    return float(np.trapezoid(accuracies, xs) / (xs[-1] - xs[0]))


def evaluate_reward_heads(models: dict[str, RewardTransformer], tokenizer, pairs: pd.DataFrame,
                          cfg: RewardTraining) -> dict[str, dict]:
    """Per head: pair accuracy, the token-level reward curve and its AuTRC on (held-out) pairs, and per pair the
    values these average (for intervals over pairs): ``pair_correct`` (0/1) and ``pair_autrc``, a pair's own AuTRC
    (the area under its 0/1 curve; the trapezoid rule is linear, so their mean is the AuTRC).

    The heads must sit on one (frozen) policy: one policy forward per batch scores them all (:class:`StackedHeads`),
    which gives each head exactly the rewards it gets alone, at the cost of one head's evaluation.
    """
    policies = {id(model.policy) for model in models.values()}
    if len(policies) != 1:
        raise ValueError(f"heads evaluated together must share one policy, got {len(policies)} policies")
    policy = next(iter(models.values())).policy
    stacked = RewardTransformer(policy, head=StackedHeads({name: model.head for name, model in models.items()}))
    scored = score_pairs(stacked, tokenizer, pairs, cfg.max_length, cfg.batch_size)  # rewards (T, H) per response
    evaluations = {}
    for h, name in enumerate(models):
        head_scored = PairRewards(chosen=[c[:, h] for c in scored.chosen], rejected=[r[:, h] for r in scored.rejected])
        xs, wins = pair_curves(head_scored, cfg.curve_points)
        accuracies = wins.mean(axis=0).tolist()
        evaluations[name] = {"pair_accuracy": pair_accuracy(head_scored), "x": xs, "accuracy": accuracies,
                             "autrc": autrc(xs, accuracies), "pair_correct": pair_wins(head_scored).tolist(),
                             "pair_autrc": [autrc(xs, curve) for curve in wins]}
    return evaluations


def evaluate_reward_head(model: RewardTransformer, tokenizer, pairs: pd.DataFrame, cfg: RewardTraining) -> dict:
    """:func:`evaluate_reward_heads` of one head."""
    return evaluate_reward_heads({"head": model}, tokenizer, pairs, cfg)["head"]
