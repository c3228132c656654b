"""Tree speculative decoding of several prompts in one batch: greedy-verified (lossless) or by speculative sampling
(exact in distribution), every step's work batched over the rows: one tree forward, one verdict for all rows (the
sampling draws: :func:`models.engine.speculative.draw_rows`, each row's own generator), and one host sync to read
every row's kept tokens.

The batch-B counterpart of :func:`models.engine.speculative.speculative_stream`, for Medusa's heads, MTP's
chained drafts and MTP's dynamic trees alike. A drafter's tree is one :class:`~models.engine.speculative.Tree` shared
by every row (Medusa's, a chain) or each row's own (:class:`~models.engine.speculative.RowTrees`: EAGLE-2's dynamic
tree follows each row's drafter confidence), the same N + 1 nodes per row either way; the functions below read both.
Medusa §2.1.2 (tree attention) batched, as the same pipeline of small functions:

    draft (``drafter.propose``: every row's N + 1 tree tokens)  →  one tree forward of every row
    (:func:`batch_tree_inputs`)  →  a verdict per row (:class:`BatchGreedy` | :class:`BatchSampling`)
    →  mark each row's accepted nodes visible  →  ``drafter.accept``

Layout: a right-padded KV cache whose junk is masked, not moved. Row b's real positions are its *visible*
columns (a (B, T) mask): after the prefill its L_b prompt columns, then the tree nodes it accepted. A step appends
every row's N + 1 tree nodes at [T, T + N + 1) (Hugging Face caches concatenate); row b's nodes take position ids
L_b + depth (L_b: its visible count) and attend to its visible columns and to their ancestors, nothing else (one
additive mask per row). Rotary embeddings are applied to the keys when they are written, with those position
ids, so a key's column never matters, only its visibility: keeping a row's accepted nodes is marking their
columns visible, and its rejected nodes stay behind as masked junk. Rows accept different numbers of tokens at no
copying cost. When the junk grows past the longest row's half (at least 64 columns), one gather per layer moves
every row's visible columns to the front (``compact_cache``): attention over junk is cheap, a copy of the whole
cache every step is not (Hugging Face's own cache update already copies it once per step). Rows that end (an end
token, or ``max_new_tokens``) leave the batch: the cache and the drafter keep only the rows still decoding.

Randomness: under sampling each prompt has its own generator, which draws its drafts (MTP at a draft temperature)
and its verdicts, so a prompt's output does not depend on which prompts share its batch.

Adapting (:class:`models.engine.config.Adaptation`): the batch drafts a step or runs it plainly (every row's root
alone, one token each) as one. τ counts the tokens a cycle gave per row it ran, pooled over the window's cycles
(a cycle of 16 rows weighs 16 times one of the batch's last row), and a cycle's cost, measured, is its time over a
plain step's *with as many rows*: a bigger batch makes a tree forward cost more plain steps (the forward stops
being memory-bound), which is where drafting stops paying, and the rule follows it as rows end and leave
(:class:`~models.engine.speculative.AdaptiveDrafting`).

Scope: full-attention models (every cache layer a plain ``DynamicLayer``: Llama, SmolLM2; sliding-window and
other layers are refused, naming the layer); speculative sampling on chains drafted from a law, and on any tree of
deterministic candidates (a shared tree, or each row's dynamic tree). Typical acceptance and sliding windows stay
in :mod:`models.engine.speculative`, at batch 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from models.engine.config import Adaptation
from models.engine.kv_cache import cache_kwargs
from models.engine.speculative import (
    AdaptiveDrafting,
    DraftLogits,
    RowTrees,
    SpeculativeStats,
    Tree,
    accepted_paths,
    batch_candidates,
    draw_rows,
    emitted,
    greedy_match,
    last_hidden_forward,
    root_tree,
    temperature_probs,
    top_tokens,
    verify_rows,
    verify_tree_rows,
)


class BatchDrafter(Protocol):
    """Proposes every decoding row's tree at once, and follows the rows' verified outputs."""

    tree: Tree | RowTrees  # the last proposal's tree: one shared by every row (every step's), or each row's own

    def start(self, prompts: Sequence[Sequence[int]], hidden: torch.Tensor, roots: torch.Tensor) -> None:
        """After the prefill: the prompts, their final hidden states (B, P, H), right-padded, and the first roots
        (B,)."""

    def propose(self, roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's N + 1 tree tokens (B, N+1), root first, and the law each draft of a chain was drawn from
        (B, D, V) (None: drafts for greedy verification only); ``tree`` is then their tree."""

    def accept(self, hidden: torch.Tensor, tokens: Sequence[Sequence[int]]) -> None:
        """Each row's step: the final hidden states of the nodes it kept (B, D+1, H), root first, row b's first a_b
        real (the rest filler), and its a_b new tokens (the last is the next root). A plain step kept the root
        alone."""

    def keep(self, rows: torch.Tensor) -> None:
        """Only ``rows`` (indices into the current rows) go on decoding."""


class BatchVerifier(Protocol):
    """Judges every row's step."""

    def choose(self, logits: torch.Tensor, prompts: Sequence[int]) -> torch.Tensor:
        """The model's next token (B,) of each row from its logits (B, V); ``prompts``: each row's prompt index."""

    def __call__(self, tokens: torch.Tensor, probs: torch.Tensor | None, logits: torch.Tensor, tree: Tree | RowTrees,
                 prompts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the tree forward's logits (B, N+1, V): each row's kept nodes (B, D+1), root first, entries past
        its count filler; the count (B,), root included; and the next root (B,), the model's own token."""


class BatchGreedy:
    """Greedy verification: a node is kept when its token is its parent's argmax (lossless)."""

    def choose(self, logits: torch.Tensor, prompts: Sequence[int]) -> torch.Tensor:
        return top_tokens(logits)

    def __call__(self, tokens, probs, logits, tree, prompts):
        predictions = top_tokens(logits)  # (B, N+1)
        nodes, counts = accepted_paths(tree, greedy_match(tokens, predictions, tree))  # (B, D+1), (B,)
        last = nodes.gather(1, (counts - 1)[:, None])  # (B, 1) the last kept node predicts the bonus
        return nodes, counts, predictions.gather(1, last)[:, 0]


class BatchSampling:
    """Speculative sampling of every row at ``temperature`` > 0 with its prompt's generator: every row's output is
    distributed exactly as sampling from the model. A chain whose drafts were drawn from a stated law (``probs``:
    MTP's chained drafts) is verified against it (:func:`models.engine.speculative.verify_rows`); deterministic
    candidates (``probs`` None: a tree shared by the rows, or each row's own dynamic tree) by the tree rule
    (:func:`models.engine.speculative.verify_tree_rows`, SpecInfer's rule with point-mass drafts). Row b consumes
    its generator as it would decoding alone at batch 1. ``generators``: one per prompt, on the model's device."""

    def __init__(self, temperature: float, generators: Sequence[torch.Generator | None]):
        if temperature <= 0:
            raise ValueError(f"speculative sampling needs a temperature > 0, got {temperature} (use BatchGreedy)")
        self.temperature, self.generators = temperature, list(generators)

    def choose(self, logits: torch.Tensor, prompts: Sequence[int]) -> torch.Tensor:
        return draw_rows(temperature_probs(logits, self.temperature), [self.generators[p] for p in prompts])

    def __call__(self, tokens, probs, logits, tree, prompts):
        target = temperature_probs(logits, self.temperature)  # (B, N+1, V)
        generators = [self.generators[p] for p in prompts]
        if probs is None:  # deterministic candidates, or a plain step (the root alone: a draw from the model)
            return verify_tree_rows(tokens, target, tree, generators)
        if isinstance(tree, RowTrees) or len(tree.paths) != 1:
            raise ValueError("drafts drawn from a stated law are verified as one chain shared by every row; this step "
                             f"has {'each row its own tree' if isinstance(tree, RowTrees) else f'{len(tree.paths)} paths'}")
        accepted, roots = verify_rows(tokens[:, 1:], probs, target, generators)
        nodes = torch.arange(tree.size, device=logits.device).expand(len(prompts), -1)  # (B, N+1) the chain
        return nodes, accepted + 1, roots


class HeadsDrafter:
    """Medusa's drafter at batch B: ``tree`` filled from ``draft_logits`` (B, H), (B,) → (B, D, V) of each row's last
    kept token's final hidden state (:class:`models.medusa.heads.MedusaDrafter`'s ``logits`` takes a batch)."""

    def __init__(self, tree: Tree, draft_logits: DraftLogits):
        self.tree, self.draft_logits = tree, draft_logits

    def start(self, prompts, hidden, roots):
        lengths = torch.tensor([len(p) for p in prompts], device=hidden.device)
        self.hidden = hidden[torch.arange(len(prompts), device=hidden.device), lengths - 1]  # (B, H)

    def propose(self, roots):
        return batch_candidates(roots, self.draft_logits(self.hidden, roots), self.tree), None

    def accept(self, hidden, tokens):
        last = torch.tensor([len(step) - 1 for step in tokens], device=hidden.device)  # (B,) each row's last kept
        self.hidden = hidden[torch.arange(len(tokens), device=hidden.device), last]  # (B, H)

    def keep(self, rows):
        self.hidden = self.hidden[rows]


def batch_tree_inputs(tree: Tree | RowTrees, visible: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (B, N+1) and the additive mask (B, 1, N+1, T + N+1) of a tree forward over a cache of T columns,
    row b's real keys at its ``visible`` (B, T) columns; ``tree``: shared by every row, or each row's."""
    positions = visible.sum(dim=1, keepdim=True) + tree.depths.to(visible.device)  # (B, N+1)
    keys = torch.cat([visible[:, None, :].expand(-1, tree.size, -1),
                      tree.ancestors.to(visible.device).expand(len(visible), -1, -1)], dim=2)  # (B, N+1, T+N+1)
    mask = torch.where(keys, 0.0, torch.finfo(dtype).min).to(dtype)
    return positions, mask[:, None]  # (B, N+1), (B, 1, N+1, T+N+1)


def compact_cache(cache: DynamicCache, visible: torch.Tensor) -> torch.Tensor:
    """Move every row's visible columns (B, T), in order, to the front of its cache and drop the columns no row
    needs; returns the new visibility (B, T'), T' the longest row."""
    lengths = visible.sum(dim=1)
    width = int(lengths.max())
    order = (~visible).int().argsort(dim=1, stable=True)[:, :width]  # (B, T') visible columns first, in order
    for layer in cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])  # (B, heads, T', d)
        layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
    return torch.arange(width, device=visible.device)[None] < lengths[:, None]


def too_much_junk(width: int, longest: int) -> bool:
    """Whether a cache of ``width`` columns whose longest row has ``longest`` visible ones is worth compacting: when its
    junk passes half the longest row, at least 64 columns (the module docstring's trade)."""
    return width - longest > max(64, longest // 2)


def keep_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` (indices into the batch) of every cache layer."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def unsupported_layers(model) -> str | None:
    """Why ``model`` cannot decode batched (the cache layers other than plain full attention), or None: only those
    roll back by a per-row gather."""
    others = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers
                     if type(layer) is not DynamicLayer})
    return f"{type(model).__name__} has {', '.join(others)} cache layers" if others else None


def _prefill(model, prompts: Sequence[Sequence[int]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Every prompt, right-padded, into a new cache: the cache, each row's logits after its last prompt token
    (B, V) and the final hidden states (B, P, H)."""
    device = model.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    if len(prompts) == 0 or int(lengths.min()) == 0:
        raise ValueError("batched tree decoding needs at least one prompt, each of at least one token")
    input_ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)  # right-padded
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.as_tensor(prompt, device=device)
    real = torch.arange(input_ids.shape[1], device=device)[None] < lengths[:, None]  # (B, P)
    cache = DynamicCache(config=model.config)
    last = [len(p) - 1 for p in prompts]  # each row's last prompt position
    kept = sorted(set(last))  # the positions whose logits any row needs (the LM head skips the rest)
    out, hidden = last_hidden_forward(model, input_ids=input_ids, attention_mask=real.long(),
                                      **cache_kwargs(model, cache), use_cache=True,
                                      logits_to_keep=torch.tensor(kept, device=device))
    rows = torch.arange(len(prompts), device=device)
    return cache, out.logits[rows, torch.tensor([kept.index(n) for n in last], device=device)], hidden


@torch.no_grad()
def batched_speculative_generate(model, drafter: BatchDrafter, verifier: BatchVerifier,
                                 prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_ids: set[int],
                                 adaptation: Adaptation | AdaptiveDrafting | None = None,
                                 clock: Callable[[], float] = time.perf_counter,
                                 ) -> tuple[list[list[int]], list[SpeculativeStats]]:
    """Speculative decoding of ``prompts`` (token ids, any lengths) in one batch: each prompt's new tokens, cut
    after an end token (kept) or at ``max_new_tokens``, and its counters (forwards = the steps it took part in,
    its prefill included). ``adaptation``: draft only while it pays at this batch size (module docstring); a
    :class:`~models.engine.speculative.AdaptiveDrafting` carries its state from earlier batches."""
    unsupported = unsupported_layers(model)
    if unsupported:
        raise NotImplementedError(f"batched tree decoding supports full-attention caches only; {unsupported} "
                                  "(decode at batch 1)")
    device = model.device
    cache, logits, hidden = _prefill(model, prompts)
    active = list(range(len(prompts)))  # the prompt index of each cache row
    roots = verifier.choose(logits, active)  # (B,)
    drafter.start(prompts, hidden, roots)
    adapter = AdaptiveDrafting(adaptation) if isinstance(adaptation, Adaptation) else adaptation
    if adapter is not None:
        adapter.start_prompt()
    timed = adapter is not None and adapter.measures

    outputs: list[list[int]] = [[] for _ in prompts]
    stats = [SpeculativeStats(forwards=1) for _ in prompts]
    going = _record(outputs, stats, active, [[r] for r in roots.tolist()], max_new_tokens, eos_token_ids)
    lengths = [len(p) for p in prompts]  # each row's visible columns, counted on the host (no device sync)
    visible = torch.arange(hidden.shape[1], device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    while going:
        started = clock() if timed else 0.0
        if len(going) < len(active):  # rows ended: they leave the cache and the drafter
            keep = torch.tensor(going, device=device)
            keep_rows(cache, keep)
            drafter.keep(keep)
            visible, roots = visible[keep], roots[keep]
            active, lengths = [active[b] for b in going], [lengths[b] for b in going]
        if too_much_junk(visible.shape[1], max(lengths)):  # move the real keys together
            visible = compact_cache(cache, visible)
        drafts = adapter is None or adapter.drafts()
        if drafts:
            tokens, probs = drafter.propose(roots)  # (B, N+1), (B, D, V) | None
            tree = drafter.tree  # this proposal's: shared, or each row's
        else:  # a plain step: each row's root alone
            tree, tokens, probs = root_tree(), roots[:, None], None
        positions, mask = batch_tree_inputs(tree, visible, model.dtype)
        out, hidden = last_hidden_forward(model, input_ids=tokens, position_ids=positions, attention_mask=mask,
                                          **cache_kwargs(model, cache), use_cache=True)
        nodes, counts, roots = verifier(tokens, probs, out.logits, tree, active)  # (B, D+1), (B,), (B,)
        # the kept nodes' columns become visible; the rest of the tree stays behind as junk
        kept_nodes = torch.arange(nodes.shape[1], device=device)[None] < counts[:, None]  # (B, D+1)
        kept_index = torch.where(kept_nodes, nodes, nodes[:, :1])  # filler entries point at the root, kept anyway
        added = torch.zeros(len(active), tree.size, dtype=torch.bool, device=device).scatter(1, kept_index, True)
        visible = torch.cat([visible, added], dim=1)
        # one host sync per step: each row's count, its path's tokens and its next root (B, 1 + D+1 + 1)
        host = torch.cat([counts[:, None], tokens.gather(1, nodes), roots[:, None]], dim=1).tolist()
        steps = [row[2 : 1 + row[0]] + [row[-1]] for row in host]  # the kept drafts, then the next root
        lengths = [n + len(step) for n, step in zip(lengths, steps, strict=True)]
        going = _record(outputs, stats, active, steps, max_new_tokens, eos_token_ids,
                        drafted=tree.size - 1 if drafts else 0)
        drafter.accept(hidden.gather(1, nodes[..., None].expand(-1, -1, hidden.shape[-1])), steps)  # (B, D+1, H)
        if adapter is not None:
            if timed and device.type == "cuda":
                torch.cuda.synchronize(device)
            adapter.record(drafts, sum(len(step) for step in steps), clock() - started if timed else 0.0,
                           rows=len(steps))
    return outputs, stats


def _record(outputs: list[list[int]], stats: list[SpeculativeStats], prompts: list[int], steps: list[list[int]],
            max_new_tokens: int, eos_token_ids: set[int], drafted: int | None = None) -> list[int]:
    """Append each cache row's step tokens to its prompt's output (up to an end token or ``max_new_tokens``) and
    count them — the prefill's (``drafted`` None), a plain step's (0 drafts) or a draft–verify cycle's that offered
    ``drafted`` drafts per row; returns the cache rows that go on decoding."""
    going = []
    for b, (index, step) in enumerate(zip(prompts, steps, strict=True)):
        room = max_new_tokens - len(outputs[index])
        kept, ended = emitted(step, room, eos_token_ids)
        outputs[index] += kept
        stats[index].generated_tokens += len(kept)
        if drafted == 0:
            stats[index].forwards += 1
            stats[index].plain_forwards += 1
        elif drafted is not None:
            stats[index].forwards += 1
            stats[index].drafted_tokens += drafted
            stats[index].accepted_lengths.append(len(kept))
            stats[index].accepted_drafts += min(len(step) - 1, len(kept))  # the bonus is no draft
        if not ended and len(outputs[index]) < max_new_tokens:
            going.append(b)
    return going
