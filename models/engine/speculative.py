"""Tree speculative decoding: draft a sparse tree of candidates, verify it in ONE forward, keep the best path.

The engine shared by every "predict ahead" decoder of the project — Medusa / RLMedusa heads, MTP's chained
drafts, COrAL's blockwise tree (docs/medusa.md, docs/mtp.md, docs/coral.md). It follows Medusa (Cai et al.
2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", §2.1.2 tree
attention, §2.3.1 typical acceptance), built as a pipeline of small pure functions:

    draft (drafter)  →  candidates on a tree (:func:`tree_candidates`)
      →  tree forward (:func:`tree_forward`: position ids = cache length + depth, additive 4-D mask)
      →  evaluate (:func:`verify_greedy` lossless | :func:`verify_typical` lossy | :func:`verify_speculative_sampling`)
        (:func:`verify_rows`: speculative sampling of a batch;
         :func:`verify_tree_sampling`: speculative sampling of a tree of top-k candidates, EAGLE-2's)
      →  update (:func:`keep_accepted`: gather the accepted nodes' keys/values into the cache)

Sliding-window attention (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``). The cache comes from
:func:`speculative_cache`: a sliding-window layer records its past until :func:`keep_accepted` has picked the
accepted nodes, then is cut back to its window, and each tree forward gets one mask per attention kind
(:func:`tree_masks`): a node at position p sees the prefix keys less than the window behind p, as plain
decoding would. Cache layers that cannot be rolled back by index (recurrent / linear attention, sparse-index,
quantised) are refused up front, naming the layer.

Devices and dtypes. Every tensor is made on the device of what it is combined with (the tree forward on the
model's device, its mask in the model's dtype: verification runs in the policy's dtype). A ``generator`` passed
to the sampling functions must live on the device of the probabilities it draws from
(``torch.Generator(device=probs.device)``, e.g. ``cuda:0``); a mismatch is refused with that advice.

The tree. A candidate tree is a set of *choices*: paths of per-depth ranks, e.g. ``(0, 1)`` = "the
drafter's best token for position +1, then its second-best for position +2". Node 0 is the *root*: the
last token already decided, not yet in the cache. A node at depth d ≥ 1 holds the drafter's rank-r token
for the d-th position after the root. Every node attends to the prefix and to its ancestors (itself
included), never to siblings.

One step. All N + 1 tree tokens run through the model in one forward; the model's argmax at a node is the
true greedy next token after that node's path. Greedy verification accepts along a path while the child's
token equals its parent's argmax, and picks the path with most accepted nodes: the accepted tokens are
exactly what greedy decoding would have produced, one by one (lossless — tests compare token for token). The
argmax at the last accepted node is the next root (the "bonus" token), so every step gains ≥ 1 token.

The loop. :func:`speculative_stream` is the one outer loop of every method; what differs is plugged in:

    prefill (``drafter.prefill``)
      → repeat: ``drafter.propose`` → ``forward`` (default :func:`tree_forward`) → ``verifier`` → :class:`Verdict`
                → :func:`keep_accepted` → ``drafter.accept``          (until an end token or max_new_tokens)

* Medusa: :class:`TreeDrafter` over the heads + :class:`TreeVerifier` (greedy or typical).
* MTP: its chain drafter with one KV cache per depth + :class:`TreeVerifier` or :class:`SamplingVerifier`; its
  dynamic tree (EAGLE-2's top-k expansion) + :class:`TreeVerifier` or :class:`TreeSamplingVerifier`.
* COrAL: its ensemble drafter + eq. 6/7/8 verifier + target-aware tree forward; its root is the prompt's
  last token (prefilled without it, re-fed each step), and a step may accept a prefix of a path, no bonus.

Adapting (:class:`models.engine.config.Adaptation`). A cycle pays only when it gains more tokens than the plain
steps its time would buy: on open-ended text Medusa's heads gained τ ≈ 1.08 per cycle (0.65× greedy), MTP's
drafts τ ≈ 1.3 per cycle of ~2 plain forwards (0.5× sampling). So the loop watches τ over the last few cycles
against a cycle's cost c (configured, or measured from the run's own step times) and, while τ < c, runs plain
steps — ``drafter.plain``: the root alone on :func:`root_tree`, one token, no drafter forward — probing with one
cycle every so many plain tokens. A plain step is greedy's step (greedy verification) or a draw from the
model itself (speculative sampling), so the output stays exactly what it was.

Why it pays on a CPU. A forward of a 135M model at batch 1 is memory-bound (every weight is read once
per forward), so scoring ~20 tree tokens costs little more than scoring one. :func:`verification_costs` measures
where that stops on the machine at hand, and :func:`models.mtp.dynamic_tree.calibrate_budget` weighs it against the
drafter's acceptance to choose the width of a dynamic tree (EAGLE-2's budget,
:class:`models.engine.config.DynamicTree`).

Counters (:class:`SpeculativeStats`): generated tokens / model forwards, the prefill and plain steps included
(greedy is 1.0); τ per draft–verify cycle and the acceptance rate α count cycles only.
"""

from __future__ import annotations

import functools
import heapq
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

from models.engine.config import Adaptation, TypicalAcceptance
from models.engine.kv_cache import cache_kwargs


@dataclass(frozen=True)
class Tree:
    """A candidate tree with N + 1 nodes (node 0 = the root), nodes sorted by depth then path."""

    choices: tuple[tuple[int, ...], ...]  # the paths of ranks, one per non-root node, in node order 1..N
    depths: torch.Tensor  # (N+1,) node depth, root 0
    ranks: torch.Tensor  # (N+1,) rank of the node's token among its depth's draft candidates (root: 0)
    ancestors: torch.Tensor  # (N+1, N+1) bool: [i, j] = node j is node i or one of its ancestors
    paths: torch.Tensor  # (P, D+1) node indices of every root-to-leaf path, padded with -1

    @property
    def depth(self) -> int:
        """Positions drafted beyond the root (the tree's depth D)."""
        return int(self.depths.max())

    @property
    def size(self) -> int:
        """Nodes per tree forward, the root included."""
        return len(self.depths)

    def top_k(self) -> int:
        """How many candidates per depth the tree reads (1 + the largest rank)."""
        return int(self.ranks.max()) + 1


def build_tree(choices: Sequence[Sequence[int]]) -> Tree:
    """The tree of ``choices`` (Medusa's "medusa_choices"); missing prefixes of a path are added.

    ``[(0,), (1,), (0, 0)]``: nodes root, +1 best, +1 second, +2 best after +1 best.
    """
    paths = {tuple(int(r) for r in c) for c in choices}
    if not paths or any(len(p) == 0 for p in paths):
        raise ValueError("tree choices must be non-empty paths of ranks, e.g. [[0], [1], [0, 0]]")
    if any(r < 0 for p in paths for r in p):
        raise ValueError(f"tree ranks must be ≥ 0, got {sorted(paths)}")
    paths |= {p[:i] for p in paths for i in range(1, len(p))}
    ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(ordered)}
    n = len(index)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for path, i in index.items():
        for d in range(len(path) + 1):
            ancestors[i, index[path[:d]]] = True
    leaves = [p for p in ordered if not any(q[: len(p)] == p and len(q) > len(p) for q in ordered)]
    depth = max(len(p) for p in ordered)
    path_nodes = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path_nodes[row, : len(leaf) + 1] = torch.tensor([index[leaf[:d]] for d in range(len(leaf) + 1)])
    return Tree(choices=ordered,
                depths=torch.tensor([0] + [len(p) for p in ordered]),
                ranks=torch.tensor([0] + [p[-1] for p in ordered]),
                ancestors=ancestors, paths=path_nodes)


def sparse_tree(rank_accuracy: Sequence[Sequence[float]], size: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree (§2.1.2): the ``size`` paths with the highest estimated acceptance probability.

    ``rank_accuracy[d][r]``: how often the drafter's rank-r token for position d + 1 is the right one
    (measured on held-out data). A path's probability is the product of its ranks' accuracies (heads
    assumed independent); expanding best-first keeps the choice prefix-closed, because a child is never
    likelier than its parent. Returns the choices, for :func:`build_tree`.
    """
    if size < 1:
        raise ValueError(f"a tree needs at least one node besides the root, got size {size}")
    depth = len(rank_accuracy)
    frontier = [(-float(p), (r,)) for r, p in enumerate(rank_accuracy[0])]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < size:
        negative_p, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r, p in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (negative_p * float(p), path + (r,)))
    return chosen


def likeliest_paths(target_ranks: torch.Tensor, num_ranks: int, count: int) -> list[tuple[tuple[int, ...], float]]:
    """The ``count`` paths held-out data accepts most often, each with that frequency, most frequent first.

    ``target_ranks[i, d]`` (N, D): at held-out position i, the drafter's rank of the right token for position
    d + 1 (``num_ranks`` or more where it is not among the top ``num_ranks``, or where there is none). A path
    is accepted at i when the right token holds its rank at every depth, so its frequency is measured jointly:
    :func:`sparse_tree` multiplies per-depth accuracies as if the drafts erred independently, but a head that is
    right at +1 is more often right at +2, which makes deep top-1 chains likelier than the product says. A
    tree's expected tokens per cycle is 1 + the sum of its paths' frequencies (one path at most is accepted to
    each depth). Expanding best-first keeps the choice prefix-closed (no path is accepted more often than its
    prefix); paths never accepted are left out, so fewer than ``count`` may come back.
    """
    if count < 1:
        raise ValueError(f"a tree needs at least one node besides the root, got size {count}")
    positions, depth = target_ranks.shape

    def frontier_of(path: tuple[int, ...], matches: torch.Tensor) -> list[tuple[float, tuple[int, ...]]]:
        # the children of ``path`` accepted somewhere, from the ranks at its next depth where it is accepted
        counts = torch.bincount(target_ranks[matches, len(path)].clamp(max=num_ranks), minlength=num_ranks + 1)
        return [(-counts[r].item() / positions, (*path, r)) for r in range(num_ranks) if counts[r] > 0]

    frontier = frontier_of((), torch.ones(positions, dtype=torch.bool, device=target_ranks.device))
    heapq.heapify(frontier)
    chosen: list[tuple[tuple[int, ...], float]] = []
    while frontier and len(chosen) < count:
        negative_frequency, path = heapq.heappop(frontier)
        chosen.append((path, -negative_frequency))
        if len(path) < depth:
            matches = (target_ranks[:, : len(path)] == torch.tensor(path, device=target_ranks.device)).all(dim=1)
            for item in frontier_of(path, matches):
                heapq.heappush(frontier, item)
    return chosen


def chain_tree(depth: int) -> Tree:
    """A single path of top-1 drafts (what MTP and most draft models propose)."""
    return build_tree([(0,) * depth])


@functools.cache
def root_tree() -> Tree:
    """The "tree" of a step that drafts nothing: the root alone, so its forward is a plain one-token forward."""
    return Tree(choices=(), depths=torch.tensor([0]), ranks=torch.tensor([0]),
                ancestors=torch.ones(1, 1, dtype=torch.bool), paths=torch.tensor([[0]]))


@dataclass(frozen=True)
class RowTrees:
    """Each row's own tree in a batched step (EAGLE-2's dynamic tree drafted per row,
    :class:`models.mtp.dynamic_tree.MTPBatchTreeDrafter`): N + 1 nodes in every row (node 0 the root), each row its
    own shape. It has :class:`Tree`'s fields that the batched engine reads, with a leading batch dimension, so
    :func:`greedy_match`, :func:`accepted_paths` and :func:`models.engine.batched.batch_tree_inputs` take either (a
    shared tree broadcasts to every row)."""

    depths: torch.Tensor  # (B, N+1) node depth, root 0
    ancestors: torch.Tensor  # (B, N+1, N+1) bool: [b, i, j] = in row b, node j is node i or one of its ancestors
    paths: torch.Tensor  # (B, P, D+1) node indices of every root-to-leaf path, padded with -1 (rows of -1: no path)

    @property
    def size(self) -> int:
        """Nodes per row of the tree forward, the root included."""
        return self.depths.shape[-1]

    @classmethod
    def stack(cls, trees: Sequence[Tree]) -> RowTrees:
        """One row per tree, all of the same size; shorter path lists and paths are padded with -1."""
        if len({tree.size for tree in trees}) != 1:
            raise ValueError(f"row trees need one node count, got sizes {[tree.size for tree in trees]}")
        count, width = max(len(t.paths) for t in trees), max(t.paths.shape[1] for t in trees)
        paths = [F.pad(t.paths, (0, width - t.paths.shape[1], 0, count - len(t.paths)), value=-1) for t in trees]
        return cls(depths=torch.stack([t.depths for t in trees]), ancestors=torch.stack([t.ancestors for t in trees]),
                   paths=torch.stack(paths))

    @classmethod
    def of_nodes(cls, depths: torch.Tensor, ancestors: torch.Tensor, real: torch.Tensor) -> RowTrees:
        """The trees of each row's node ``depths`` (B, N+1) and ``ancestors`` (B, N+1, N+1); ``real`` (B, N+1): the
        nodes that may be accepted — the others are filler (a row that drafted fewer than N nodes) and lie on no
        path. A path per real leaf, in node order."""
        children = (ancestors & real[:, :, None]).sum(dim=1) - 1  # (B, N+1) real nodes below each node
        leaves = real & (children == 0)
        levels = torch.arange(int(depths.max()) + 1, device=depths.device)
        on_level = ancestors[..., None] & (depths[:, None, :, None] == levels)  # (B, N+1, N+1, D+1) [b, i, j, t]
        paths = torch.where(on_level.any(dim=2), on_level.int().argmax(dim=2), -1)  # (B, N+1, D+1) node i's path
        return cls(depths=depths, ancestors=ancestors, paths=torch.where(leaves[..., None], paths, -1))


def tree_candidates(root_token: int, draft_logits: torch.Tensor, tree: Tree) -> torch.Tensor:
    """The tree's N + 1 tokens: the root, then each node's rank-r draft token at its depth, from ``draft_logits``
    (D', V) with D' ≥ the tree's depth."""
    return batch_candidates(torch.tensor([root_token]), draft_logits[None], tree)[0]


def batch_candidates(roots: torch.Tensor, draft_logits: torch.Tensor, tree: Tree) -> torch.Tensor:
    """:func:`tree_candidates` of a batch: each row's N + 1 tokens (B, N+1) from its root (B,) and its draft logits
    (B, D', V)."""
    if draft_logits.shape[1] < tree.depth:
        raise ValueError(f"the tree is {tree.depth} deep but the drafter predicts {draft_logits.shape[1]} positions")
    top = draft_logits[:, : tree.depth].topk(tree.top_k(), dim=-1).indices  # (B, D, k)
    depths, ranks = tree.depths.to(top.device), tree.ranks.to(top.device)
    tokens = top[:, (depths - 1).clamp(min=0), ranks]  # (B, N+1)
    tokens[:, 0] = roots.to(top.device)
    return tokens


def tree_attention_inputs(tree: Tree, past_length: int, dtype: torch.dtype, device: torch.device,
                          window: int | None = None, kept_prefix: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (1, N+1) and the additive 4-D mask (1, 1, N+1, kept+N+1) of a tree forward.

    Positions are ``past_length + depth`` (siblings share a position; HF's default arange would be
    wrong). The mask is float (0 = attend, dtype min = blocked): transformers uses a 4-D mask as given,
    and a boolean one is read differently by different attention kernels.

    A full-attention layer sees the whole prefix (``kept_prefix`` = ``past_length``, the default). A
    sliding-window layer hands attention only its ``kept_prefix`` most recent prefix keys, and a query at
    position p may see keys at positions > p − ``window`` only (transformers' sliding-window rule).
    """
    kept = past_length if kept_prefix is None else kept_prefix
    query_positions = (past_length + tree.depths).to(device)  # (N+1,)
    key_positions = torch.cat([torch.arange(past_length - kept, past_length, device=device), query_positions])
    visible = torch.cat([torch.ones(tree.size, kept, dtype=torch.bool, device=device),
                         tree.ancestors.to(device)], dim=1)  # (N+1, kept+N+1)
    if window is not None:
        visible &= (query_positions[:, None] - key_positions[None, :]) < window
    blocked = torch.finfo(dtype).min
    mask = torch.where(visible, 0.0, blocked).to(dtype)  # (N+1, kept+N+1)
    return query_positions[None], mask[None, None]  # (1, N+1), (1, 1, N+1, kept+N+1)


def _layer_types(model, cache: DynamicCache) -> list[str]:
    """The attention kind of each cache layer: the config's ``layer_types`` where it has them (Gemma, Qwen2),
    else one kind for all (Llama: full; Mistral: sliding with ``sliding_window`` set)."""
    declared = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    return list(declared) if declared is not None else ["attention"] * len(cache.layers)


def tree_masks(model, tree: Tree, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
    """Position ids (1, N+1) and the tree forward's attention mask in the model's dtype and on its device: ONE
    4-D mask when every layer attends alike, else one per layer kind, keyed as the config's ``layer_types``
    (the dict that Gemma / Qwen2-style models take as ``attention_mask``). Each kind's mask is sized to the keys
    its cache layer hands attention (``get_mask_sizes``, as transformers sizes its own masks)."""
    past_length = cache.get_seq_length()
    masks: dict[str, torch.Tensor] = {}
    position_ids = None
    for kind, layer in zip(_layer_types(model, cache), cache.layers, strict=True):
        if kind in masks or isinstance(layer, DummyLayer):  # a shared-KV layer reads another layer's keys
            continue
        kv_length, _ = layer.get_mask_sizes(tree.size)
        window = layer.sliding_window if layer.is_sliding else None
        position_ids, masks[kind] = tree_attention_inputs(tree, past_length, model.dtype, model.device, window,
                                                          kept_prefix=kv_length - tree.size)
    return position_ids, (next(iter(masks.values())) if len(masks) == 1 else masks)


def tree_forward(model, tokens: torch.Tensor, tree: Tree, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the tree's tokens after the cached prefix: logits (N+1, V) and final hidden states (N+1, H).

    The cache grows by N + 1 positions (all nodes); :func:`keep_accepted` drops the rejected ones.
    """
    position_ids, mask = tree_masks(model, tree, cache)
    out, hidden = last_hidden_forward(model, input_ids=tokens.to(model.device)[None], position_ids=position_ids,
                                      attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)
    return out.logits[0], hidden[0]


def accepted_paths(tree: Tree | RowTrees, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``match`` (B, N+1) — ``match[b, i]``: node i would be accepted given its parent is (root:
    True) — the path of its tree (``tree``: shared, or each row's) with the longest run of accepted children (ties:
    the first path): its node indices (B, D+1), root first, entries past the count being filler, and the accepted
    count, root included (B,)."""
    paths = tree.paths.to(match.device).expand(len(match), -1, -1)  # (B, P, D+1)
    ok = match.gather(1, paths.clamp(min=0).flatten(1)).view_as(paths) & (paths >= 0)  # (B, P, D+1)
    accepted = ok.long().cumprod(dim=2).sum(dim=2)  # (B, P) root included
    best = accepted.argmax(dim=1)  # (B,) the first longest
    nodes = paths.gather(1, best[:, None, None].expand(-1, 1, paths.shape[2]))[:, 0]  # (B, D+1)
    return nodes.clamp(min=0), accepted.gather(1, best[:, None])[:, 0]


def _accepted_path(tree: Tree, match: torch.Tensor) -> list[int]:
    """:func:`accepted_paths` of one row ``match`` (N+1,): the accepted nodes, root first."""
    nodes, counts = accepted_paths(tree, match[None])
    return nodes[0, : int(counts[0])].tolist()


def greedy_match(tokens: torch.Tensor, predictions: torch.Tensor, tree: Tree | RowTrees) -> torch.Tensor:
    """Which nodes greedy verification accepts given their parent is (..., N+1): the node's token is its parent's
    argmax (``predictions``, the model's argmax at each node); the root always. ``tree``: shared, or each row's."""
    parents = _parents(tree).to(tokens.device).clamp(min=0).expand_as(predictions)  # (..., N+1)
    match = tokens == predictions.gather(-1, parents)
    match[..., 0] = True
    return match


def top_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension — the first index on a tie, as ``argmax`` documents — computed by ``max``:
    on the CPU ``argmax`` of bf16 logits runs ~5× slower (measured, 16 × 49,152 logits: 1.34 ms against 0.23 ms; a
    2-3 % of a batch-16 plain step), where HF's greedy casts its last logits to float32 first; a float32 copy of a
    tree's logits would cost memory on a GPU (batch × nodes × vocabulary)."""
    return logits.max(dim=-1).indices


def verify_greedy(tokens: torch.Tensor, logits: torch.Tensor, tree: Tree) -> list[int]:
    """Lossless: a node is accepted when its token is its parent's argmax. Returns the accepted nodes."""
    tokens = tokens.to(logits.device)  # drafts may come from another device than the verifying model
    return _accepted_path(tree, greedy_match(tokens, top_tokens(logits), tree))



def verify_typical(tokens: torch.Tensor, logits: torch.Tensor, tree: Tree, rule: TypicalAcceptance) -> list[int]:
    """Lossy: accept a child whose token is "typical" under its parent's distribution. Returns accepted nodes."""
    probs = torch.softmax(logits.float() / rule.typical_temperature, dim=-1)  # (N+1, V)
    tokens = tokens.to(logits.device)  # drafts may come from another device than the verifying model
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)  # (N+1,)
    threshold = torch.minimum(torch.full_like(entropy, rule.typical_threshold),
                              rule.typical_alpha * torch.exp(-entropy))
    parents = _parents(tree).to(tokens.device).clamp(min=0)
    match = probs[parents, tokens] > threshold[parents]
    match[0] = True
    return _accepted_path(tree, match)


def verify_speculative_sampling(draft_tokens: Sequence[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                                generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling on a chain (Leviathan et al. 2023, Chen et al. 2023): LOSSLESS for sampling.

    ``draft_probs`` (D, V): the distribution each draft token was sampled from (one-hot for top-1 drafts);
    ``target_probs`` (D+1, V): the model's distribution at the root and after each draft. Draft d is accepted
    with probability min(1, p(x)/q(x)); at the first rejection the next token is drawn from
    norm(max(0, p − q)), and when every draft passes, a bonus token from the last p. Every emitted token is
    then distributed exactly as sampling from the model one token at a time.

    ``generator`` (optional) must be on ``target_probs``' device; ``draft_probs`` may be anywhere (drafts may
    run elsewhere) and are moved there. Returns (accepted drafts, next token): :func:`verify_rows` of one row.
    """
    device = target_probs.device
    drafts = torch.as_tensor(list(draft_tokens), dtype=torch.long, device=device)[None]  # (1, D)
    accepted, token = verify_rows(drafts, draft_probs[None], target_probs[None], [generator])
    return tuple(torch.stack([accepted, token], dim=1)[0].tolist())  # one host sync


def verify_rows(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_speculative_sampling` of B chains at once, row b with ``generators[b]``: ``drafts`` (B, D),
    ``draft_probs`` (B, D, V), ``target_probs`` (B, D+1, V) → accepted drafts (B,) and next tokens (B,), on
    ``target_probs``' device, with no host sync (the accept tests are one comparison, the draws
    :func:`draw_rows`). Each row consumes its generator as one row alone did: D uniforms, then one draw.
    D = 0 (a plain step): a draw from the model at the root."""
    device = target_probs.device
    for generator in generators:
        _check_generator(generator, device)
    drafts, draft_probs = drafts.to(device), draft_probs.to(device)
    batch, depth = drafts.shape
    if depth:
        uniforms = torch.stack([torch.rand(depth, generator=g, device=device) for g in generators])  # (B, D)
        p = target_probs[:, :depth].gather(2, drafts[..., None])[..., 0]  # (B, D) p(draft)
        q = draft_probs.gather(2, drafts[..., None])[..., 0]  # (B, D) q(draft)
        passed = uniforms * q <= p  # u < p/q, without dividing by a zero q
        accepted = passed.long().cumprod(dim=1).sum(dim=1)  # (B,) drafts before the first rejection
    else:
        accepted = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    p = target_probs[rows, accepted]  # (B, V) at the first rejection, or after the last draft (the bonus)
    q = F.pad(draft_probs, (0, 0, 0, 1))[rows, accepted]  # (B, V) zero at the bonus position
    residual = (p - q).clamp(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    # the bonus draws from p itself; p == q exactly (total 0): any draw from p is right
    law = torch.where((accepted < depth)[:, None] & (total > 0), residual / total, p)  # (B, V)
    return accepted, draw_rows(law, generators)


def verify_tree_sampling(tokens: torch.Tensor, target_probs: torch.Tensor, tree: Tree,
                         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Speculative sampling on a TREE of deterministic candidates (a drafter's top-k at each node): LOSSLESS for
    sampling. Returns the accepted nodes, root first, and the next token.

    ``tokens`` (N+1,): the tree's tokens, the root first; ``target_probs`` (N+1, V): the model's distribution after
    each node. From the root: with p = the law at the current node, its children x_1, x_2, … are tried in node
    order (rank order); child x_j passes with probability p(x_j) / (mass p has left); on rejection p(x_j) is set to
    0 (and p renormalised); on a pass the walk moves to that child and repeats. Where no child passes (or at a
    leaf) the next token is drawn from what is left of p.

    Why it is exact. This is SpecInfer's multi-step speculative sampling (Miao et al. 2024, "SpecInfer", §4) with
    every candidate's draft law a point mass q = one-hot(x): min(1, p(x)/q(x)) = p(x), and the residual
    norm(max(0, p − q)) is p without x — the rule EAGLE-2 (Li et al. 2024) verifies its top-k trees with; on a
    chain it is Leviathan et al. 2023's rule with one-hot drafts. At a node, child x_j passes with probability
    Π_{i<j} (1 − p(x_i) / (1 − Σ_{l<i} p(x_l))) · p(x_j) / (1 − Σ_{i<j} p(x_i)) = p(x_j) (the product
    telescopes to 1 − Σ_{i<j} p(x_i)), and a token t no child holds comes out with probability
    (1 − Σ_i p(x_i)) · p(t) / (1 − Σ_i p(x_i)) = p(t): the token leaving each node is a draw from p, i.e. exactly
    "draw x ~ p, walk to the child holding x, if any". By induction each emitted token is a draw from the model
    given everything before it, whatever chose the candidates, provided the choice does not see this function's
    random numbers. A token repeated among siblings has p = 0 left when its second copy's turn comes, so that copy
    never passes (the law stays p).

    One pass, one host sync: a uniform is drawn for every non-root node up front. Node i's test u_i · (mass its
    parent has left after its earlier siblings' rejections) < (p(x_i) unless an earlier sibling holds x_i) is the
    walk's own test whenever the walk reaches it (its parent reached, its earlier siblings rejected), so the path is
    the chain of first-passing children from the root, and unread uniforms change no law. ``generator``: on
    ``target_probs``' device (``tokens`` are moved there). :func:`verify_tree_rows` of one row.
    """
    nodes, counts, token = verify_tree_rows(tokens[None], target_probs[None], tree, [generator])
    flags = torch.cat([counts, nodes[0], token]).tolist()  # one host sync
    return flags[1 : 1 + flags[0]], flags[-1]


def verify_tree_rows(tokens: torch.Tensor, target_probs: torch.Tensor, tree: Tree | RowTrees,
                     generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify_tree_sampling` of B rows at once, row b with ``generators[b]`` (each consumes its generator as
    one row alone does: N uniforms, then one draw): ``tokens`` (B, N+1), ``target_probs`` (B, N+1, V), ``tree``
    shared by the rows or each row's own (:class:`RowTrees`, whose filler nodes — on no path — never pass) →
    each row's accepted nodes (B, D+1), root first, entries past its count filler; the count, root included
    (B,); and the next token (B,). No host sync."""
    device = target_probs.device
    for generator in generators:
        _check_generator(generator, device)
    tokens, probs = tokens.to(device), target_probs.float()
    batch, size = tokens.shape
    rows = torch.arange(batch, device=device)[:, None]
    parents = _parents(tree).to(device).expand(batch, -1)  # (B, N+1) root: -1
    depths = tree.depths.to(device).expand(batch, -1)  # (B, N+1)
    ancestors = tree.ancestors.to(device).expand(batch, -1, -1)  # (B, N+1, N+1)
    paths = tree.paths.to(device).expand(batch, -1, -1)  # (B, P, D+1)
    real = torch.zeros(batch, size + 1, dtype=torch.bool, device=device).scatter(
        1, (paths.flatten(1) % (size + 1)), True)[:, :size]  # (B, N+1) on some path (-1 lands in the extra column)
    nodes = torch.arange(size, device=device)
    # (B, N+1, N+1) [b, i, j]: node j is an earlier sibling of node i (tried before it); filler is never tried
    earlier = ((parents[:, :, None] == parents[:, None, :]) & (nodes[None, None, :] < nodes[None, :, None])
               & real[:, None, :])
    repeated = (earlier & (tokens[:, :, None] == tokens[:, None, :])).any(dim=2)  # (B, N+1) x_i already rejected
    offered = torch.where(repeated | ~real, 0.0, probs[rows, parents.clamp(min=0), tokens])  # (B, N+1) p(x_i) left
    left = (probs.sum(dim=-1).gather(1, parents.clamp(min=0))
            - (earlier.float() @ offered[..., None])[..., 0]).clamp(min=0)  # (B, N+1) the parent's mass left
    uniforms = F.pad(torch.stack([torch.rand(size - 1, generator=g, device=device) for g in generators]),
                     (1, 0))  # (B, N+1) root: unused
    passes = uniforms * left < offered  # u < p(x) / left, without dividing by a zero left
    passes[:, 0] = True
    first = passes & ~(earlier & passes[:, None, :]).any(dim=2)  # (B, N+1) the first passing child of its parent
    on_path = ~(ancestors & ~first[:, None, :]).any(dim=2)  # (B, N+1) every ancestor passed first
    last = torch.where(on_path, depths, -1).argmax(dim=1)  # (B,) the deepest node reached
    tried = torch.zeros_like(probs[:, 0]).scatter_add_(1, tokens, ((parents == last[:, None]) & real).float())  # (B, V)
    law = torch.where(tried > 0, 0.0, probs[rows[:, 0], last])  # (B, V) p with every rejected child removed
    # all mass rejected can only be rounding: any draw from p
    law = torch.where(law.sum(dim=-1, keepdim=True) > 0, law, probs[rows[:, 0], last])
    counts = on_path.sum(dim=1)  # (B,) root included
    # the path's nodes by depth (the others after them, as filler)
    order = torch.where(on_path, depths, size + depths).argsort(dim=1, stable=True)[:, : paths.shape[2]]  # (B, D+1)
    return order, counts, draw_rows(law, generators)  # the race needs no normalising


def _parents(tree: Tree | RowTrees) -> torch.Tensor:
    """(N+1,) index of each node's parent (root: -1): its deepest strict ancestor; (B, N+1) for row trees."""
    strict = tree.ancestors & ~torch.eye(tree.size, dtype=torch.bool, device=tree.ancestors.device)
    depth_of = torch.where(strict, tree.depths[..., None, :], torch.full_like(strict, -1, dtype=torch.long))
    parents = depth_of.argmax(dim=-1)
    parents[..., 0] = -1
    return parents


def _unsupported_layer(layer) -> bool:
    """A cache layer :func:`keep_accepted` cannot roll back by index: anything holding more than plain keys /
    values (recurrent or linear-attention state, sparse-attention indexer keys, quantised blocks)."""
    return type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, DummyLayer)


def speculative_cache(model) -> DynamicCache:
    """The KV cache of a speculative decoding run: transformers' cache for ``model``'s layer kinds, with every
    sliding-window layer recording its past (it would otherwise drop the oldest window positions as soon as
    the tree's nodes arrive, before :func:`keep_accepted` knows which of them stay)."""
    cache = DynamicCache(config=model.config)
    unsupported = sorted({type(layer).__name__ for layer in cache.layers if _unsupported_layer(layer)})
    if unsupported:
        raise NotImplementedError(
            f"tree speculative decoding cannot roll back {', '.join(unsupported)} cache layers "
            f"({type(model).__name__}): it supports full and sliding-window attention")
    chunked = [kind for kind in _layer_types(model, cache) if kind == "chunked_attention"]
    if chunked:
        raise NotImplementedError(f"tree speculative decoding has no tree mask for chunked attention "
                                  f"({type(model).__name__})")
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
    return cache


def keep_accepted(cache: DynamicCache, past_length: int, accepted_nodes: Sequence[int]) -> None:
    """Keep the prefix and the accepted nodes' keys/values, in path order (cropping alone would keep
    whichever nodes come first in tree order, not the accepted path).

    Every layer holds some prefix keys, then the tree's nodes: a full-attention layer the whole prefix, a
    sliding-window layer (recording its past, :func:`speculative_cache`) its most recent ones. Its kept prefix
    and accepted nodes are gathered; a sliding-window layer is then cut back to the ``window − 1`` positions
    its next forward can see, and told its new length (``cumulative_length``: it places the next masks).
    A step that keeps all its nodes in order (a plain step: the root alone) has nothing to gather.
    """
    accepted = torch.as_tensor(accepted_nodes, dtype=torch.long)
    new_length = past_length + len(accepted)
    in_order = list(accepted_nodes) == list(range(len(accepted)))
    for layer in cache.layers:
        if isinstance(layer, DummyLayer) or not layer.is_initialized:  # holds nothing (shared KV, no attention)
            continue
        if _unsupported_layer(layer):
            raise NotImplementedError(f"keep_accepted cannot roll back a {type(layer).__name__} cache layer")
        nodes = layer.get_seq_length() - past_length  # the tree's nodes, stored after the kept prefix
        if not (in_order and nodes == len(accepted)):
            kept_prefix = layer.keys.shape[-2] - nodes
            device = layer.keys.device
            keep = torch.cat([torch.arange(kept_prefix, device=device), kept_prefix + accepted.to(device)])
            layer.keys = layer.keys[:, :, keep]  # (B, heads, kept prefix + accepted, head_dim)
            layer.values = layer.values[:, :, keep]
        if isinstance(layer, DynamicSlidingWindowLayer):
            visible = layer.sliding_window - 1  # what transformers keeps of a sliding layer between forwards
            layer.keys, layer.values = layer.keys[:, :, -visible:], layer.values[:, :, -visible:]
            layer.cumulative_length = new_length


def temperature_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in fp32, over the last dimension; T = 0: the one-hot of the argmax (a deterministic draw)."""
    if temperature == 0:
        return F.one_hot(top_tokens(logits), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def _check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """A generator draws only on its own device type: say which one to make instead of torch's bare error."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"the generator is on {generator.device} but the probabilities it draws from are on "
                         f"{device}: pass torch.Generator(device={str(device)!r}).manual_seed(seed)")


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (V,); ``generator`` on ``probs``' device."""
    _check_generator(generator, probs.device)
    return int(torch.multinomial(probs, 1, generator=generator))


def draw_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` (B, V), row b drawn with ``generators[b]`` exactly as
    ``torch.multinomial(probs[b], 1, generator=generators[b])`` draws it — the same token, the same generator state
    after — as one batched argmax with no host sync (each row's generator still draws its own noise; ``multinomial``
    itself syncs twice per call to validate its input). torch's one-sample path is the exponential race: the argmax
    of p / E, E ~ Exp(1) drawn by ``empty_like(p).exponential_(1, generator)`` (ATen native/Distributions.cpp,
    ``multinomial``); tests pin the equality. Returns (B,) on ``probs``' device."""
    for generator in generators:
        _check_generator(generator, probs.device)
    races = torch.empty_like(probs)  # (B, V)
    for row, generator in zip(races, generators, strict=True):
        row.exponential_(1, generator=generator)
    return (probs / races).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------------------
# the decoding loop and its plug-ins


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one step: a tree and its N + 1 tokens, the root first."""

    tree: Tree
    tokens: torch.Tensor  # (N+1,)
    probs: torch.Tensor | None = None  # (D, V) the law each draft of a chain was drawn from (speculative sampling)


@dataclass(frozen=True)
class Verdict:
    """What a verifier keeps of one step.

    ``path``: the chosen root-to-leaf nodes, root first. ``tokens``: the step's new output tokens — the tokens
    of ``path[1:]`` it accepts, then the model's own next token where the verifier adds one (the bonus). The
    last new token is the next root; the nodes before it, ``path[:len(tokens)]``, stay in the KV cache.
    """

    path: list[int]
    tokens: list[int]


class Verifier(Protocol):
    """Judges each step's draft: which path, and which of its tokens (plus any of the model's own) go out."""

    def __call__(self, draft: Draft, out) -> Verdict:
        """The verdict on ``draft`` from the tree forward's output ``out``."""


class BonusVerifier(Verifier, Protocol):
    """A verifier whose steps end with the model's own next token, which it also picks after the prompt."""

    def choose(self, logits: torch.Tensor) -> int:
        """The model's next token from its logits (V,)."""


class Drafter(Protocol):
    """Proposes each step's tree, and follows the verified output."""

    def prefill(self, model, input_ids: torch.Tensor, cache: DynamicCache, verifier: Verifier) -> list[int]:
        """Run the prompt (1, L), or the part before the first root, into the empty ``cache``; return the
        tokens the prefill already decides (Medusa, MTP: the model's next token, the first root; COrAL: none —
        the prompt's last token is the first root, re-fed by the first tree)."""

    def propose(self, room: int) -> Draft:
        """The next step's draft; ``room``: how many tokens the output may still take."""

    def accept(self, draft: Draft, out, verdict: Verdict) -> None:
        """Follow the verdict on ``draft`` (``out``: the tree forward's output); the cache already keeps it."""


class AdaptiveDrafter(Drafter, Protocol):
    """A drafter that can sit a step out, for the adaptive loop (:class:`models.engine.config.Adaptation`)."""

    def plain(self) -> Draft:
        """The next step without drafting: the root alone on :func:`root_tree`, at no drafter cost. ``accept``
        follows it like any step (the drafter catches up on the tokens it skipped when it next drafts)."""


Forward = Callable[[object, torch.Tensor, Tree, DynamicCache], object]
"""``forward(model, tokens (N+1,), tree, cache)`` → what the verifier reads; appends the N + 1 nodes to the cache."""


@dataclass
class SpeculativeStats:
    """Counters of one decoding run."""

    forwards: int = 0  # model forwards, the prefill included
    generated_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # output tokens gained per draft–verify cycle
    drafted_tokens: int = 0  # draft tokens offered for verification (tree nodes besides the root)
    accepted_drafts: int = 0  # of which in the output
    plain_forwards: int = 0  # steps that drafted nothing (the adaptive loop's; one token each)

    @property
    def mean_accepted_length(self) -> float:
        """Generated tokens per model forward, plain steps included (greedy decoding = 1.0)."""
        return self.generated_tokens / self.forwards if self.forwards else float("nan")

    @property
    def tokens_per_cycle(self) -> float:
        """τ as MTP-RL counts it: tokens accepted per draft–verify cycle, the bonus token included (plain steps,
        which draft nothing, are no cycles)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """α: the share of draft tokens accepted."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else float("nan")


class AdaptiveDrafting:
    """The decisions of :class:`models.engine.config.Adaptation` for a decoder: draft the next step, or not.

    τ = the tokens the last ``window`` cycles gained per row they ran (a cycle of B rows counts B times); c = the
    configured cycle cost, or the median over the window's cycles of each cycle's wall time over that of a plain step
    of as many rows (the median of the last ``window`` plain steps' of the nearest row count). Drafting continues
    while fewer than ``first_decision`` cycles are measured or τ ≥ c (a measured c: τ ≥ c · (1 + ``margin``), and a
    timed plain step after every ``plain_every`` cycles); else plain steps, with a probing cycle after ``gap`` plain
    steps (``probe_every``, doubled by each probe that does not pay, up to ``max_probe_every``; reset by one that
    pays). At batch 1 (one row throughout) this is the mean gain of the window's cycles over the ratio of their
    median time to the plain steps'.

    Rows matter in a batch (:func:`models.engine.batched.batched_speculative_generate`), where rows leave as they end:
    a step's time falls with its rows, the cycle's faster than the plain step's, and the last rows of a batch are few
    and may be the hard ones. Measured (MTP chains at batch 16, 2-core CPU): cycles of 90–100 ms at 16 rows against
    35 ms at 1 row, plain steps of 31–39 ms against 25 ms; timings pooled over row counts put c at 2.8 where it was
    2.2, and the last row of one batch, accepting nothing for 7 cycles, left the next batch's window averaging under
    1.4 tokens per cycle although its first cycle gained 4 tokens in each of 16 rows: that batch decoded 17 plain
    steps before its next probe. Drafting always ran 1.36× HF greedy on those three batches, the adaptive rule 1.10×.

    One object passed to several :func:`speculative_stream` calls carries all this from prompt to prompt (a
    server keeps it per model and drafter): each rollout or prompt then starts from what the last ones measured,
    instead of refilling the window with cycles that may not pay. Only the wait for a probe does not carry over: a
    prompt opens with one when drafting was not paying (:meth:`start_prompt`).
    """

    def __init__(self, adaptation: Adaptation):
        self.adaptation = adaptation
        self.gains: deque[tuple[float, int]] = deque(maxlen=adaptation.window)  # recent cycles' (tokens, rows)
        self.cycle_seconds: deque[tuple[int, float]] = deque(maxlen=adaptation.window)  # (rows, seconds)
        self.plain_seconds: deque[tuple[int, float]] = deque(maxlen=adaptation.window)  # (rows, seconds)
        self.paying = True  # the last decision: drafting pays
        self.plain_steps = 0  # plain steps since the last cycle
        self.gap = adaptation.probe_every  # plain steps before the next probe
        self.cycles_since_plain = 0  # draft cycles since the last plain step (a measured c re-times one now and then)

    @property
    def measures(self) -> bool:
        """Whether c is measured (steps are timed)."""
        return self.adaptation.cycle_cost is None

    def drafts(self) -> bool:
        """Whether the next step drafts: while it pays, or to probe; with c measured, not before a plain step is
        timed, nor after ``plain_every`` cycles without one."""
        if self.measures and (not self.plain_seconds or self.cycles_since_plain >= self.adaptation.plain_every):
            return False
        return self.paying or self.plain_steps >= self.gap

    def start_prompt(self) -> None:
        """A new prompt: if drafting was not paying, its first step probes. What stopped paying on one prompt may pay
        on the next (another text), and the gap the last prompt doubled would otherwise keep the new one plain for
        up to ``max_probe_every`` tokens (measured: one hard task prompt left the next two 45 % plain, the 8 timed
        task prompts 27 %). A drafter that never pays spends one probe per prompt."""
        self.plain_steps = max(self.plain_steps, self.gap)

    def tau(self) -> float:
        """τ: the window's tokens gained per row and cycle."""
        return sum(tokens for tokens, _ in self.gains) / sum(rows for _, rows in self.gains)

    def plain_step_seconds(self, rows: int) -> float:
        """A plain step's time at ``rows`` rows: the median of the timed plain steps of the nearest row count (on a
        tie, the larger)."""
        nearest = min((abs(r - rows), -r) for r, _ in self.plain_seconds)
        return statistics.median(s for r, s in self.plain_seconds if (abs(r - rows), -r) == nearest)

    def cost(self) -> float:
        """c: a cycle's cost in plain steps of as many rows; measured, never below 1. A cycle runs the plain step's
        forward over the root and its drafts, and drafts first, so a measured ratio below 1 is a timing artefact:
        plain steps are timed only now and then (:meth:`drafts`), and one slow sample stands for them in between.
        Measured (MTP chains at batch 16, 2-core CPU): a first plain step of 43 ms against 29 ms for later ones put c
        at 0.8, and a batch whose last row accepted nothing drafted on for 12 cycles gaining 1 token each."""
        if not self.measures:
            return self.adaptation.cycle_cost
        return max(1.0, statistics.median(seconds / max(self.plain_step_seconds(rows), 1e-9)
                                          for rows, seconds in self.cycle_seconds))

    def record(self, drafted: bool, tokens: float, seconds: float, rows: int = 1) -> None:
        """A finished step of ``rows`` rows that gave ``tokens`` tokens in all: a cycle's gain and time update τ (and
        c), the decision and the probe gap; a plain step counts, and its time is kept with its rows."""
        if not drafted:
            self.plain_seconds.append((rows, seconds))
            self.plain_steps += 1
            self.cycles_since_plain = 0
            return
        self.cycles_since_plain += 1
        probe = not self.paying
        self.gains.append((tokens, rows))
        self.cycle_seconds.append((rows, seconds))
        self.plain_steps = 0
        decided = len(self.gains) >= min(self.adaptation.first_decision, self.adaptation.window)
        margin = self.adaptation.margin if self.measures else 0.0  # a measured c is noisy, a configured one exact
        self.paying = not decided or self.tau() >= self.cost() * (1 + margin)
        if self.paying:
            self.gap = self.adaptation.probe_every
        elif probe:
            self.gap = min(2 * self.gap, self.adaptation.max_probe_every)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs them asynchronously), so that the clock times them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def emitted(tokens: list[int], room: int, eos_token_ids: set[int]) -> tuple[list[int], bool]:
    """The tokens that reach the output — at most ``room``, up to an end token included — and whether it ended."""
    step = tokens[:room]
    ended = next((i for i, t in enumerate(step) if t in eos_token_ids), None)
    return (step, False) if ended is None else (step[: ended + 1], True)


@torch.no_grad()
def speculative_stream(model, drafter: Drafter, verifier: Verifier, input_ids: torch.Tensor, max_new_tokens: int,
                       eos_token_ids: set[int], stats: SpeculativeStats | None = None,
                       forward: Forward = tree_forward, adaptation: Adaptation | AdaptiveDrafting | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> Iterator[list[int]]:
    """Decode one prompt (1, L), yielding each step's new tokens as soon as they are verified.

    prefill → repeat: draft (``drafter.propose``) → ONE ``forward`` of the tree → verdict (``verifier``) →
    keep the accepted nodes' cache → ``drafter.accept``. Stops after an end token (yielded) or
    ``max_new_tokens`` tokens; tokens verified beyond either reach neither the output nor the counters.
    ``stats`` may carry counts of earlier runs: they are added to.

    ``adaptation``: draft only while it pays (:class:`models.engine.config.Adaptation`: decided afresh for this
    prompt; :class:`AdaptiveDrafting`: carried on from the prompts it decided before); the other steps are
    plain (``drafter.plain``: an :class:`AdaptiveDrafter`, and a verifier that ends each step with the model's own
    token). Each emitted token is still greedy's, or a draw from the model given everything before it, whatever
    decided how its step ran. ``clock``: what times the steps when the cycle cost is measured.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one prompt at a time, got a batch of {input_ids.shape[0]}")
    if adaptation is not None and not callable(getattr(drafter, "plain", None)):
        raise TypeError(f"adaptive decoding needs a drafter that can skip a step ({type(drafter).__name__} has no "
                        "plain())")
    adapter = AdaptiveDrafting(adaptation) if isinstance(adaptation, Adaptation) else adaptation
    if adapter is not None:
        adapter.start_prompt()
    timed = adapter is not None and adapter.measures
    stats = stats if stats is not None else SpeculativeStats()
    cache = speculative_cache(model)
    first = drafter.prefill(model, input_ids, cache, verifier)
    stats.forwards += int(cache.get_seq_length() > 0)  # a one-token prompt that is its own root needs no prefill
    step, ended = emitted(first, max_new_tokens, eos_token_ids)
    generated = len(step)
    stats.generated_tokens += generated
    if step:
        yield step
    while not ended and generated < max_new_tokens:
        started = clock() if timed else 0.0
        drafts = adapter is None or adapter.drafts()
        draft = drafter.propose(max_new_tokens - generated) if drafts else drafter.plain()
        past_length = cache.get_seq_length()
        out = forward(model, draft.tokens, draft.tree, cache)
        verdict = verifier(draft, out)
        step, ended = emitted(verdict.tokens, max_new_tokens - generated, eos_token_ids)
        generated += len(step)
        stats.forwards += 1
        stats.generated_tokens += len(step)
        if drafts:
            stats.accepted_lengths.append(len(step))
            stats.drafted_tokens += draft.tree.size - 1
            stats.accepted_drafts += min(len(verdict.path) - 1, len(step))  # the bonus is no draft
        else:
            stats.plain_forwards += 1
        if not ended and generated < max_new_tokens:
            keep_accepted(cache, past_length, verdict.path[: len(verdict.tokens)])
            drafter.accept(draft, out, verdict)
            if adapter is not None:
                if timed:
                    _synchronize(model.device)
                adapter.record(drafts, len(step), clock() - started if timed else 0.0)
        if step:
            yield step


def speculative_generate(model, drafter: Drafter, verifier: Verifier, input_ids: torch.Tensor, max_new_tokens: int,
                         eos_token_ids: set[int], stats: SpeculativeStats | None = None,
                         forward: Forward = tree_forward, adaptation: Adaptation | AdaptiveDrafting | None = None,
                         clock: Callable[[], float] = time.perf_counter) -> tuple[list[int], SpeculativeStats]:
    """:func:`speculative_stream` collected: the new tokens and the run's counters."""
    stats = stats if stats is not None else SpeculativeStats()
    tokens = [t for step in speculative_stream(model, drafter, verifier, input_ids, max_new_tokens, eos_token_ids,
                                               stats, forward, adaptation, clock) for t in step]
    return tokens, stats


@torch.no_grad()
def verification_costs(model, widths: Sequence[int], context_length: int, repeats: int = 5, seed: int = 0,
                       clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """What a verification forward costs against its width, on ``model`` as it runs here: for each width w of
    ``widths`` (tokens scored, the root included: 1 = a plain one-token step), the median seconds of
    :func:`tree_forward` over a chain of w tokens after a prefill of ``context_length`` random tokens (seeded), the
    cache cut back to the prefix after every forward. The widths take turns, one warm-up round (first calls pay
    one-off allocations) then ``repeats`` timed rounds, so a drift of the machine's speed touches every width alike.
    What :func:`models.mtp.dynamic_tree.calibrate_budget` reads (EAGLE-2's verification budget): a
    small model's forward is memory-bound on a CPU or a GPU, so scoring many tokens costs about what one does, up to
    a width where compute takes over."""
    if not widths or min(widths) < 1:
        raise ValueError(f"verification widths are tokens per forward, each ≥ 1, got {list(widths)}")
    if context_length < 1 or repeats < 1:
        raise ValueError(f"need context_length ≥ 1 and repeats ≥ 1, got {context_length} and {repeats}")
    generator = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().num_embeddings
    prompt = torch.randint(vocab, (1, context_length), generator=generator)  # (1, context_length)
    trees = {w: chain_tree(w - 1) if w > 1 else root_tree() for w in widths}
    tokens = {w: torch.randint(vocab, (w,), generator=generator) for w in widths}
    cache = speculative_cache(model)
    prefill(model, prompt.to(model.device), cache)
    seconds: dict[int, list[float]] = {w: [] for w in widths}
    for round_ in range(repeats + 1):
        for w in widths:
            _synchronize(model.device)
            started = clock()
            tree_forward(model, tokens[w], trees[w], cache)
            _synchronize(model.device)
            elapsed = clock() - started
            keep_accepted(cache, context_length, [])  # back to the prefix: every width sees the same context
            if round_:
                seconds[w].append(elapsed)
    return {w: statistics.median(seconds[w]) for w in widths}


VERIFICATION_WIDTHS = (1, 4, 8, 16, 24, 32, 48, 64)
"""Tokens per verification forward (the root included) whose cost ``DynamicTree.budget: auto`` measures (those up to
the drafter's whole pool, and the pool's)."""
VERIFICATION_REPEATS = 5
"""Timed rounds of every width (after one warm-up round): the median is each width's cost."""


def budget_context(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """The context after which ``budget: auto`` times its forwards: as long as the middle of a typical response, the
    median prompt length plus half of ``max_new_tokens``."""
    return int(statistics.median(prompt_lengths)) + max_new_tokens // 2


def _decoder(model) -> torch.nn.Module:
    """The decoder stack (``get_decoder()``: Llama's ``model.model``) of a causal LM, through the wrappers that hide
    it (DDP's ``module``; PEFT forwards ``get_decoder`` itself)."""
    inner = model
    while not hasattr(inner, "get_decoder") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    return inner.get_decoder()


def last_hidden_forward(model, **inputs) -> tuple[object, torch.Tensor]:
    """``model(**inputs)`` and its final hidden states (B, T, H): what ``output_hidden_states=True`` returns as
    ``hidden_states[-1]`` — the decoder's ``last_hidden_state``, after the final norm (transformers'
    ``capture_outputs`` ties the two) — without keeping every layer's states. ``output_hidden_states`` holds all
    L + 1 of them until the forward returns (at 8B, 40 prompts × 1,500 tokens: ~16 GiB in bf16) where the drafters
    read only the last. A forward hook on the decoder takes its output, so the logits are the model's own forward's
    (``logits_to_keep``, soft-capping and all) and the gradient flows through the state as through the tuple."""
    captured: list[torch.Tensor] = []
    handle = _decoder(model).register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"{type(model).__name__}'s decoder ran {len(captured)} times in one forward; expected once")
    return out, captured[0]


def prefill(model, input_ids: torch.Tensor, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole prompt (1, L) into ``cache``: the logits after its last token (V,) and its final hidden states (L, H)."""
    out, hidden = last_hidden_forward(model, input_ids=input_ids, **cache_kwargs(model, cache), use_cache=True,
                                      logits_to_keep=1)
    return out.logits[0, -1], hidden[0]


DraftLogits = Callable[[torch.Tensor, int], torch.Tensor]
"""``draft_logits(hidden, root_token) → (D, V)`` logits for the D positions after the root, from the final
hidden state (H,) of the last accepted token (whose next token is ``root_token``)."""


class TreeDrafter:
    """Medusa's drafter (§2.1.2): a fixed ``tree`` filled from ``draft_logits`` of the last accepted token's
    final hidden state. The root is the model's own next token, so the prefill takes the whole prompt."""

    def __init__(self, tree: Tree, draft_logits: DraftLogits):
        self.tree, self.draft_logits = tree, draft_logits

    def prefill(self, model, input_ids: torch.Tensor, cache: DynamicCache, verifier: BonusVerifier) -> list[int]:
        logits, hidden = prefill(model, input_ids, cache)
        self.root, self.hidden = verifier.choose(logits), hidden[-1]
        return [self.root]

    def propose(self, room: int) -> Draft:
        return Draft(self.tree, tree_candidates(self.root, self.draft_logits(self.hidden, self.root), self.tree))

    def plain(self) -> Draft:
        return Draft(root_tree(), torch.tensor([self.root], device=self.hidden.device))

    def accept(self, draft: Draft, out: tuple[torch.Tensor, torch.Tensor], verdict: Verdict) -> None:
        _, hiddens = out
        self.root, self.hidden = verdict.tokens[-1], hiddens[verdict.path[len(verdict.tokens) - 1]]


class TreeVerifier:
    """Greedy (``acceptance=None``: lossless, the output is greedy decoding's) or Medusa's typical acceptance
    (lossy) on :func:`tree_forward`'s output; the argmax after the last accepted node is the bonus token."""

    def __init__(self, acceptance: TypicalAcceptance | None = None):
        self.acceptance = acceptance

    def choose(self, logits: torch.Tensor) -> int:
        return int(top_tokens(logits))

    def __call__(self, draft: Draft, out: tuple[torch.Tensor, torch.Tensor]) -> Verdict:
        logits, _ = out
        path = (verify_greedy(draft.tokens, logits, draft.tree) if self.acceptance is None
                else verify_typical(draft.tokens, logits, draft.tree, self.acceptance))
        return Verdict(path, draft.tokens[path[1:]].tolist() + [self.choose(logits[path[-1]])])


class SamplingVerifier:
    """Speculative sampling (:func:`verify_speculative_sampling`) of a chain at ``temperature`` > 0: the output
    is distributed exactly as sampling from the model, whatever the drafts (``draft.probs``: their law).
    ``generator``: on the model's device (the target probabilities are drawn from there)."""

    def __init__(self, temperature: float, generator: torch.Generator | None = None):
        self.temperature, self.generator = temperature, generator

    def choose(self, logits: torch.Tensor) -> int:
        return draw(temperature_probs(logits, self.temperature), self.generator)

    def __call__(self, draft: Draft, out: tuple[torch.Tensor, torch.Tensor]) -> Verdict:
        logits, _ = out
        drafts = draft.tokens[1:].tolist()
        if not drafts:  # a plain step: a draw from the model at the root
            return Verdict([0], [self.choose(logits[0])])
        accepted, token = verify_speculative_sampling(drafts, draft.probs, temperature_probs(logits, self.temperature),
                                                      self.generator)
        return Verdict(list(range(accepted + 1)), [*drafts[:accepted], token])


class TreeSamplingVerifier(SamplingVerifier):
    """Speculative sampling of any tree of deterministic candidates (:func:`verify_tree_sampling`) at ``temperature``
    > 0 — EAGLE-2-style top-k trees, Medusa's trees, chains of top-1 drafts: the output is distributed exactly as
    sampling from the model, whatever the candidates. A plain step (:func:`root_tree`) is a draw from the model. A
    chain whose drafts were drawn from a stated law (``draft.probs``) is verified against that law instead
    (:class:`SamplingVerifier`: a draft x passes with min(1, p(x)/q(x)), where the one-hot rule passes it with p(x)
    only). ``generator``: on the model's device."""

    def __call__(self, draft: Draft, out: tuple[torch.Tensor, torch.Tensor]) -> Verdict:
        if draft.probs is not None and len(draft.tree.paths) == 1:
            return super().__call__(draft, out)
        logits, _ = out
        path, token = verify_tree_sampling(draft.tokens, temperature_probs(logits, self.temperature), draft.tree,
                                           self.generator)
        return Verdict(path, draft.tokens[path[1:]].tolist() + [token])
