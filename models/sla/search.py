"""Streaming Looking-Ahead (SLA) decoding with a Reward Transformer's token-level self-reward.

Zhang, Hong & Yu, "Streaming Looking Ahead with Token-level Self-reward"
(docs/sla.md): Algorithm 2 (one step of the search) and §4.1 (streaming,
batched expansion, cost O(t_p + T_max · d · t_d) instead of MCTS's k^d trajectories per action).

One prompt (batch size 1). Below the committed text C sits a balanced tree of depth d:

* **Expansion** — every unfinished leaf forks k children from its top-k next tokens; each child then
  decodes greedily until its segment holds n tokens (the forked token + n − 1 greedy ones), or stops
  early on an end token (it is then *finished*: never extended again, its segment is shorter).
* **Self-evaluation** — a leaf's score is the mean reward R' over its whole response so far (every
  token generated since the prompt, committed ones included, up to the leaf's last token). This is
  what the authors' code does; Algorithm 2's text says "R' at the last token", which
  ``SLASearch.leaf_score = "last"`` selects (an ablation).
* **Backup** — Q(node) = max over the leaves of its subtree (a finished node is a leaf of its own).
* **Action** — the first-level child with the largest Q; ties go to the lower index, i.e. the more
  probable forked token, so decoding is deterministic.
* **Streaming** — the chosen child's segment is committed and yielded at once; its already generated
  subtree is kept and becomes levels 1..d−1, so each step expands just ONE new level (§4.1: "we could
  utilize batch computing to compute all children in parallel").

How the KV cache is shared. All nodes of one level are decoded as ONE batch: row i of the level's
``DynamicCache`` holds the keys/values of [prompt + committed text + node i's whole path]. Because a
node is extended only when its segment is full (n tokens), every expandable row has the same length,
so rows stay left-aligned with no padding, no attention mask and HF's default position ids
(``cache_len + arange``). To expand the next level the cache is re-indexed in one
``DynamicCache.reorder_cache`` (an ``index_select`` over the batch): each unfinished leaf's row is
repeated k times and rows of pruned or finished nodes are dropped. The root starts from the prompt's
prefill cache (one row). Nothing is ever recomputed: every forward after the prefill feeds one token
per row, and a committed prefix's keys/values are simply the shared first columns of the kept rows.
Rows that hit an end token before the others keep being fed (their own last token) until the level
finishes; what they compute afterwards is ignored and such rows are never expanded.

Several prompts at once (:func:`sla_generate_batch`). Their trees are searched in lockstep, every level of
all of them one batch: each step still expands one level per tree, so the rows of all trees have the same
length. Prompts of unequal length are left-padded at the prefill, and the level carries an attention mask
(padding 0) and explicit position ids (real tokens before each row's new one), re-indexed with the cache. A
prompt whose answer is complete drops out (its rows are not kept at the next re-indexing). One prompt, or
prompts of equal length, need no mask: the forwards are then exactly the one-prompt search's.

``depth = 0`` means no search: n greedy tokens per step, identical to greedy decoding (as is k = 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from models.engine.generation import left_pad
from models.sla.config import LeafScore, SLASearch
from models.sla.reward_transformer import RewardTransformer


@dataclass
class SLAStats:
    """Work counters of one decoding run."""

    forward_calls: int = 0  # model forwards (prefill included)
    tokens_processed: int = 0  # Σ batch × new tokens over all forwards
    committed_tokens: int = 0  # response tokens emitted
    steps: int = 0  # committed segments (SLA actions)


@dataclass(eq=False)
class Node:
    """A node of the search tree: one segment of ≤ n tokens below its parent."""

    tokens: list[int]  # the segment (empty for the initial root)
    reward_sum: float  # Σ R' over the whole response up to the segment's last token
    reward_count: int  # how many response tokens that sum covers
    last_reward: float = 0.0  # R' at the segment's last token (0 for the initial root, which is never scored)
    finished: bool = False  # the segment ended with an end token
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    row: int | None = None  # row of the current level's cache (deepest level only)
    next_tokens: list[int] = field(default_factory=list)  # top-k next tokens after the segment (unfinished only)
    prompt: int = 0  # which prompt's tree the node belongs to

    def score(self, leaf_score: LeafScore = "mean") -> float:
        """The leaf score: mean R' over the response so far (``mean``), or R' at the node's last token (``last``)."""
        return self.reward_sum / max(self.reward_count, 1) if leaf_score == "mean" else self.last_reward


@dataclass
class Level:
    """The deepest level of the trees: their nodes and the batched KV cache whose rows they index."""

    cache: object | None  # DynamicCache with one row per node (None when the level is empty)
    nodes: list[Node]
    attention_mask: torch.Tensor | None = None  # (B, L): 0 on left padding; None when no row is padded


# ---------------------------------------------------------------------------------------------------
# model calls


def _device(model: RewardTransformer) -> torch.device:
    return next(model.parameters()).device


def _forward(model: RewardTransformer, input_ids: torch.Tensor, cache, stats: SLAStats,
             attention_mask: torch.Tensor | None = None):
    """One cached forward over ``input_ids`` (B, T): last-position logits (B, V), rewards (B, T), cache.

    Only the last position's logits are computed (a prompt's (T, V) logits would be thrown away). The ids
    move to the model's device (a prompt tokenized on the CPU decodes on the GPU); rewards stay in the
    model's dtype: they are read as Python floats, so a bf16 policy is scored at its own precision.
    ``attention_mask`` (B, L): cache and new tokens, 0 on left padding; each token's position is then the
    count of real tokens before it (Hugging Face's default, cache length + offset, assumes no padding).
    """
    position_ids = None
    if attention_mask is not None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]  # (B, T)
    out = model(input_ids=input_ids.to(_device(model)), attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True, logits_to_keep=1)
    stats.forward_calls += 1
    stats.tokens_processed += input_ids.numel()
    return out.logits[:, -1, :], out.rewards, out.cache


@torch.inference_mode()
def prefill(model: RewardTransformer, prompts: list[torch.Tensor], width: int, pad_token_id: int,
            stats: SLAStats) -> tuple[list[Node], Level]:
    """Process the prompts (each (1, T_p)), left-padded into one batch: a root per prompt (no tokens, its top-k
    next tokens) and the level of their rows."""
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id, _device(model))  # (P, T)
    mask = None if bool(attention_mask.all()) else attention_mask  # no padding: exactly the one-prompt forwards
    logits, _, cache = _forward(model, input_ids, None, stats, mask)  # (P, V)
    top = logits.topk(width, dim=-1).indices.tolist()  # (P, k)
    roots = [Node(tokens=[], reward_sum=0.0, reward_count=0, row=p, next_tokens=top[p], prompt=p)
             for p in range(len(prompts))]
    return roots, Level(cache, list(roots), mask)


@torch.inference_mode()
def decode_segments(model: RewardTransformer, cache, first_tokens: list[int], step: int, width: int,
                    eos_token_ids: set[int], stats: SLAStats, attention_mask: torch.Tensor | None = None,
                    ) -> tuple[list[tuple[list[int], list[float], list[int]]], torch.Tensor | None]:
    """Greedy-decode one segment per cache row, all rows as one batch, starting from ``first_tokens``.

    Each segment gets ``step`` tokens unless it reaches an end token (included, then it stops). Every
    token of a segment is fed, so its reward is known and the row's cache covers the whole segment.
    Returns, per row, (tokens, their rewards, top-``width`` next tokens — empty when finished), and the
    attention mask (B, L) grown by the fed tokens (None stays None); ``cache`` is extended in place.
    """
    device = _device(model)
    tokens = [[t] for t in first_tokens]
    rewards: list[list[float]] = [[] for _ in first_tokens]
    next_tokens: list[list[int]] = [[] for _ in first_tokens]
    active = [True] * len(first_tokens)  # the row's last token still has to be fed
    while True:
        feed = torch.tensor([[row[-1]] for row in tokens], device=device)  # (B, 1); done rows repeat their last
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(tokens), 1)], dim=1)  # (B, L+1)
        logits, step_rewards, cache = _forward(model, feed, cache, stats, attention_mask)  # (B, V), (B, 1)
        step_rewards = step_rewards[:, -1].tolist()
        greedy = logits.argmax(dim=-1).tolist()  # (B,)
        complete = []
        for i, row in enumerate(tokens):
            if not active[i]:
                continue
            rewards[i].append(step_rewards[i])
            if row[-1] in eos_token_ids:
                active[i] = False  # finished: never extended
            elif len(row) == step:
                active[i] = False
                complete.append(i)  # full segment: remember how to fork it
            else:
                row.append(greedy[i])
        if complete:
            top = logits[complete].topk(width, dim=-1).indices.tolist()  # (len(complete), k)
            for i, t in zip(complete, top, strict=True):
                next_tokens[i] = t
        if not any(active):
            return list(zip(tokens, rewards, next_tokens, strict=True)), attention_mask


# ---------------------------------------------------------------------------------------------------
# tree operations


@torch.inference_mode()
def expand(model: RewardTransformer, level: Level, width: int, step: int, eos_token_ids: set[int],
           stats: SLAStats) -> Level:
    """Fork every unfinished node of ``level`` into ``width`` children and decode them as one batch."""
    parents = [node for node in level.nodes if not node.finished]
    if not parents:
        return Level(None, [])
    # (B,) parent row of each child, on the cache's device (else every layer copies it there)
    rows = torch.tensor([p.row for p in parents for _ in range(width)], device=_device(model))
    cache = level.cache
    cache.reorder_cache(rows)  # (B, H, L, D) per layer: each parent's row repeated k times, others dropped
    mask = level.attention_mask[rows] if level.attention_mask is not None else None  # (B, L)
    first = [t for p in parents for t in p.next_tokens]  # (B,) forked tokens, top-1 first
    segments, mask = decode_segments(model, cache, first, step, width, eos_token_ids, stats, mask)
    children = []
    for b, (tokens, rewards, next_tokens) in enumerate(segments):
        parent = parents[b // width]
        child = Node(tokens=tokens, reward_sum=parent.reward_sum + sum(rewards),
                     reward_count=parent.reward_count + len(rewards), last_reward=rewards[-1],
                     finished=tokens[-1] in eos_token_ids,
                     parent=parent, row=b, next_tokens=next_tokens, prompt=parent.prompt)
        parent.children.append(child)
        children.append(child)
    for parent in parents:
        parent.row = None  # rows now belong to the children
    return Level(cache, children, mask)


def backup(node: Node, leaf_score: LeafScore = "mean") -> float:
    """Q(node): the best leaf score in its subtree (a leaf's Q is its own score)."""
    if not node.children:
        return node.score(leaf_score)
    return max(backup(child, leaf_score) for child in node.children)


def select_action(root: Node, leaf_score: LeafScore = "mean") -> int:
    """Index of the first-level child with the largest Q; ties → the lowest index (the likelier token)."""
    q = [backup(child, leaf_score) for child in root.children]
    return max(range(len(q)), key=q.__getitem__)  # max keeps the first of equal values


def prune(level: Level, new_roots: list[Node]) -> Level:
    """Keep only the level's nodes below one of ``new_roots`` (or a root itself); their cache rows stay put (the
    next :func:`expand` drops the others' rows)."""
    roots = {id(root) for root in new_roots}

    def below(node: Node | None) -> bool:
        while node is not None:
            if id(node) in roots:
                return True
            node = node.parent
        return False

    kept = [node for node in level.nodes if below(node)]
    for root in new_roots:
        root.parent = None  # detach: the committed path no longer matters
    return Level(level.cache, kept, level.attention_mask)


# ---------------------------------------------------------------------------------------------------
# public API


def _search(model: RewardTransformer, prompts: list[torch.Tensor], cfg: SLASearch, max_new_tokens: int,
            eos_token_ids: set[int], pad_token_id: int, stats: SLAStats) -> Iterator[list[tuple[int, list[int]]]]:
    """SLA(d, k, n) on the prompts' trees in lockstep; yields, per step, (prompt, committed segment) for every
    prompt still decoding. A prompt stops after a segment that contains an end token (kept, like HF greedy
    output) or once ``max_new_tokens`` of its tokens are out (the last segment truncated to that)."""
    if max_new_tokens <= 0:
        return
    eos = set(eos_token_ids)
    depth, width = (cfg.depth, cfg.width) if cfg.depth > 0 else (1, 1)  # d = 0: plain greedy, n per step
    roots, level = prefill(model, prompts, width, pad_token_id, stats)
    for _ in range(depth):  # build the initial trees
        level = expand(model, level, width, cfg.step, eos, stats)
    committed = [0] * len(prompts)
    while roots:
        decided, next_roots = [], []
        for root in roots:
            chosen = root.children[select_action(root, cfg.leaf_score)]
            chunk = chosen.tokens[: max_new_tokens - committed[root.prompt]]
            committed[root.prompt] += len(chunk)
            stats.committed_tokens += len(chunk)
            stats.steps += 1
            decided.append((root.prompt, chunk))
            if not (chosen.finished or committed[root.prompt] >= max_new_tokens):
                next_roots.append(chosen)  # streaming: keep its subtree, levels 1..d−1
        yield decided
        roots = next_roots
        if roots:
            level = expand(model, prune(level, roots), width, cfg.step, eos, stats)  # restore depth d


def sla_stream(model: RewardTransformer, input_ids: torch.LongTensor, cfg: SLASearch, max_new_tokens: int,
               eos_token_ids: set[int], stats: SLAStats | None = None) -> Iterator[list[int]]:
    """Decode one prompt ``input_ids`` (1, T) with SLA(d, k, n); yield each committed segment as it is decided.

    Stops after a segment that contains an end token (kept, like HF greedy output) or once
    ``max_new_tokens`` tokens are out (the last chunk is truncated to that). ``stats`` is updated live.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"SLA decodes one prompt at a time: input_ids must be (1, T), got {tuple(input_ids.shape)}")
    stats = stats if stats is not None else SLAStats()
    for ((_, chunk),) in _search(model, [input_ids], cfg, max_new_tokens, eos_token_ids, 0, stats):
        yield chunk


def sla_generate(model: RewardTransformer, input_ids: torch.LongTensor, cfg: SLASearch, max_new_tokens: int,
                 eos_token_ids: set[int]) -> tuple[list[int], SLAStats]:
    """The whole SLA response (token ids) and the run's counters."""
    stats = SLAStats()
    tokens = [t for chunk in sla_stream(model, input_ids, cfg, max_new_tokens, eos_token_ids, stats) for t in chunk]
    return tokens, stats


def sla_generate_batch(model: RewardTransformer, prompts: list[torch.LongTensor], cfg: SLASearch,
                       max_new_tokens: int, eos_token_ids: set[int], pad_token_id: int,
                       stats: SLAStats | None = None) -> list[list[int]]:
    """SLA responses to several prompts (each (1, T_p)), their trees searched as one batch: each response is the
    one :func:`sla_generate` gives that prompt alone, up to the rounding of a padded batch."""
    if not prompts or any(ids.dim() != 2 or ids.shape[0] != 1 for ids in prompts):
        raise ValueError("sla_generate_batch takes a non-empty list of (1, T) prompts")
    responses: list[list[int]] = [[] for _ in prompts]
    for decided in _search(model, prompts, cfg, max_new_tokens, eos_token_ids, pad_token_id,
                           stats if stats is not None else SLAStats()):
        for p, chunk in decided:
            responses[p] += chunk
    return responses


@torch.inference_mode()
def greedy_generate(model: RewardTransformer, input_ids: torch.LongTensor, max_new_tokens: int,
                    eos_token_ids: set[int], stats: SLAStats | None = None) -> tuple[list[int], list[float]]:
    """Greedy decoding with a KV cache, as HF ``generate(do_sample=False)``; also the reward of every token.

    Every generated token is fed once (the last one too, to get its reward): ``max_new_tokens`` cached
    one-token forwards after the prefill.
    """
    stats = stats if stats is not None else SLAStats()
    tokens: list[int] = []
    rewards: list[float] = []
    if max_new_tokens <= 0:
        return tokens, rewards
    logits, _, cache = _forward(model, input_ids, None, stats)  # (1, V)
    while True:
        token = int(logits[0].argmax())
        tokens.append(token)
        logits, step_rewards, cache = _forward(model, input_ids.new_tensor([[token]]), cache, stats)
        rewards.append(float(step_rewards[0, -1]))
        stats.committed_tokens += 1
        stats.steps += 1
        if token in eos_token_ids or len(tokens) >= max_new_tokens:
            return tokens, rewards
