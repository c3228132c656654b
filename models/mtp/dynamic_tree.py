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

Draft vocabulary (EAGLE-3, Li et al. 2025, §3.2; FR-Spec, Zhao et al. 2025): the module's logits may be restricted
to the most frequent tokens of the training responses (``MTPModule.draft_vocab``, read by
:func:`models.mtp.module.draft_parts`), so the LM head it reads shrinks from the
policy's whole vocabulary (49,152 rows for SmolLM2: 2.3 ms per depth on the 2-core CPU) to a few thousand rows
(0.3 ms for 4,096). A token outside it is never drafted; verification is unchanged, so the output is not.
"""

from __future__ import annotations

import torch

from models.engine.config import DynamicTree
from models.engine.speculative import Draft, Tree, build_tree
from models.mtp.module import MTPModule, PolicyTrail, draft_vocab_logits


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
        # re-rank (§4.2): the budget nodes of highest value; a child is never worth more than its parent, and among
        # equals the shallower node comes first, so the choice is prefix-closed
        order = sorted(range(len(paths)), key=lambda i: (-values[i], len(paths[i])))[: self.budget]
        token_of = {paths[i]: tokens[i] for i in order}
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
        inputs = [self.module.depth_input(self.base, previous[start:end], ahead)]  # (C, H)
        frontier, width = path_tokens.shape  # F paths of d − 1 positions
        if width:
            inputs.append(self.module.depth_input(self.base, path_states, path_tokens).flatten(0, 1))  # (F·(d−1), H)
        queries = torch.cat(inputs)[None]  # (1, C + F·(d−1), H)
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
