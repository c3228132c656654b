"""Training and evaluation of token-level reward heads (SLA paper, §4.3 and §5.3; docs/sla.md).

Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward".

Training (§4.3, eq. 17). The policy stays frozen; only the head (the reward channel, or an adapter
baseline) learns, with the Bradley–Terry loss on the *mean* token reward of each response:

    L = −E[ log σ( (1/T_w) Σ_t R'(τ^w_≤t) − (1/T_l) Σ_t R'(τ^l_≤t) ) ]

A sequence is the chat-templated prompt followed by the response and the end token; the end token
belongs to the response (it is the action that ends the trajectory, and SLA scores it like any other),
the prompt is masked. A pair with a side longer than ``max_length`` is dropped, never truncated
(:func:`fitting_pairs`, models/common/sequences.py's length rule). Adam, cosine schedule with linear warm-up, as in
§5, in the shared loop of :mod:`models.common.training` (``accelerate``: a CPU, one GPU or several).

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
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from models.common.sequences import fits, padding_id, right_pad, tokenize_sequence
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


def _pair_sequences(tokenizer, pairs: pd.DataFrame) -> list[TokenizedPair]:
    """Whole token ids and response masks of each pair's chosen and rejected sequence (``prompt`` is templated)."""
    tokenized = []
    for prompt, chosen, rejected in zip(pairs["prompt"], pairs["chosen"], pairs["rejected"], strict=True):
        item: TokenizedPair = {}
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            item[f"{side}_input_ids"], item[f"{side}_response_mask"] = tokenize_sequence(tokenizer, prompt, response)
        tokenized.append(item)
    return tokenized


def _pair_fits(item: TokenizedPair, max_length: int | None) -> bool:
    return all(fits((item[f"{side}_input_ids"], item[f"{side}_response_mask"]), max_length)
               for side in ("chosen", "rejected"))


def fitting_pairs(tokenizer, pairs: pd.DataFrame, max_length: int) -> tuple[pd.DataFrame, int]:
    """The pairs whose chosen and rejected sequences both fit ``max_length`` whole (index reset), and how many were
    dropped: a pair is compared on whole responses with their end tokens or not at all (models/common/sequences.py's
    length rule; a cut side would lose its end and its conclusion, a biased comparison)."""
    keep = [_pair_fits(item, max_length) for item in _pair_sequences(tokenizer, pairs)]
    return pairs[keep].reset_index(drop=True), len(keep) - sum(keep)


def tokenize_pairs(tokenizer, pairs: pd.DataFrame, max_length: int | None) -> list[TokenizedPair]:
    """Token ids and response masks of each pair's chosen and rejected sequence (``prompt`` is already templated),
    whole; an error if one is longer than ``max_length`` (``None``: no limit): drop those with :func:`fitting_pairs`
    first, nothing is truncated."""
    tokenized = _pair_sequences(tokenizer, pairs)
    too_long = sum(not _pair_fits(item, max_length) for item in tokenized)
    if too_long:
        raise ValueError(f"{too_long} of {len(pairs)} pairs are longer than max_length {max_length} tokens: "
                         "drop them with fitting_pairs first (pairs are never truncated)")
    return tokenized


def collate_pairs(batch: Sequence[TokenizedPair], pad_token_id: int,
                  states: dict[tuple[int, ...], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Right-pad B pairs into one batch of 2B sequences: the B chosen rows, then the B rejected rows.

    One forward then scores both sides; ``rewards.chunk(2)`` splits them again. Padding has attention 0
    and response mask 0, so it changes neither the policy states of real tokens nor the reward means.
    ``states``: the policy's cached hidden states by sequence (:func:`policy_states`): the batch then carries them
    as ``states`` (L + 1, 2B, T, d), zero past each sequence (the heads are position-wise).
    """
    sequences = [(p["chosen_input_ids"], p["chosen_response_mask"]) for p in batch]
    sequences += [(p["rejected_input_ids"], p["rejected_response_mask"]) for p in batch]
    padded = right_pad(sequences, pad_token_id)
    if states is not None:
        length = padded["input_ids"].shape[1]
        padded["states"] = torch.stack([F.pad(states[tuple(ids)], (0, 0, 0, length - len(ids)))
                                        for ids, _ in sequences], dim=1)  # (L + 1, 2B, T, d)
    return padded


def state_cache_bytes(policy_config, sequences: Sequence[Sequence[int]], dtype: torch.dtype) -> int:
    """The memory :func:`policy_states` takes for ``sequences``: every distinct one's L + 1 hidden states."""
    tokens = sum(len(ids) for ids in {tuple(ids) for ids in sequences})
    width = (policy_config.num_hidden_layers + 1) * policy_config.hidden_size
    return tokens * width * torch.empty((), dtype=dtype).element_size()


@torch.no_grad()
def policy_states(policy: nn.Module, sequences: Sequence[Sequence[int]], batch_size: int, pad_token_id: int
                  ) -> dict[tuple[int, ...], torch.Tensor]:
    """The frozen policy's hidden states (HF's L + 1: every decoder layer's input, then the final-normed state) of
    each distinct sequence, (L + 1, T, d) in the policy's dtype on the CPU, from right-padded batches of
    ``batch_size`` (the logits of one position only)."""
    device = next(policy.parameters()).device
    distinct = list(dict.fromkeys(tuple(ids) for ids in sequences))
    states = {}
    for start in range(0, len(distinct), batch_size):
        chunk = distinct[start : start + batch_size]
        batch = right_pad([(list(ids), [0] * len(ids)) for ids in chunk], pad_token_id)
        out = policy(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                     output_hidden_states=True, logits_to_keep=1)
        hidden = torch.stack(out.hidden_states)  # (L + 1, B, T, d)
        for row, ids in enumerate(chunk):
            states[ids] = hidden[:, row, : len(ids)].cpu()
    return states


def _pair_loader(tokenizer, pairs: pd.DataFrame, max_length: int | None, batch_size: int) -> DataLoader:
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
    """Fit reward heads on the frozen policy with the Bradley–Terry loss of eq. 17, all in one pass. Every pair
    must fit ``cfg.max_length`` whole (:func:`fitting_pairs` drops those that do not).

    The heads share nothing but the policy's states: the summed loss gives each head exactly the
    gradient of its own loss, and Adam is element-wise, so this equals training each head alone (same
    initialisation order, data order and schedule) at a fraction of the policy forwards. The policy is frozen,
    so where its states of the distinct training sequences fit in ``cfg.state_cache_gb`` they are computed once
    (:func:`policy_states`) and every step runs the heads alone; else each step runs the policy.

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
    accelerator = accelerator or Accelerator(cpu=policy.device.type == "cpu",
                                             gradient_accumulation_steps=cfg.gradient_accumulation_steps)
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
    data = tokenize_pairs(policy.tokenizer, train_pairs, cfg.max_length)
    pad = padding_id(policy.tokenizer)
    sequences = [pair[f"{side}_input_ids"] for pair in data for side in ("chosen", "rejected")]
    # the frozen policy's states, once per distinct sequence (every process computes them all), where they fit
    fits = state_cache_bytes(policy.model.config, sequences, policy.model.dtype) <= cfg.state_cache_gb * 1e9
    states = policy_states(policy.model, sequences, 2 * cfg.batch_size, pad) if fits else None

    def step(model: RewardTransformer, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if "states" in batch:  # the head alone, on the cached states (through the prepared model: DDP's forward)
            rewards = model(hidden_states=tuple(batch["states"].unbind(0))).rewards
        else:  # logits of one position only: the loss needs the hidden states, not the (2B, T, V) logits
            rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            logits_to_keep=1).rewards
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

    class Counts:
        """The epoch's counts and the accuracies so far, saved with each checkpoint (``train(resumable=...)``): a
        resumed run goes on counting where the killed one stood. Saved by the main process: under several the
        other processes' partial counts of the interrupted epoch come back as the main one's."""

        def state_dict(self) -> dict:
            return {"correct": correct, "seen": seen, "accuracies": accuracies}

        def load_state_dict(self, state: dict) -> None:
            correct.copy_(state["correct"])
            seen.copy_(state["seen"])
            accuracies.update(state["accuracies"])

    model, history = train(
        model, data, step, model.head.parameters(),
        partial(torch.optim.Adam, lr=cfg.learning_rate), accelerator=accelerator, epochs=cfg.epochs,
        batch_size=cfg.batch_size, seed=cfg.seed, warmup_ratio=cfg.warmup_ratio,
        collate_fn=partial(collate_pairs, pad_token_id=pad, states=states),
        desc=f"reward heads ({', '.join(names)})", show=names, on_step=on_step, on_epoch_end=on_epoch_end,
        count_changes="reward heads", loop=cfg, resumable=[Counts()])
    models = {name: RewardTransformer(policy.model, head_configs[name], head=model.head[name]) for name in names}
    histories = {name: {"loss": history[name], "learning_rate": list(history["learning_rate"]),
                        "train_pair_accuracy": accuracies[name], "weights_changed": history["weights_changed"]}
                 for name in names}
    return models, histories


@dataclass
class PairRewards:
    """R' of every response prefix of each pair: entry t = the reward after response token t (end token last)."""

    chosen: list[torch.Tensor]  # each (T_w,), or (T_w, H) for stacked heads
    rejected: list[torch.Tensor]  # each (T_l,), or (T_l, H)


@dataclass
class PairScores:
    """What one forward per batch of pairs gives: the head's R' of every response prefix (:class:`PairRewards`), and
    with ``logprobs`` the policy's own log π(y_t | x, y_<t) of every response token, end token included (T,) per
    response: the ranker a trained reward head has to beat (its mean ranks a pair as eq. 17's mean reward does)."""

    rewards: PairRewards
    logprobs: PairRewards | None = None


@torch.no_grad()
def score_pairs(model: RewardTransformer, tokenizer, pairs: pd.DataFrame, max_length: int | None,
                batch_size: int = 8, logprobs: bool = False) -> PairScores:
    """One forward per batch of pairs (both sides batched): the per-prefix rewards of each chosen and rejected
    response, (T,) each, or (T, H) for :class:`StackedHeads`; with ``logprobs`` also the policy's token log-probs
    from the same forward (logits of the positions that predict a response token only; without, of one position).

    Runs on the model's device in one process (held-out sets are small). Every pair must fit ``max_length`` whole
    (:func:`fitting_pairs`; ``None``: no limit).
    """
    device = next(model.head.parameters()).device
    scored = PairScores(PairRewards(chosen=[], rejected=[]), PairRewards(chosen=[], rejected=[]) if logprobs else None)
    for batch in _pair_loader(tokenizer, pairs, max_length, batch_size):
        input_ids, response_mask = batch["input_ids"].to(device), batch["response_mask"]  # (2B, T)
        # token t is predicted at t − 1: the logits from the first response token's predictor on
        first = max(int(response_mask.argmax(dim=1).min()) - 1, 0) if logprobs else input_ids.shape[1] - 1
        out = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device),
                    logits_to_keep=input_ids.shape[1] - first)
        rewards = out.rewards.float().cpu()  # (2B, T) or (2B, T, H)
        _add_sides(scored.rewards, [row[mask.bool()] for row, mask in zip(rewards, response_mask, strict=True)])
        if logprobs:
            targets = input_ids[:, first + 1:, None]  # (2B, T − first − 1, 1)
            token_logps = out.logits[:, :-1].float().log_softmax(-1).gather(-1, targets)[..., 0].cpu()
            masks = response_mask[:, first + 1:].bool()
            _add_sides(scored.logprobs, [row[mask] for row, mask in zip(token_logps, masks, strict=True)])
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


LOGPROB = "logprob"
"""The entry of :func:`evaluate_reward_heads` for the policy's own mean token log-prob as the ranker."""


def evaluate_reward_heads(models: dict[str, RewardTransformer], tokenizer, pairs: pd.DataFrame,
                          cfg: RewardTraining, logprobs: bool = False) -> dict[str, dict]:
    """Per head: pair accuracy, the token-level reward curve and its AuTRC on (held-out) pairs, and per pair the
    values these average (for intervals over pairs): ``pair_correct`` (0/1) and ``pair_autrc``, a pair's own AuTRC
    (the area under its 0/1 curve; the trapezoid rule is linear, so their mean is the AuTRC). With ``logprobs``,
    also :data:`LOGPROB`: the pair accuracy and ``pair_correct`` of the policy's own mean token log-prob, the
    ranker every head has to beat, from the same forwards.

    The heads must sit on one (frozen) policy: one policy forward per batch scores them all (:class:`StackedHeads`),
    which gives each head exactly the rewards it gets alone, at the cost of one head's evaluation.
    """
    policies = {id(model.policy) for model in models.values()}
    if len(policies) != 1:
        raise ValueError(f"heads evaluated together must share one policy, got {len(policies)} policies")
    if logprobs and LOGPROB in models:
        raise ValueError(f"a head named {LOGPROB!r} would hide the log-prob ranker's entry")
    policy = next(iter(models.values())).policy
    stacked = RewardTransformer(policy, head=StackedHeads({name: model.head for name, model in models.items()}))
    scored = score_pairs(stacked, tokenizer, pairs, cfg.max_length, cfg.batch_size, logprobs)
    evaluations = {}
    for h, name in enumerate(models):  # rewards (T, H) per response
        head_scored = PairRewards(chosen=[c[:, h] for c in scored.rewards.chosen],
                                  rejected=[r[:, h] for r in scored.rewards.rejected])
        xs, wins = pair_curves(head_scored, cfg.curve_points)
        accuracies = wins.mean(axis=0).tolist()
        evaluations[name] = {"pair_accuracy": pair_accuracy(head_scored), "x": xs, "accuracy": accuracies,
                             "autrc": autrc(xs, accuracies), "pair_correct": pair_wins(head_scored).tolist(),
                             "pair_autrc": [autrc(xs, curve) for curve in wins]}
    if logprobs:
        evaluations[LOGPROB] = {"pair_accuracy": pair_accuracy(scored.logprobs),
                                "pair_correct": pair_wins(scored.logprobs).tolist()}
    return evaluations


def evaluate_reward_head(model: RewardTransformer, tokenizer, pairs: pd.DataFrame, cfg: RewardTraining) -> dict:
    """:func:`evaluate_reward_heads` of one head."""
    return evaluate_reward_heads({"head": model}, tokenizer, pairs, cfg)["head"]
