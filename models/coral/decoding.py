"""Sliding blockwise order-agnostic decoding (COrAL §3, Algorithm 1, Appendix C).

Xie et al. 2024, "COrAL: Order-Agnostic Language Modeling for Efficient Iterative Refinement" (docs/coral.md).
The output is a final prefix followed by a *block* of tentative tokens that every step predicts forward and
refines backward — three plug-ins of the speculative loop (:func:`models.engine.speculative.speculative_stream`):

    ensemble π (eq. 5) per block position, from the last forward's predictions       (:class:`EnsembleDrafter`)
      → candidate tree (Appendix C: best-first on confidence, the top-1 chain always included)
      → ONE target-aware tree forward (tree mask and positions from the engine)  (:func:`target_aware_tree_forward`)
      → verify (eq. 6 + eq. 7 per path; keep the best path)                            (:class:`CoralVerifier`)
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
from functools import partial

import torch
from transformers import DynamicCache

from models.coral.config import CoralDecoding
from models.coral.target_aware import target_aware_hidden
from models.engine.kv_cache import cache_kwargs
from models.engine.speculative import (
    Draft,
    SpeculativeStats,
    Tree,
    Verdict,
    Verifier,
    build_tree,
    root_tree,
    sparse_tree,
    speculative_generate,
    tree_candidates,
    tree_masks,
)


@dataclass
class CoralStats(SpeculativeStats):
    """Counters of one decoding run (``accepted_lengths``: tokens accepted per step, 0 included)."""

    forced: int = 0  # tokens accepted by the stall guard


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


@dataclass
class _Forward:
    """A target-aware tree forward's log-probabilities, by (node, offset).

    The full distributions stay on the model's device (the next step's ensemble mixes them); verification reads
    only each row's log-probability of each node's token and the rows' entropies, copied to the CPU once per
    step, so scoring the paths is plain CPU arithmetic (no small device ops, no synchronisation per token).
    """

    tokens: torch.Tensor  # (N+1,)
    offsets: tuple[int, ...]
    row_of: torch.Tensor  # (N+1, O) row index into log_probs, −1 where not computed (CPU)
    log_probs: torch.Tensor  # (R, V) float32, on the model's device
    node_log_probs: torch.Tensor  # (R, N+1) float32 on the CPU: [r, n] = log_probs[r, tokens[n]]
    entropy: torch.Tensor  # (R,) float32 on the CPU

    def row(self, node: int, offset: int) -> int:
        return int(self.row_of[node, self.offsets.index(offset)])


def target_aware_tree_forward(model, tokens: torch.Tensor, tree: Tree, cache: DynamicCache,
                              settings: CoralDecoding) -> _Forward:
    """One target-aware forward of the tree (the loop's ``forward``). Log-probabilities only for rows whose
    target depth is 1 … D + k_f: the block and the new positions a next step can use."""
    tokens = tokens.to(model.device)
    horizon = tree.depth + settings.forward_window
    offsets = settings.offsets()
    position_ids, mask = tree_masks(model, tree, cache)  # per attention kind: sliding-window layers see their window
    hidden = target_aware_hidden(model, tokens[None], offsets, attention_mask=mask, position_ids=position_ids,
                                 cache=cache)[0]  # (O, N+1, H)
    target_depth = tree.depths[:, None] + torch.tensor(offsets)[None, :]  # (N+1, O)
    needed = (target_depth >= 1) & (target_depth <= horizon)
    row_of = torch.full(needed.shape, -1, dtype=torch.long)
    nodes, offset_index = needed.nonzero(as_tuple=True)
    row_of[nodes, offset_index] = torch.arange(len(nodes))
    logits = model.get_output_embeddings()(hidden[offset_index.to(hidden.device), nodes.to(hidden.device)])  # (R, V)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # (R,)
    return _Forward(tokens, offsets, row_of, log_probs, log_probs[:, tokens].cpu(), entropy.cpu())


def _path_scores(forward: _Forward, path: list[int], settings: CoralDecoding
                 ) -> tuple[float, list[float], list[float]]:
    """Eq. 6 + eq. 7 averaged over the path's block tokens, eq. 8's acceptance score of each of them, and each one's
    next-token probability p(y_j | y≤j−1)."""
    threshold_scale = math.sqrt(settings.epsilon)
    scores, confidences, next_token = [], [], []
    for d in range(1, len(path)):
        node = path[d]
        verify_rows = [(1, forward.row(path[d - 1], 1))] + [
            (-g, forward.row(path[d + g], -g)) for g in range(settings.backward_window + 1) if d + g < len(path)]
        weights = torch.tensor([settings.weight(distance) for distance, _ in verify_rows])
        rows = torch.tensor([r for _, r in verify_rows])
        log_p = forward.node_log_probs[rows, node]  # (deps,)
        v = float((weights * log_p).sum() / weights.sum())  # eq. 6
        ahead = [(delta, forward.row(path[d - delta], delta)) for delta in range(2, settings.forward_window + 1)
                 if d - delta >= 0]
        v_cd = 0.0
        if ahead:  # eq. 7: next-token log-prob above the (long-dependency-penalised) forward predictions
            inverse = torch.tensor([1.0 / settings.weight(delta) for delta, _ in ahead])
            forward_log_p = forward.node_log_probs[torch.tensor([r for _, r in ahead]), node]
            v_cd = max(0.0, float(log_p[0] - (inverse * forward_log_p).sum() / inverse.sum()))
        scores.append(v + v_cd)
        threshold = torch.clamp(threshold_scale * torch.exp(-forward.entropy[rows]), max=settings.epsilon)
        votes = int((log_p.exp() > threshold).sum())  # eq. 8
        voters = settings.backward_window + 2 if settings.confidence_over == "window" else len(verify_rows)
        confidences.append(votes / voters)
        next_token.append(math.exp(float(log_p[0])))
    return (sum(scores) / len(scores) if scores else 0.0), confidences, next_token


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


@dataclass(frozen=True)
class BlockDraft(Draft):
    """A step's candidate tree over the block; ``full``: the block cannot grow this step."""

    full: bool = False


@dataclass(frozen=True)
class CoralVerdict(Verdict):
    """The best path, the prefix of its block that eq. 8 accepted, and eq. 8's score of each of its block tokens."""

    confidences: list[float] = field(default_factory=list)


class EnsembleDrafter:
    """The block's tokens and every prediction of its positions; each step's tree from their ensemble π (eq. 5).

    The prompt's last token is the first root: the prefill takes the prompt but that token, and the first step
    runs the root alone (it predicts ahead, accepts nothing). Later roots are the last final token, re-fed.
    """

    def __init__(self, settings: CoralDecoding):
        self.settings = settings

    def prefill(self, model, input_ids: torch.Tensor, cache: DynamicCache, verifier: Verifier) -> list[int]:
        prompt = input_ids[0].tolist()
        if len(prompt) > 1:
            model(input_ids=input_ids[:, :-1], **cache_kwargs(model, cache), use_cache=True)
        self.sequence, self.start = prompt, len(prompt)  # final tokens: sequence[:start]; tentative: sequence[start:]
        self.predictions: dict[int, list[_Prediction]] = {}
        return []

    def propose(self, room: int) -> BlockDraft:
        s, start = self.settings, self.start
        last_tentative = len(self.sequence) - 1
        capacity = min(s.block_size, room)  # the longest block allowed now
        depth = min(capacity, last_tentative + s.forward_window - start + 1) if self.predictions else 0
        root = self.sequence[start - 1]
        if depth == 0:  # the first step: the root alone predicts ahead
            return BlockDraft(root_tree(), torch.tensor([root]), full=False)
        log_pi = torch.stack([ensemble(self.predictions[j], s) for j in range(start, start + depth)])  # (D, V)
        tree = build_tree(candidate_choices(log_pi, last_tentative - start + 1, s))
        return BlockDraft(tree, tree_candidates(root, log_pi, tree), full=depth >= capacity)

    def accept(self, draft: BlockDraft, out: _Forward, verdict: CoralVerdict) -> None:
        root_position = self.start - 1
        self.sequence = self.sequence[: self.start] + draft.tokens[verdict.path[1:]].tolist()
        self.start += len(verdict.tokens)
        self.predictions = _predictions_after(out, verdict.path, verdict.confidences, self.start, root_position)


class CoralVerifier:
    """Eq. 6 + 7 pick the best path; eq. 8's draws from a seeded generator accept a prefix of its block (LOSSY).

    The stall guard: a step that accepts nothing while its block is full, or after more than ``block_size``
    such steps, accepts the block's first token (``forced`` counts them).
    """

    def __init__(self, settings: CoralDecoding):
        self.settings = settings
        # on the CPU on purpose: the draws meet only CPU floats, and a run draws alike on any device
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.stalled = self.forced = 0

    def __call__(self, draft: BlockDraft, out: _Forward) -> CoralVerdict:
        paths = [[n for n in p.tolist() if n >= 0] for p in draft.tree.paths]
        (_, confidences, next_token), path = max(((_path_scores(out, p, self.settings), p) for p in paths),
                                                 key=lambda item: item[0][0])
        # eq. 8's score, or (accept_next_token) the larger of it and the next-token probability, as COrAL's code does
        chances = [max(c, p) if self.settings.accept_next_token else c
                   for c, p in zip(confidences, next_token, strict=True)]
        accepted = 0
        for chance in chances:  # draws after an end token change nothing: the loop stops there
            if float(torch.rand((), generator=self.generator)) >= chance:
                break
            accepted += 1
        self.stalled = 0 if accepted else self.stalled + 1
        if accepted == 0 and len(path) > 1 and (draft.full or self.stalled > self.settings.block_size):
            accepted, self.forced = 1, self.forced + 1
        return CoralVerdict(path, draft.tokens[path[1 : accepted + 1]].tolist(), confidences)


def coral_generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_ids: set[int],
                   settings: CoralDecoding, stats: CoralStats | None = None) -> list[int]:
    """Decode one prompt (1, L) with sliding blockwise order-agnostic decoding; returns the new tokens."""
    stats = stats if stats is not None else CoralStats()
    verifier = CoralVerifier(settings)
    tokens, _ = speculative_generate(model, EnsembleDrafter(settings), verifier, input_ids.to(model.device),
                                     max_new_tokens, eos_token_ids, stats,
                                     partial(target_aware_tree_forward, settings=settings))
    stats.forced += verifier.forced
    return tokens
