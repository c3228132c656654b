"""Sliding blockwise order-agnostic decoding (COrAL §3, Algorithm 1, Appendix C).

Xie et al. 2024, papers/coral-order-agnostic-lm.txt. The output is a final prefix followed by a
*block* of tentative tokens that every step predicts forward and refines backward:

    ensemble π (eq. 5) per block position, from the last forward's predictions
      → candidate tree (Appendix C: best-first on confidence, the top-1 chain always included)
      → ONE target-aware tree forward (tree mask and positions from :mod:`models.engine.speculative`)
      → verify (eq. 6 + eq. 7 per path; keep the best path)
      → accept a prefix of it by ensemble rejection sampling (eq. 8) and slide the block.

Positions. The block covers positions ``start … end`` (absolute indices in prompt + output). The tree's
root is the last final token (position ``start − 1``), re-fed each step and kept out of the KV cache; a
node at depth d holds a candidate for position ``start − 1 + d``. Every node is evaluated at every
offset o of the target-aware last layer: a row predicts the token at (its position + o) from the path up
to the node. So for a block token at position j, the path gives:

* next-token  p(y_j | y≤j−1): its parent at o = +1;
* backward    p(y_j | y≤i), i = j … j + k_b: the node itself and its descendants at o = 0 … −k_b;
* forward     p(y_j | y≤i), i = j − k_f … j − 2: its ancestors at o = 2 … k_f.

Ablations (the paper's Table 1): ``verify=False`` keeps only the ensemble's top-1 chain (no tree, no
eq. 6/7 selection; "w/o verifier"); ``forward_window=1`` predicts one new token per step ("w/o
multi-forward"). The next-token baseline is ordinary greedy decoding of the same model.

This is NOT lossless: the output is whatever COrAL accepts, judged by task accuracy. Sliding uses random
draws from a seeded generator, so a run is deterministic. A step that accepts nothing while its block
cannot grow accepts the block's first token (a stall guard the paper does not need on GPUs, stated here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from models.coral.target_aware import target_aware_hidden
from models.engine.speculative import (
    Tree,
    build_tree,
    keep_accepted,
    sparse_tree,
    tree_attention_inputs,
    tree_candidates,
)


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
    seed: int = 0  # the generator of eq. 8's acceptance draws

    def offsets(self) -> tuple[int, ...]:
        """Target offsets of the last layer: backward −k_b … 0, then forward +1 … +k_f."""
        return tuple(range(-self.backward_window, 1)) + tuple(range(1, self.forward_window + 1))

    def weight(self, distance: int) -> float:
        """λ_δ for a prediction of position j from the context ≤ j − δ."""
        return self.decay ** abs(distance - 1)


@dataclass
class CoralStats:
    """Counters of one decoding run."""

    forwards: int = 0  # model forwards, the prefill included
    generated_tokens: int = 0
    forced: int = 0  # tokens accepted by the stall guard
    accepted_per_step: list[int] = field(default_factory=list)


@dataclass
class _Prediction:
    """One dependency of a target position: the log-probabilities from the context ≤ i, j − i = ``distance``."""

    distance: int
    log_probs: torch.Tensor  # (V,)
    confidence: float  # c(y≤i): eq. 8's score of the context's last token (1 for final tokens)


def ensemble(predictions: Sequence[_Prediction], settings: CoralDecoding) -> torch.Tensor:
    """Eq. 5: log π(y_j), the softmax of the ω-weighted mean of the available log-probabilities, ω = λ_δ · c."""
    weights = torch.tensor([settings.weight(p.distance) * p.confidence for p in predictions])
    if float(weights.sum()) <= 0:  # every context rejected: fall back to the distance weights alone
        weights = torch.tensor([settings.weight(p.distance) for p in predictions])
    stacked = torch.stack([p.log_probs for p in predictions])  # (P, V)
    mixed = (weights.to(stacked)[:, None] * stacked).sum(0) / weights.sum().to(stacked)
    return torch.log_softmax(mixed, dim=-1)  # (V,)


def candidate_choices(log_pi: torch.Tensor, num_new_from: int, settings: CoralDecoding) -> list[tuple[int, ...]]:
    """Appendix C: the tree's paths. A path's confidence is the product of its tokens' π-probabilities, the
    n-th new position's scaled by γ (the text says "up-weight" — eq. 9 prints p/γ, we multiply); nodes are
    added best-first up to ``tree_size``, and the top-1 chain over the whole block is always a path.

    log_pi (D, V); positions from depth ``num_new_from`` on are new (not yet tentative).
    """
    depth = log_pi.shape[0]
    chain = (0,) * depth
    if not settings.verify:
        return [chain]
    top = log_pi.exp().topk(min(settings.tree_size, log_pi.shape[1]), dim=-1).values  # (D, r)
    scale = [settings.gamma[d - num_new_from - 1] if 0 < d - num_new_from <= len(settings.gamma) else 1.0
             for d in range(depth)]
    rank_accuracy = [(top[d] * scale[d]).tolist() for d in range(depth)]
    return sorted(set(sparse_tree(rank_accuracy, settings.tree_size)) | {chain})


def _root_only_tree() -> Tree:
    """The first step's "tree": the prompt's last token alone (no candidates yet)."""
    return Tree(choices=(), depths=torch.tensor([0]), ranks=torch.tensor([0]), ancestors=torch.ones(1, 1, dtype=torch.bool),
                paths=torch.tensor([[0]]))


@dataclass
class _Forward:
    """A target-aware tree forward's log-probabilities, by (node, offset)."""

    tokens: torch.Tensor  # (N+1,)
    offsets: tuple[int, ...]
    row_of: torch.Tensor  # (N+1, O) row index into log_probs, −1 where not computed
    log_probs: torch.Tensor  # (R, V)
    entropy: torch.Tensor  # (R,)

    def row(self, node: int, offset: int) -> int:
        return int(self.row_of[node, self.offsets.index(offset)])


def _tree_forward(model, tokens: torch.Tensor, tree: Tree, cache: DynamicCache, settings: CoralDecoding,
                  horizon: int) -> _Forward:
    """One target-aware forward of the tree; log-probabilities only for rows whose target depth is 1…``horizon``."""
    offsets = settings.offsets()
    position_ids, mask = tree_attention_inputs(tree, cache.get_seq_length(), model.dtype, tokens.device)
    hidden = target_aware_hidden(model, tokens[None], offsets, attention_mask=mask, position_ids=position_ids,
                                 past_key_values=cache)[0]  # (O, N+1, H)
    target_depth = tree.depths[:, None] + torch.tensor(offsets)[None, :]  # (N+1, O)
    needed = (target_depth >= 1) & (target_depth <= horizon)
    row_of = torch.full(needed.shape, -1, dtype=torch.long)
    nodes, offset_index = needed.nonzero(as_tuple=True)
    row_of[nodes, offset_index] = torch.arange(len(nodes))
    logits = model.get_output_embeddings()(hidden[offset_index.to(hidden.device), nodes.to(hidden.device)])  # (R, V)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # (R,)
    return _Forward(tokens, offsets, row_of, log_probs, entropy)


def _path_scores(forward: _Forward, path: list[int], settings: CoralDecoding) -> tuple[float, list[float]]:
    """Eq. 6 + eq. 7 averaged over the path's block tokens, and eq. 8's acceptance score of each of them."""
    tokens = forward.tokens
    threshold_scale = math.sqrt(settings.epsilon)
    scores, confidences = [], []
    for d in range(1, len(path)):
        token = int(tokens[path[d]])
        verify_rows = [(1, forward.row(path[d - 1], 1))] + [
            (-g, forward.row(path[d + g], -g)) for g in range(settings.backward_window + 1) if d + g < len(path)]
        weights = torch.tensor([settings.weight(distance) for distance, _ in verify_rows])
        rows = torch.tensor([r for _, r in verify_rows])
        log_p = forward.log_probs[rows, token]  # (deps,)
        v = float((weights * log_p).sum() / weights.sum())  # eq. 6
        ahead = [(delta, forward.row(path[d - delta], delta)) for delta in range(2, settings.forward_window + 1)
                 if d - delta >= 0]
        v_cd = 0.0
        if ahead:  # eq. 7: next-token log-prob above the (long-dependency-penalised) forward predictions
            inverse = torch.tensor([1.0 / settings.weight(delta) for delta, _ in ahead])
            forward_log_p = forward.log_probs[torch.tensor([r for _, r in ahead]), token]
            v_cd = max(0.0, float(log_p[0] - (inverse * forward_log_p).sum() / inverse.sum()))
        scores.append(v + v_cd)
        threshold = torch.clamp(threshold_scale * torch.exp(-forward.entropy[rows]), max=settings.epsilon)
        votes = int((log_p.exp() > threshold).sum())  # eq. 8
        confidences.append(votes / (settings.backward_window + 2))
    return (sum(scores) / len(scores) if scores else 0.0), confidences


def _predictions_after(forward: _Forward, path: list[int], confidences: list[float], first_position: int,
                       root_position: int) -> dict[int, list[_Prediction]]:
    """Every computed prediction along ``path`` of a position ≥ ``first_position``, by absolute position."""
    by_position: dict[int, list[_Prediction]] = {}
    for d, node in enumerate(path):
        confidence = 1.0 if d == 0 else confidences[d - 1]
        for offset in forward.offsets:
            row = forward.row(node, offset)
            target = root_position + d + offset
            if row >= 0 and target >= first_position:
                by_position.setdefault(target, []).append(_Prediction(offset, forward.log_probs[row], confidence))
    return by_position


@torch.no_grad()
def coral_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: set[int],
                   settings: CoralDecoding, stats: CoralStats | None = None) -> list[int]:
    """Decode one prompt (1, L) with sliding blockwise order-agnostic decoding; returns the new tokens."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"COrAL decoding takes one prompt at a time, got a batch of {input_ids.shape[0]}")
    stats = stats if stats is not None else CoralStats()
    generator = torch.Generator().manual_seed(settings.seed)
    prompt = input_ids[0].tolist()
    limit = len(prompt) + max_new_tokens  # positions < limit
    cache = DynamicCache(config=model.config)
    if len(prompt) > 1:  # the prompt but its last token, which is the first tree's root
        model(input_ids=input_ids[:, :-1], past_key_values=cache, use_cache=True)
        stats.forwards += 1
    sequence, start = list(prompt), len(prompt)  # final tokens: sequence[:start]; tentative: sequence[start:]
    predictions: dict[int, list[_Prediction]] = {}
    stalled = 0
    while True:
        last_tentative = len(sequence) - 1
        capacity = min(settings.block_size, limit - start)  # the longest block allowed now
        depth = min(capacity, last_tentative + settings.forward_window - start + 1) if predictions else 0
        if depth > 0:
            end = start + depth - 1
            log_pi = torch.stack([ensemble(predictions[j], settings) for j in range(start, end + 1)])  # (D, V)
            tree = build_tree(candidate_choices(log_pi, last_tentative - start + 1, settings))
            tokens = tree_candidates(sequence[start - 1], log_pi, tree)
        else:  # the first step: the prompt's last token alone predicts ahead
            tree, tokens = _root_only_tree(), torch.tensor([sequence[start - 1]])
        past_length = cache.get_seq_length()
        forward = _tree_forward(model, tokens.to(model.device), tree, cache, settings, depth + settings.forward_window)
        stats.forwards += 1
        scored = [(_path_scores(forward, [n for n in p.tolist() if n >= 0], settings), [n for n in p.tolist() if n >= 0])
                  for p in tree.paths]
        (_, confidences), path = max(scored, key=lambda item: item[0][0])
        block = forward.tokens[path[1:]].tolist()
        accepted = 0
        for token, confidence in zip(block, confidences, strict=True):
            if float(torch.rand((), generator=generator)) >= confidence:
                break
            accepted += 1
            if token in eos_token_ids:
                break
        stalled = 0 if accepted else stalled + 1
        if accepted == 0 and block and (depth >= capacity or stalled > settings.block_size):
            accepted, stats.forced = 1, stats.forced + 1
        keep_accepted(cache, past_length, path[:accepted])  # the root and all accepted but the last (the next root)
        root_position = start - 1
        sequence = sequence[:start] + block
        new_tokens = block[:accepted]
        start += accepted
        stats.generated_tokens += accepted
        stats.accepted_per_step.append(accepted)
        if any(t in eos_token_ids for t in new_tokens) or start >= limit:
            return sequence[len(prompt) : start]
        predictions = _predictions_after(forward, path, confidences, start, root_position)
