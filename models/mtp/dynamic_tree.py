"""The MTP module as an EAGLE-2 drafter: a dynamic draft tree shaped by the module's own confidence.

EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", §4): an
autoregressive drafter — one whose guess at depth d + 1 reads its guess at depth d — drafts a tree, not a chain.
At each depth it *expands* the ``frontier`` nodes of the last depth with the highest value, each into its ``top_k``
likeliest children; a node's value is the product of the drafter's probabilities along its path (its confidence
that the whole path is right, §4.1). After the last depth, the ``budget`` nodes of highest value among all drafted
ones are verified in one forward (re-ranking, §4.2): the tree grows deep where the drafter is sure and wide where it
hesitates. The MTP module (:mod:`models.mtp.module`, DeepSeek-V3 §2.2) is such a drafter: depth k reads depth
k − 1's state and the token k positions ahead, and its parameters are shared across depths, so it can be applied
deeper than it was trained (``DynamicTree.depth`` > K).

What a tree costs the MTP module. Depth k at position i reads the token t_{i+k}, so its states at the positions
L − k + 1 … L − 1 (L: the root t_L's position) read drafts — the path's own — and differ from path to path; the
positions ≤ L − k read final tokens and are computed once (:class:`MTPDrafter`'s bookkeeping: one KV cache per
depth holding them). Expanding a node at depth d − 1 (path x_1 … x_{d−1}) therefore runs depth d over the d − 1
positions L − d + 1 … L − 1 with the path's tokens, and its last state gives the children's logits. One call of the
shared layer per depth runs, together, the positions that became final since the last cycle (the catch-up, kept in
the cache) and every frontier node's path positions (each attending to the cache, the catch-up and its own
earlier positions: a tree mask), which are then dropped from the cache. The drafts are exactly those of a
teacher-forced forward over each path (tests compare a top-1 tree with the chain drafter).

At batch B (:class:`MTPBatchTreeDrafter`, the batched engine's drafter, models/engine/batched.py): the same one call
per depth for the whole batch, each row's catch-up and frontier paths side by side under a per-row tree mask, and the
top-k, frontier choice and re-ranking as tensors over the rows; each row gets the tree it would get alone (tests
compare every row's trees with :class:`MTPTreeDrafter`'s), so rows verify different trees in one forward
(:class:`models.engine.speculative.RowTrees`).

Draft vocabulary (EAGLE-3, Li et al. 2025, §3.2; FR-Spec, Zhao et al. 2025): the module's logits may be restricted
to the most frequent tokens of the training responses (``MTPModule.draft_vocab``, read by
:func:`models.mtp.module.draft_parts`), so the LM head it reads shrinks from the
policy's whole vocabulary (49,152 rows for SmolLM2: 2.3 ms per depth on the 2-core CPU) to a few thousand rows
(0.3 ms for 4,096). A token outside it is never drafted; verification is unchanged, so the output is not.

The budget and depth (:func:`calibrate_budget`, ``DynamicTree.budget: auto``): EAGLE-2 fixes them per device; here
they are the budget and depth of the most tokens per second on the machine at hand, from the policy's measured
verification cost by width, the drafter's measured drafting time by depth and its tokens per cycle by budget and
depth, all measured at the start of a run on training prompts. On the 2-core CPU a cycle's drafting (~1.8 ms per
depth: the shared layer, the draft LM head, the top-k) is a fifth of its cost, so a last depth that is seldom
accepted does not pay for itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.engine.config import DynamicTree
from models.engine.speculative import (
    VERIFICATION_REPEATS,
    VERIFICATION_WIDTHS,
    Draft,
    RowTrees,
    Tree,
    TreeVerifier,
    budget_context,
    build_tree,
    speculative_generate,
    verification_costs,
)
from models.mtp.module import (
    BatchPolicyTrail,
    MTPModule,
    PolicyTrail,
    cached_additive_mask,
    draft_vocab_logits,
    right_aligned_causal,
)


class MTPTreeDrafter(PolicyTrail):
    """The speculative loop's drafter (:class:`models.engine.speculative.Drafter`) of EAGLE-2 dynamic trees over an
    MTP module, at batch 1. ``base``/``module``: as :func:`models.mtp.module.draft_parts` returns them (with a draft
    vocabulary, drafts take only its tokens); ``tree``: the tree's shape; ``budget``: nodes verified per cycle besides
    the root (``tree.budget`` resolved). Verify with greedy verification (lossless) or
    :class:`models.engine.speculative.TreeSamplingVerifier` (exact in distribution)."""

    def __init__(self, base, module: MTPModule, tree: DynamicTree, budget: int):
        if budget < 1:
            raise ValueError(f"a dynamic tree verifies at least one node besides the root, got budget {budget}")
        super().__init__(base, tree.depth)
        self.base, self.module, self.shape, self.budget = base, module, tree, budget

    def propose(self, room: int) -> Draft:
        tree, tokens = self.draft()
        return Draft(tree, torch.tensor([self.tokens[-1], *tokens], device=self.hidden.device))

    @torch.no_grad()
    def draft(self) -> tuple[Tree, list[int]]:
        """One cycle's tree and its tokens in the tree's node order (root excluded)."""
        length = len(self.hidden)  # L
        depth = min(self.shape.depth, length)  # depth d reads position L − d: a shorter prefix has none
        # every drafted node: its path of child ranks (the tree's choices), token and log-value; per depth, the nodes
        # of the last depth's frontier and their paths' tokens (F, d − 1) and depth-(d − 1) states (F, d − 1, H)
        paths: list[tuple[int, ...]] = []
        tokens: list[int] = []
        values: list[float] = []
        frontier_paths: list[tuple[int, ...]] = [()]
        frontier_values = torch.zeros(1, device=self.hidden.device)
        path_tokens = torch.zeros(1, 0, dtype=torch.long, device=self.hidden.device)  # (F, d − 1)
        path_states = self.hidden.new_zeros(1, 0, self.hidden.shape[-1])  # (F, d − 1, H)
        for d in range(1, depth + 1):
            states = self._depth_forward(d, path_tokens, path_states)  # (F, d, H) depth d at L − d … L − 1
            logits, vocab = draft_vocab_logits(self.base, states[:, -1])  # (F, V'), the draft vocabulary's ids
            child_logps, child_tokens = torch.log_softmax(logits.float(), dim=-1).topk(self.shape.top_k, dim=-1)
            child_tokens = child_tokens if vocab is None else vocab[child_tokens]  # (F, k) token ids
            child_values = frontier_values[:, None] + child_logps  # (F, k) log of the path's probability product
            for parent, row_tokens, row_values in zip(frontier_paths, child_tokens.tolist(), child_values.tolist(),
                                                      strict=True):
                paths += [(*parent, rank) for rank in range(len(row_tokens))]
                tokens += row_tokens
                values += row_values
            if d == depth:
                break
            # expand next the frontier nodes of highest value among these children (EAGLE-2 §4.1)
            flat = child_values.flatten()
            chosen = flat.topk(min(self.shape.frontier, flat.numel())).indices  # (F',)
            parents, ranks = chosen // self.shape.top_k, chosen % self.shape.top_k
            frontier_paths = [(*frontier_paths[p], r) for p, r in zip(parents.tolist(), ranks.tolist(), strict=True)]
            frontier_values = flat[chosen]
            path_tokens = torch.cat([path_tokens[parents], child_tokens[parents, ranks][:, None]], dim=1)  # (F', d)
            path_states = states[parents]  # (F', d, H)
        return self._rerank(paths, tokens, values)

    def _rerank(self, paths: list[tuple[int, ...]], tokens: list[int], values: list[float]) -> tuple[Tree, list[int]]:
        """Re-ranking (§4.2): the tree of the ``budget`` drafted nodes of highest value and their tokens in its node
        order. A child is never worth more than its parent, and among equals the shallower node comes first, so the
        choice is prefix-closed."""
        token_of = {paths[i]: tokens[i] for i in value_order(paths, values)[: self.budget]}
        tree = build_tree(list(token_of))
        return tree, [token_of[path] for path in tree.choices]

    def _depth_forward(self, d: int, path_tokens: torch.Tensor, path_states: torch.Tensor) -> torch.Tensor:
        """Depth d's states at positions L − d … L − 1 (F, d, H) for each frontier path, and depth d's catch-up.

        ONE call of the shared layer runs (a) the positions that turned final since this depth last ran (up to
        L − d: their inputs are final tokens and depth d − 1's final states), kept in depth d's cache, and (b) for
        each of the F frontier paths (``path_tokens`` (F, d − 1): its drafts x_1 … x_{d−1}; ``path_states`` (F,
        d − 1, H): depth d − 1's states at L − d + 1 … L − 1 on that path), the positions L − d + 1 … L − 1, reading
        t_{j+d} = the path's drafts; each path's queries see the cache, the catch-up and their own earlier
        queries. Position L − d's state is final (catch-up), so it leads every path's states."""
        length, device = len(self.hidden), self.hidden.device
        cache, final = self.caches[d - 1], self.final_states[d - 1]
        previous = self.hidden if d == 1 else self.final_states[d - 2]  # depth d − 1's final states
        start, end = len(final), length - d + 1  # catch-up positions start … L − d
        catch_up = torch.arange(start, end, device=device)
        ahead = torch.tensor(self.tokens[start + d - 1 : end + d - 1], dtype=torch.long, device=device)  # t_{j+d}
        frontier, width = path_tokens.shape  # F paths of d − 1 positions
        # one projection of the catch-up (final tokens) and the paths (their drafts)
        queries = self.module.depth_input(self.base, torch.cat([previous[start:end], path_states.flatten(0, 1)]),
                                          torch.cat([ahead, path_tokens.flatten()]))[None]  # (1, C + F·(d−1), H)
        path_positions = torch.arange(end, length, device=device)  # L − d + 1 … L − 1
        positions = torch.cat([catch_up, path_positions.repeat(frontier)])
        mask = self._tree_mask(start, len(catch_up), frontier, width, queries.dtype, device)
        out = self.module.layer_step(self.base, queries, positions[None], mask, cache)[0]  # (C + F·(d−1), H)
        kept = len(catch_up)
        for layer in cache.layers:  # keep the final positions' keys only
            layer.keys, layer.values = layer.keys[:, :, : start + kept], layer.values[:, :, : start + kept]
        self.final_states[d - 1] = final = torch.cat([final, out[:kept]])
        lead = final[length - d].expand(frontier, 1, -1)  # (F, 1, H) position L − d, shared by every path
        return torch.cat([lead, out[kept:].reshape(frontier, width, out.shape[-1])], dim=1)  # (F, d, H)

    @staticmethod
    def _tree_mask(cached: int, catch_up: int, frontier: int, width: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """(1, 1, Q, cached + Q) additive, Q = ``catch_up`` + ``frontier`` · ``width``: every query sees the cached
        keys; the catch-up is causal over itself; each path's ``width`` queries see the whole catch-up and their own
        earlier queries, never another path's."""
        group = torch.cat([torch.full((catch_up,), -1, device=device),
                           torch.arange(frontier, device=device).repeat_interleave(width)])  # (Q,) −1: catch-up
        index = torch.cat([torch.arange(catch_up, device=device), torch.arange(width, device=device).repeat(frontier)])
        same_path_before = (group[None, :] == group[:, None]) & (index[None, :] <= index[:, None])  # (Q, Q)
        catch_up_key = (group[None, :] == -1) & (group[:, None] >= 0)
        visible = torch.cat([torch.ones(len(group), cached, dtype=torch.bool, device=device),
                             same_path_before | catch_up_key], dim=1)  # (Q, cached + Q)
        return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


def value_order(paths: Sequence[tuple[int, ...]], values: Sequence[float]) -> list[int]:
    """The drafted nodes (``paths``, their ``values``) in re-ranking order: highest value first, the shallower first
    among equals."""
    return sorted(range(len(paths)), key=lambda i: (-values[i], len(paths[i])))


class MTPBatchTreeDrafter(BatchPolicyTrail):
    """:class:`MTPTreeDrafter` for a batch of sequences (:class:`models.engine.batched.BatchDrafter`): every row's
    tree is the one :class:`MTPTreeDrafter` drafts for that row alone, and each depth runs the module's shared layer
    ONCE and the LM head once for the whole batch; the top-k, the frontier choice and the re-ranking run as tensors
    over the batch (no loop over rows). Greedy verification only (:class:`models.engine.batched.BatchGreedy`): the
    trees differ from row to row (:class:`~models.engine.speculative.RowTrees`, ``tree`` after each ``propose``).

    Layout: :class:`~models.mtp.module.BatchPolicyTrail`'s. Depth d's one call runs, as queries, each row's catch-up
    (positions [F_b^d, L_b − d], right-aligned in the longest row's width, padding on the left) and then, for each of
    the F frontier paths, its d − 1 positions L_b − d + 1 … L_b − 1 (reading the path's drafts); a per-row tree mask
    lets a path's queries see the row's cache, its catch-up and their own path's earlier queries. A row shorter than
    a depth (L_b < d: no position L_b − d) drafts no node there, as :class:`MTPTreeDrafter`'s depth = min(depth, L);
    when such a row cannot fill the budget, filler nodes (on no path, never accepted) pad its tree to N + 1."""

    def __init__(self, base, module: MTPModule, tree: DynamicTree, budget: int):
        if budget < 1:
            raise ValueError(f"a dynamic tree verifies at least one node besides the root, got budget {budget}")
        super().__init__(base, tree.depth)
        self.module, self.shape, self.budget = module, tree, budget

    @torch.no_grad()
    def propose(self, roots: torch.Tensor) -> tuple[torch.Tensor, None]:
        device, lengths, top_k = self.pending.device, self.lengths, self.shape.top_k
        batch = len(lengths)
        length = torch.tensor(lengths, device=device)[:, None]  # (B, 1) L_b
        depth = min(self.num_depths, max(lengths))  # deeper, no row has a position L_b − d
        # each depth's catch-up count C_b^d = L_b − d + 1 − F_b^d (≥ 1 for a row with L_b ≥ d: L grew since the last
        # draft), its finals after this draft, and how far each depth's finals lead the next's (its tail: 0 or 1)
        counts = [[max(0, n - d + 1 - f) for n, f in zip(lengths, self.final[d - 1], strict=True)]
                  for d in range(1, depth + 1)]
        behind = [[a - b for a, b in zip(self.final[d - 1], self.final[d], strict=True)] for d in range(1, depth)]
        finals = [[f + c for f, c in zip(self.final[d], counts[d], strict=True)] for d in range(depth)]
        hidden_size = self.pending.shape[-1]
        catch_up = self.pending  # depth d − 1's catch-up states, right-aligned (depth 0: the main model's)
        tails = list(self.tails)  # the next draft's; this draft reads self.tails
        # the frontier: its paths' tokens (B, F, d − 1), depth-(d − 1) states (B, F, d − 1, H), values (B, F), ranks
        # (B, F, D: child ranks from the root, −1 past the path) — at depth 1, the root alone
        path_tokens = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)
        path_states = catch_up.new_zeros(batch, 1, 0, hidden_size)
        frontier_values = torch.zeros(batch, 1, device=device)
        frontier_ranks = torch.full((batch, 1, depth), -1, dtype=torch.long, device=device)
        tokens, values, ranks, node_depths = [], [], [], []  # every drafted node, per depth (B, F·k) …
        for d in range(1, depth + 1):
            count = counts[d - 1]
            if d > 1:  # depth d − 1's states up to L − d (its catch-up's last is L − d + 1), after its tail
                catch_up = self._with_tails(catch_up[:, :-1], [max(0, c - 1) for c in counts[d - 2]], self.tails[d - 2],
                                            behind[d - 2])
            width = max(count)
            catch_up = catch_up[:, catch_up.shape[1] - width:]  # (B, C, H)
            frontier, span = path_tokens.shape[1:]  # F paths of d − 1 positions
            inputs = self.module.depth_input(
                self.base, torch.cat([catch_up, path_states.flatten(1, 2)], dim=1),
                torch.cat([self._final_tokens(width, device), path_tokens.flatten(1)], dim=1),
            )  # (B, C + F·(d − 1), H): t_{j+d} final in the catch-up, drafts on the paths
            positions = torch.cat([length - d - width + 1 + torch.arange(width, device=device),
                                   (length - d + 1 + torch.arange(span, device=device)).repeat(1, frontier)],
                                  dim=1).clamp(min=0)  # (B, C + F·(d − 1))
            mask = self._tree_mask(d, count, width, frontier, span, inputs.dtype)
            out = self.module.layer_step(self.base, inputs, positions, mask, self.caches[d - 1])
            self._keep_final(d, width, count)
            catch_up = out[:, :width]  # (B, C, H)
            if d < self.num_depths:  # depth d's state at L_b − d, the next draft's tail (F_b^{d+1} = L_b − d)
                tails[d - 1] = catch_up[:, -1]
            states = torch.cat([catch_up[:, -1:, None].expand(-1, frontier, -1, -1),
                                out[:, width:].reshape(batch, frontier, span, hidden_size)],
                               dim=2)  # (B, F, d, H) each path's depth-d states at L_b − d … L_b − 1
            logits, vocab = draft_vocab_logits(self.base, states[:, :, -1])  # (B, F, V')
            child_logps, child_tokens = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)  # (B, F, k)
            child_tokens = child_tokens if vocab is None else vocab[child_tokens]
            child_values = torch.where(length[..., None] >= d, frontier_values[..., None] + child_logps,
                                       float("-inf"))  # (B, F, k) a row without position L_b − d: no node
            child_ranks = frontier_ranks[:, :, None].repeat(1, 1, top_k, 1)  # (B, F, k, D)
            child_ranks[..., d - 1] = torch.arange(top_k, device=device)
            tokens.append(child_tokens.flatten(1))
            values.append(child_values.flatten(1))
            ranks.append(child_ranks.flatten(1, 2))
            node_depths.append(torch.full((frontier * top_k,), d, device=device))
            if d == depth:
                break
            # expand next the frontier nodes of highest value among these children (EAGLE-2 §4.1)
            flat = child_values.flatten(1)  # (B, F·k)
            chosen = flat.topk(min(self.shape.frontier, flat.shape[1]), dim=1).indices  # (B, F')
            parents = chosen // top_k
            frontier_values = flat.gather(1, chosen)
            frontier_ranks = ranks[-1].gather(1, chosen[..., None].expand(-1, -1, depth))
            path_tokens = torch.cat([path_tokens.gather(1, parents[..., None].expand(-1, -1, span)),
                                     tokens[-1].gather(1, chosen)[..., None]], dim=2)  # (B, F', d)
            path_states = states.gather(1, parents[..., None, None].expand(-1, -1, d, hidden_size))  # (B, F', d, H)
        self.final[:depth], self.tails = finals, tails
        self.pending = self.pending[:, :0]
        tree, nodes = self._rerank(torch.cat(values, dim=1), torch.cat(ranks, dim=1), torch.cat(node_depths))
        self.tree = tree
        return torch.cat([roots[:, None], torch.cat(tokens, dim=1).gather(1, nodes).to(roots.device)], dim=1), None

    def _rerank(self, values: torch.Tensor, ranks: torch.Tensor, depths: torch.Tensor
                ) -> tuple[RowTrees, torch.Tensor]:
        """Each row's tree of its ``budget`` drafted nodes of highest value (§4.2), from every drafted node's value
        (B, M), ranks from the root (B, M, D) and depth (M,), and those nodes (B, N) in the tree's node order:
        :func:`~models.engine.speculative.build_tree`'s, by depth, then ranks."""
        batch = len(values)
        # a stable sort: among equal values the earlier node, which is the shallower (nodes are drafted depth by
        # depth) — a child is never worth more than its parent, so the choice is prefix-closed, as at batch 1
        chosen = values.sort(dim=1, descending=True, stable=True).indices[:, : self.budget]  # (B, N)
        chosen_ranks = ranks.gather(1, chosen[..., None].expand(-1, -1, ranks.shape[2]))  # (B, N, D)
        order = torch.arange(chosen.shape[1], device=values.device).expand(batch, -1)
        for key in [*chosen_ranks.unbind(dim=2)[::-1], depths[chosen]]:  # least significant first: a radix sort
            order = order.gather(1, key.gather(1, order).sort(dim=1, stable=True).indices)
        nodes = chosen.gather(1, order)  # (B, N)
        node_ranks = F.pad(ranks.gather(1, nodes[..., None].expand(-1, -1, ranks.shape[2])), (0, 0, 1, 0),
                           value=-1)  # (B, N+1, D) the root first: no rank
        # node j is an ancestor of node i (or i) when j's ranks are a prefix of i's
        ancestors = ((node_ranks[:, None] == -1) | (node_ranks[:, None] == node_ranks[:, :, None])).all(dim=3)
        real = F.pad(values.gather(1, nodes) > float("-inf"), (1, 0), value=True)  # (B, N+1)
        node_depths = F.pad(depths[nodes], (1, 0))  # (B, N+1)
        return RowTrees.of_nodes(node_depths, ancestors, real), nodes

    def _tree_mask(self, d: int, count: Sequence[int], width: int, frontier: int, span: int, dtype: torch.dtype
                   ) -> torch.Tensor:
        """(B, 1, Q, T_d + Q) additive, Q = ``width`` + ``frontier`` · ``span``: every query sees its row's visible
        cached keys; the catch-up is causal over its real columns (:func:`right_aligned_causal`); each path's
        ``span`` queries see the row's real catch-up and their own path's earlier queries, never another path's."""
        device = self.visible[d - 1].device
        catch_up = right_aligned_causal(count, width, device)  # (B, C, C)
        real = torch.arange(width, device=device)[None] >= width - torch.tensor(count, device=device)[:, None]
        group = torch.arange(frontier, device=device).repeat_interleave(span)  # (F·s,) each path query's path
        index = torch.arange(span, device=device).repeat(frontier)
        own = (group[None, :] == group[:, None]) & (index[None, :] <= index[:, None])  # (F·s, F·s)
        paths = frontier * span
        new = torch.cat([torch.cat([catch_up, catch_up.new_zeros(len(count), width, paths)], dim=2),
                         torch.cat([real[:, None].expand(-1, paths, -1), own.expand(len(count), -1, -1)], dim=2)],
                        dim=1)  # (B, Q, Q)
        return cached_additive_mask(self.visible[d - 1], new, dtype)


def pool_size(shape: DynamicTree) -> int:
    """The most nodes a cycle drafts before re-ranking: ``top_k`` children of the root, then ``frontier`` × ``top_k``
    at each further depth (the largest budget that can be filled)."""
    return shape.top_k + (shape.depth - 1) * shape.frontier * shape.top_k


@dataclass
class BudgetCalibration:
    """``DynamicTree.budget: auto`` as measured (:func:`calibrate_budget`). A cycle drafting d depths and verifying n
    nodes costs F + D(d) + V(n + 1): the verification forward of n + 1 tokens, V (``costs``: width → seconds), the
    drafting of d depths, D(d) (``draft_seconds``: depth → seconds), and the rest of the cycle, F (``fixed_seconds``:
    the engine's bookkeeping). It gains τ(n, d) tokens (``tokens_per_cycle``: (nodes, depth) → the bonus token and the
    accepted drafts); ``budget`` and ``depth`` are the n and d of the highest τ(n, d) / (F + D(d) + V(n + 1)), tokens
    per second."""

    costs: dict[int, float]
    fixed_seconds: float
    draft_seconds: dict[int, float]
    tokens_per_cycle: dict[tuple[int, int], float]
    cycles: int
    budget: int
    depth: int

    def expected_speedup(self, nodes: int, depth: int | None = None) -> float:
        """τ(n, d) · V(1) / (F + D(d) + V(n + 1)): the cycle's tokens per second over a one-token forward's (greedy's
        step); d the chosen depth unless given."""
        depth = self.depth if depth is None else depth
        cycle = self.fixed_seconds + self.draft_seconds[depth] + self.costs[nodes + 1]
        return self.tokens_per_cycle[nodes, depth] * self.costs[1] / cycle

    def rows(self) -> list[dict]:
        """One row per measured width: its cost and, for a tree of that width drafted to the chosen depth, τ and the
        expected speedup."""
        return [{"width": width, "nodes": width - 1, "ms": 1000 * seconds, "cost_vs_one_token": seconds / self.costs[1],
                 **({"tau": self.tokens_per_cycle[width - 1, self.depth],
                     "expected_speedup": self.expected_speedup(width - 1)} if width > 1 else {})}
                for width, seconds in self.costs.items()]

    def depth_rows(self) -> list[dict]:
        """One row per depth d: its drafting time D(d), the best budget at that depth, its τ and expected speedup."""
        rows = []
        for depth, seconds in sorted(self.draft_seconds.items()):
            budgets = sorted(n for n, d in self.tokens_per_cycle if d == depth)
            nodes = max(budgets, key=lambda n: self.expected_speedup(n, depth))
            rows.append({"depth": depth, "draft_ms": 1000 * seconds, "nodes": nodes,
                         "tau": self.tokens_per_cycle[nodes, depth],
                         "expected_speedup": self.expected_speedup(nodes, depth)})
        return rows


CALIBRATION_COLUMNS = ["width", "nodes", "ms", "cost_vs_one_token", "tau", "expected_speedup"]
"""The columns of :meth:`BudgetCalibration.rows` (the one-token row has no τ)."""
DEPTH_COLUMNS = ["depth", "draft_ms", "nodes", "tau", "expected_speedup"]
"""The columns of :meth:`BudgetCalibration.depth_rows`."""


def best_tree(costs: dict[int, float], fixed_seconds: float, draft_seconds: dict[int, float],
              tokens_per_cycle: dict[tuple[int, int], float]) -> tuple[int, int]:
    """The budget n and depth d of the highest τ(n, d) / (F + D(d) + V(n + 1)) (:class:`BudgetCalibration`); on a
    tie the smaller n, then the shallower d."""
    if not tokens_per_cycle:
        raise ValueError("no candidate tree: tokens_per_cycle is empty")
    missing = sorted({n + 1 for n, _ in tokens_per_cycle} - set(costs))
    if missing:
        raise ValueError(f"no measured verification cost for the widths {missing}")
    undrafted = sorted({d for _, d in tokens_per_cycle} - set(draft_seconds))
    if undrafted:
        raise ValueError(f"no measured drafting time for the depths {undrafted}")
    return max(sorted(tokens_per_cycle),
               key=lambda key: tokens_per_cycle[key] / (fixed_seconds + draft_seconds[key[1]] + costs[key[0] + 1]))


class _RecordingTreeDrafter(MTPTreeDrafter):
    """:class:`MTPTreeDrafter` that records each draft–verify cycle: the drafts it accepted (each one's place in the
    re-ranking and depth) and every drafted node's depth in re-ranking order; how long drafting would take through
    each depth d (to the start of depth d + 1, or of the re-ranking, plus the re-ranking, which every depth ends
    with); and the cycle's wall time (from one draft to the next: drafting, verification and bookkeeping)."""

    def __init__(self, base, module: MTPModule, tree: DynamicTree, budget: int, clock: Callable[[], float]):
        super().__init__(base, module, tree, budget)
        self.clock, self.started = clock, None
        self.accepted_drafts: list[list[tuple[int, int]]] = []
        self.ranked: list[list[int]] = []
        self.draft_seconds: list[list[float]] = []
        self.cycle_seconds: list[float] = []
        self._starts: list[float] = []  # this draft's: each depth's start, then the re-ranking's
        self._drafted: tuple[list[tuple[int, ...]], list[float]] = ([], [])  # this draft's paths and values
        self.value_ranks: list[int] = []  # the last accepted tree's nodes' places in the re-ranking

    def propose(self, room: int) -> Draft:
        now = self.clock()
        if self.started is not None:
            self.cycle_seconds.append(now - self.started)
        self.started, self._starts = now, []
        draft = super().propose(room)
        rerank = self.clock() - self._starts[-1]  # the last start is the re-ranking's
        self.draft_seconds.append([start - now + rerank for start in self._starts[1:]])
        return draft

    def _depth_forward(self, d: int, path_tokens: torch.Tensor, path_states: torch.Tensor) -> torch.Tensor:
        self._starts.append(self.clock())
        return super()._depth_forward(d, path_tokens, path_states)

    def _rerank(self, paths, tokens, values):
        self._starts.append(self.clock())
        self._drafted = paths, values  # ranked in accept, outside the timed draft
        return super()._rerank(paths, tokens, values)

    def accept(self, draft: Draft, out, verdict) -> None:
        super().accept(draft, out, verdict)
        paths, values = self._drafted
        order = value_order(paths, values)
        place = {paths[i]: rank for rank, i in enumerate(order)}
        self.value_ranks = [place[path] for path in draft.tree.choices]  # node i + 1's place in the re-ranking
        nodes = verdict.path[1 : len(verdict.tokens)]
        self.accepted_drafts.append([(self.value_ranks[node - 1], int(draft.tree.depths[node])) for node in nodes])
        self.ranked.append([len(paths[i]) for i in order])


def kept_drafts(accepted: Sequence[tuple[int, int]], ranked_depths: Sequence[int], nodes: int, depth: int) -> int:
    """Of one cycle's drafts accepted from the widest tree (``accepted``: each one's place in the re-ranking and
    depth, from the root down), those a tree of ``nodes`` nodes drafted to ``depth`` would have kept: each draft's
    place among the nodes no deeper than ``depth`` (``ranked_depths``: every drafted node's depth, in re-ranking
    order) must be below ``nodes``. That tree is exactly the re-ranking's first ``nodes`` of those nodes — drafting
    stops after ``depth``, and nothing shallower depends on what is drafted deeper — a prefix-closed set (a node is
    never worth more than its parent; equal values rank the shallower first), so greedy verification walks the wide
    tree's accepted path as far as it stays inside it."""
    kept = 0
    for rank, node_depth in accepted:
        if node_depth > depth or sum(d <= depth for d in ranked_depths[:rank]) >= nodes:
            break
        kept += 1
    return kept


def calibrate_budget(model, base, module: MTPModule, shape: DynamicTree, prompts: Sequence[torch.Tensor],
                     max_new_tokens: int, eos: set[int], context_length: int,
                     clock: Callable[[], float] = time.perf_counter) -> BudgetCalibration:
    """``shape.budget: auto``: the budget and depth of the most tokens per second, from the policy's measured
    verification cost V(w) at each width (:func:`models.engine.speculative.verification_costs` after
    ``context_length`` tokens, the widths of :data:`~models.engine.speculative.VERIFICATION_WIDTHS` up to the whole
    pool, :func:`pool_size`), and, measured together in one greedy-verified decoding of ``prompts`` (each (1, L))
    with the widest candidate tree (``shape.depth`` deep), the drafter's acceptance τ(n, d) at every candidate budget
    n = w − 1 and depth d ≤ ``shape.depth`` and the drafting time D(d) through each depth.

    One decoding gives every τ(n, d) exactly, cycle by cycle (:func:`kept_drafts`; ``tests/test_dynamic_tree.py``
    checks it against decoding with each budget and depth). F is the median over cycles of the cycle's wall time less
    its drafting, less V of the widest candidate. EAGLE-2 (§4.2) fixes its budget and depth per device; measuring
    them here picks them for this policy, module and machine: a memory-bound forward (one token costs about what 16
    do) favours wide trees, a compute-bound one narrow ones, and a deep draft pays only where its last depths are
    accepted often enough to cover their drafting."""
    pool = pool_size(shape)
    widths = sorted({w for w in VERIFICATION_WIDTHS if w <= pool + 1} | {1, pool + 1})
    costs = verification_costs(model, widths, context_length, VERIFICATION_REPEATS, clock=clock)
    widest = widths[-1] - 1
    accepted: list[list[tuple[int, int]]] = []
    ranked: list[list[int]] = []
    draft_seconds: list[list[float]] = []
    cycle_seconds: list[float] = []
    for ids in prompts:
        drafter = _RecordingTreeDrafter(base, module, shape, widest, clock)
        speculative_generate(model, drafter, TreeVerifier(), ids, max_new_tokens, eos)
        accepted += drafter.accepted_drafts
        ranked += drafter.ranked
        cycle_seconds += drafter.cycle_seconds
        draft_seconds += drafter.draft_seconds[: len(drafter.cycle_seconds)]  # the cycles with a measured time
    if not cycle_seconds:
        raise ValueError(f"calibrating the dynamic tree's budget needs two draft cycles or more; {len(prompts)} "
                         f"prompts of up to {max_new_tokens} new tokens gave {len(accepted)}")
    full = [seconds for seconds in draft_seconds if len(seconds) == shape.depth]  # prefixes of at least depth tokens
    if not full:
        raise ValueError(f"calibrating the dynamic tree's depth needs prompts of at least {shape.depth} tokens")
    drafting = {d: statistics.median(seconds[d - 1] for seconds in full) for d in range(1, shape.depth + 1)}
    fixed = max(0.0, statistics.median(cycle - seconds[-1] for cycle, seconds in zip(cycle_seconds, draft_seconds,
                                                                                      strict=True))
                - costs[widest + 1])
    tau = {(w - 1, d): 1 + sum(kept_drafts(cycle, depths, w - 1, d) for cycle, depths in zip(accepted, ranked,
                                                                                           strict=True)) / len(accepted)
           for w in widths if w > 1 for d in range(1, shape.depth + 1)}
    budget, depth = best_tree(costs, fixed, drafting, tau)
    return BudgetCalibration(costs, fixed, drafting, tau, len(accepted), budget, depth)


def resolved_tree(model, base, module: MTPModule, shape: DynamicTree, prompts: Sequence[torch.Tensor],
                  max_new_tokens: int, eos: set[int]) -> tuple[DynamicTree, BudgetCalibration | None]:
    """``shape`` as the drafters run it: its budget and depth as configured (no calibration), or with ``budget:
    auto`` those :func:`calibrate_budget` picks on ``prompts`` (training prompts, each (1, L); their first
    ``shape.calibration_prompts``), its forwards timed after :func:`models.engine.speculative.budget_context` of
    them, and the calibration."""
    if shape.budget != "auto":
        return shape, None
    prompts = list(prompts)[: shape.calibration_prompts]
    if not prompts:
        raise ValueError("dynamic_tree.budget: auto needs training prompts to calibrate on; none were given")
    context = budget_context([ids.shape[1] for ids in prompts], max_new_tokens)
    calibration = calibrate_budget(model, base, module, shape, prompts, max_new_tokens, eos, context)
    return shape.model_copy(update={"budget": calibration.budget, "depth": calibration.depth}), calibration
