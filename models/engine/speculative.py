"""Tree speculative decoding: draft a sparse tree of candidates, verify it in ONE forward, keep the best path.

The engine shared by every "predict ahead" decoder of the project (Medusa / RLMedusa heads, COrAL's tree,
MTP's chained drafts — which add :func:`verify_speculative_sampling` for sampled rollouts). It follows Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads", §2.1.2 tree attention, §2.3.1 typical acceptance) as described in
papers/rlmedusa-paper.txt (introduction) and NOTES.md, built as a pipeline of small pure functions:

    draft (drafter)  →  candidates on a tree (:func:`tree_candidates`)
      →  tree forward (:func:`tree_forward`: position ids = cache length + depth, additive 4-D mask)
      →  evaluate (:func:`verify_greedy` lossless | :func:`verify_typical` lossy)
      →  update (:func:`keep_accepted`: gather the accepted nodes' keys/values into the cache)

The tree. A candidate tree is a set of *choices*: paths of per-depth ranks, e.g. ``(0, 1)`` = "the
drafter's best token for position +1, then its second-best for position +2". Node 0 is the *root*: the
token the model itself already chose (the argmax after the last accepted token — exact, not a guess),
not yet in the cache. A node at depth d ≥ 1 holds the drafter's rank-r token for the d-th position after
the root. Every node attends to the prefix and to its ancestors (itself included), never to siblings.

One step. With the root and the drafter's (D, V) logits from the last accepted state, all N + 1 tree
tokens run through the model in one forward; the model's argmax at a node is the true greedy next
token after that node's path. Greedy verification accepts along a path while the child's token equals
its parent's argmax, and picks the path with most accepted nodes: the accepted tokens are exactly what
greedy decoding would have produced, one by one (lossless — tests compare token for token). The argmax
at the last accepted node is the next root (the "bonus" token), so every step gains ≥ 1 token.

Why it pays on a CPU. A forward of a 135M model at batch 1 is memory-bound (every weight is read once
per forward), so scoring ~20 tree tokens costs little more than scoring one (NOTES.md).

τ (mean accepted length) = generated tokens / model forwards, the prefill included: greedy is 1.0.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

Drafter = Callable[[torch.Tensor, int], torch.Tensor]
"""``drafter(hidden, root_token) → (D, V)`` logits for the D positions after the root, from the final
hidden state (H,) of the last accepted token (whose argmax is ``root_token``)."""


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


def chain_tree(depth: int) -> Tree:
    """A single path of top-1 drafts (what MTP and most draft models propose)."""
    return build_tree([(0,) * depth])


def tree_candidates(root_token: int, draft_logits: torch.Tensor, tree: Tree) -> torch.Tensor:
    """The tree's N + 1 tokens: the root, then each node's rank-r draft token at its depth."""
    if draft_logits.shape[0] < tree.depth:
        raise ValueError(f"the tree is {tree.depth} deep but the drafter predicts {draft_logits.shape[0]} positions")
    top = draft_logits[: tree.depth].topk(tree.top_k(), dim=-1).indices  # (D, k)
    depths, ranks = tree.depths.to(top.device), tree.ranks.to(top.device)
    tokens = top[(depths - 1).clamp(min=0), ranks]  # (N+1,)
    tokens[0] = root_token
    return tokens


def tree_attention_inputs(tree: Tree, past_length: int, dtype: torch.dtype, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (1, N+1) and the additive 4-D mask (1, 1, N+1, past+N+1) of a tree forward.

    Positions are ``past_length + depth`` (siblings share a position; HF's default arange would be
    wrong). The mask is float (0 = attend, dtype min = blocked): transformers uses a 4-D mask as given,
    and a boolean one is read differently by different attention kernels.
    """
    position_ids = (past_length + tree.depths).to(device)[None]  # (1, N+1)
    blocked = torch.finfo(dtype).min
    tree_part = torch.where(tree.ancestors, 0.0, blocked).to(device=device, dtype=dtype)  # (N+1, N+1)
    prefix_part = torch.zeros(tree.size, past_length, device=device, dtype=dtype)  # (N+1, past)
    return position_ids, torch.cat([prefix_part, tree_part], dim=1)[None, None]  # (1, 1, N+1, past+N+1)


def tree_forward(model, tokens: torch.Tensor, tree: Tree, cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the tree's tokens after the cached prefix: logits (N+1, V) and final hidden states (N+1, H).

    The cache grows by N + 1 positions (all nodes); :func:`keep_accepted` drops the rejected ones.
    """
    position_ids, mask = tree_attention_inputs(tree, cache.get_seq_length(), model.dtype, tokens.device)
    out = model(input_ids=tokens[None], position_ids=position_ids, attention_mask=mask, past_key_values=cache,
                use_cache=True, output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


def _accepted_path(tree: Tree, match: torch.Tensor) -> list[int]:
    """The nodes of the path with the longest run of accepted children (ties: first path), root first.

    ``match[i]``: node i would be accepted given its parent is (root: True).
    """
    paths = tree.paths.to(match.device)  # (P, D+1)
    valid = paths >= 0
    ok = match[paths.clamp(min=0)] & valid  # (P, D+1)
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (P,) root included
    best = int(accepted.argmax())
    return paths[best, : int(accepted[best])].tolist()


def verify_greedy(tokens: torch.Tensor, logits: torch.Tensor, tree: Tree) -> list[int]:
    """Lossless: a node is accepted when its token is its parent's argmax. Returns the accepted nodes."""
    predictions = logits.argmax(dim=-1)  # (N+1,)
    parents = _parents(tree).to(tokens.device)
    match = tokens == predictions[parents.clamp(min=0)]
    match[0] = True
    return _accepted_path(tree, match)


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance (§2.3.1) — LOSSY: output may differ from greedy.

    A node is accepted when its parent's distribution gives its token p > min(ε, α·exp(−H(p))).
    """

    posterior_threshold: float = 0.09  # ε
    posterior_alpha: float = 0.3  # α (Medusa's default is √ε)
    temperature: float = 1.0


def verify_typical(tokens: torch.Tensor, logits: torch.Tensor, tree: Tree, rule: TypicalAcceptance) -> list[int]:
    """Lossy: accept a child whose token is "typical" under its parent's distribution. Returns accepted nodes."""
    probs = torch.softmax(logits.float() / rule.temperature, dim=-1)  # (N+1, V)
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)  # (N+1,)
    threshold = torch.minimum(torch.full_like(entropy, rule.posterior_threshold),
                              rule.posterior_alpha * torch.exp(-entropy))
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

    Returns (accepted drafts, next token).
    """
    uniforms = torch.rand(len(draft_tokens), generator=generator, device=generator.device if generator else None)
    for d, token in enumerate(draft_tokens):
        p, q = target_probs[d], draft_probs[d]
        if uniforms[d] * q[token] <= p[token]:  # u < p/q, without dividing by a zero q
            continue
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # p == q exactly: any draw from p is right
        return d, int(torch.multinomial(residual, 1, generator=generator))
    return len(draft_tokens), int(torch.multinomial(target_probs[-1], 1, generator=generator))


def _parents(tree: Tree) -> torch.Tensor:
    """(N+1,) index of each node's parent (root: -1): its deepest strict ancestor."""
    strict = tree.ancestors & ~torch.eye(tree.size, dtype=torch.bool)
    depth_of = torch.where(strict, tree.depths[None, :], torch.full_like(strict, -1, dtype=torch.long))
    parents = depth_of.argmax(dim=1)
    parents[0] = -1
    return parents


def keep_accepted(cache: DynamicCache, past_length: int, accepted_nodes: Sequence[int]) -> None:
    """Keep the prefix and the accepted nodes' keys/values, in path order (cropping alone would keep
    whichever nodes come first in tree order, not the accepted path)."""
    device = cache.layers[0].keys.device
    keep = torch.cat([torch.arange(past_length, device=device),
                      past_length + torch.as_tensor(accepted_nodes, dtype=torch.long, device=device)])
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, keep]  # (B, heads, past + accepted, head_dim)
        layer.values = layer.values[:, :, keep]


@dataclass
class SpeculativeStats:
    """Counters of one decoding run."""

    forwards: int = 0  # model forwards, the prefill included
    generated_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens gained per tree forward
    drafted_tokens: int = 0  # draft tokens offered for verification (chain drafting)
    accepted_drafts: int = 0  # of which accepted

    @property
    def mean_accepted_length(self) -> float:
        """τ: generated tokens per model forward (greedy decoding = 1.0)."""
        return self.generated_tokens / self.forwards if self.forwards else float("nan")

    @property
    def tokens_per_cycle(self) -> float:
        """τ as MTP-RL counts it: tokens accepted per draft–verify cycle, the bonus token included."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """α: the share of draft tokens accepted."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else float("nan")


@torch.no_grad()
def speculative_stream(model, drafter: Drafter, input_ids: torch.Tensor, tree: Tree, max_new_tokens: int,
                       eos_token_ids: set[int], acceptance: TypicalAcceptance | None = None,
                       stats: SpeculativeStats | None = None) -> Iterator[list[int]]:
    """Decode one prompt (1, L), yielding each step's accepted tokens as soon as they are verified.

    ``acceptance=None``: greedy verification, output identical to greedy decoding. A
    :class:`TypicalAcceptance` rule makes it lossy. Stops after an end token (yielded) or
    ``max_new_tokens`` tokens.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one prompt at a time, got a batch of {input_ids.shape[0]}")
    stats = stats if stats is not None else SpeculativeStats()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    stats.forwards += 1
    root, hidden = int(out.logits[0, -1].argmax()), out.hidden_states[-1][0, -1]
    pending = [root]  # tokens known but not yet yielded: the prefill's argmax is the first
    while True:
        room = max_new_tokens - stats.generated_tokens
        step = pending[:room]
        ended = next((i for i, t in enumerate(step) if t in eos_token_ids), None)
        if ended is not None:
            step = step[: ended + 1]
        stats.generated_tokens += len(step)
        if stats.forwards > 1:
            stats.accepted_lengths.append(len(step))
        yield step
        if ended is not None or stats.generated_tokens >= max_new_tokens:
            return
        tokens = tree_candidates(root, drafter(hidden, root), tree)
        past_length = cache.get_seq_length()
        logits, hiddens = tree_forward(model, tokens, tree, cache)
        stats.forwards += 1
        accepted = (verify_greedy(tokens, logits, tree) if acceptance is None
                    else verify_typical(tokens, logits, tree, acceptance))
        keep_accepted(cache, past_length, accepted)
        last = accepted[-1]
        root, hidden = int(logits[last].argmax()), hiddens[last]
        pending = tokens[accepted[1:]].tolist() + [root]  # the root was yielded last step


def speculative_generate(model, drafter: Drafter, input_ids: torch.Tensor, tree: Tree, max_new_tokens: int,
                         eos_token_ids: set[int], acceptance: TypicalAcceptance | None = None
                         ) -> tuple[list[int], SpeculativeStats]:
    """:func:`speculative_stream` collected: the new tokens and the run's counters."""
    stats = SpeculativeStats()
    tokens = [t for step in speculative_stream(model, drafter, input_ids, tree, max_new_tokens, eos_token_ids,
                                               acceptance, stats) for t in step]
    return tokens, stats
