"""Tree speculative decoding of several prompts in one batch, greedy-verified (lossless).

The batch-B counterpart of :func:`models.engine.speculative.speculative_generate` for a
:class:`~models.engine.speculative.TreeDrafter` (Medusa's drafter: a fixed tree filled from the last accepted
token's hidden state) under greedy verification, so its outputs are each prompt's greedy decoding, token for token
(tests compare them with per-row HF greedy at batch 1, 2, 5 and 16). Medusa §2.1.2 (tree attention) batched; the
step is the same pipeline of small functions: draft (``batch_candidates``) → one tree forward of every row
(:func:`batch_tree_inputs`) → greedy verdict per row (``accepted_paths``) → keep each row's accepted nodes
(:func:`compact_cache`).

Layout: a right-padded KV cache. Row b holds its L_b real positions at cache indices [0, L_b), then junk up to
the longest row's length T. A step appends every row's N + 1 tree nodes at [T, T + N + 1) (Hugging Face caches
concatenate); row b's nodes take position ids L_b + depth and attend to its keys below L_b and to their
ancestors, nothing else (one additive mask per row). Rows accept different numbers of tokens: one gather per
layer then moves each row's accepted nodes to [L_b, L_b + a_b) and cuts the cache to the new longest row. Right
padding makes a row's cache index its position, so rotary positions need no per-row offsets, and compaction is
that one gather (Hugging Face's own cache update copies the whole cache every step anyway). Rows that end (an
end token, or ``max_new_tokens``) leave the batch: the cache keeps only the rows still decoding.

Scope: full-attention models (every cache layer a plain ``DynamicLayer``: Llama, SmolLM2; sliding-window and
other layers are refused, naming the layer) and greedy verification; no adaptive plain steps (every step drafts,
so τ here is the heads' gain per cycle). Batch-1 decoding with adaptation, typical acceptance or sliding windows
stays in :mod:`models.engine.speculative`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from models.engine.speculative import (
    SpeculativeStats,
    Tree,
    TreeDrafter,
    accepted_paths,
    batch_candidates,
    emitted,
    greedy_match,
)


def batch_tree_inputs(tree: Tree, lengths: torch.Tensor, cache_length: int, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (B, N+1) and the additive mask (B, 1, N+1, T + N+1) of a tree forward over a right-padded
    cache of ``cache_length`` (T) columns, row b's first ``lengths[b]`` of them real."""
    device = lengths.device
    positions = lengths[:, None] + tree.depths.to(device)[None]  # (B, N+1)
    prefix = torch.arange(cache_length, device=device)[None] < lengths[:, None]  # (B, T)
    visible = torch.cat([prefix[:, None, :].expand(-1, tree.size, -1),
                         tree.ancestors.to(device)[None].expand(len(lengths), -1, -1)], dim=2)  # (B, N+1, T+N+1)
    mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)
    return positions, mask[:, None]  # (B, N+1), (B, 1, N+1, T+N+1)


def compact_cache(cache: DynamicCache, rows: torch.Tensor, lengths: torch.Tensor, nodes: torch.Tensor,
                  counts: torch.Tensor, cache_length: int) -> None:
    """Keep ``rows`` (indices into the batch) and, for each, its ``lengths`` real positions followed by its first
    ``counts`` tree nodes ``nodes`` (node indices, stored from column ``cache_length`` on), right-padded to the new
    longest row. Arguments are per kept row."""
    new_lengths = lengths + counts
    width = int(new_lengths.max())
    column = torch.arange(width, device=lengths.device)[None]  # (1, T')
    from_tree = cache_length + nodes.gather(1, (column - lengths[:, None]).clamp(0, nodes.shape[1] - 1))
    keep = torch.where(column < lengths[:, None], column, torch.where(column < new_lengths[:, None], from_tree, 0))
    for layer in cache.layers:
        keys, values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)  # (B', heads, T+N+1, d)
        index = keep[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])  # (B', heads, T', d)
        layer.keys, layer.values = keys.gather(2, index), values.gather(2, index)


def unsupported_layers(model) -> str | None:
    """Why ``model`` cannot decode batched (the cache layers other than plain full attention), or None: only those
    roll back by a per-row gather."""
    others = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers
                     if type(layer) is not DynamicLayer})
    return f"{type(model).__name__} has {', '.join(others)} cache layers" if others else None


@torch.no_grad()
def batched_tree_generate(model, drafter: TreeDrafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          eos_token_ids: set[int]) -> tuple[list[list[int]], list[SpeculativeStats]]:
    """Greedy-verified tree decoding of ``prompts`` (token ids, any lengths) in one batch: each prompt's new
    tokens, cut after an end token (kept) or at ``max_new_tokens``, and its counters (forwards = the steps it took
    part in, its prefill included). ``drafter.draft_logits`` must take a batch of hidden states (B, H) and roots
    (B,) and return (B, D, V), as Medusa's heads do."""
    unsupported = unsupported_layers(model)
    if unsupported:
        raise NotImplementedError(f"batched tree decoding supports full-attention caches only; {unsupported} "
                                  "(decode at batch 1)")
    device = model.device
    batch = len(prompts)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    if batch == 0 or int(prompt_lengths.min()) == 0:
        raise ValueError("batched tree decoding needs at least one prompt, each of at least one token")
    input_ids = torch.zeros(batch, int(prompt_lengths.max()), dtype=torch.long, device=device)  # right-padded
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.as_tensor(prompt, device=device)
    real = torch.arange(input_ids.shape[1], device=device)[None] < prompt_lengths[:, None]  # (B, P)
    cache = DynamicCache(config=model.config)
    last = prompt_lengths - 1  # each row's last prompt position
    kept = last.unique()  # the positions whose logits any row needs (the LM head skips the rest)
    out = model(input_ids=input_ids, attention_mask=real.long(), past_key_values=cache, use_cache=True,
                output_hidden_states=True, logits_to_keep=kept)
    rows = torch.arange(batch, device=device)
    roots = out.logits[rows, torch.searchsorted(kept, last)].argmax(dim=-1)  # (B,)
    hidden = out.hidden_states[-1][rows, last]  # (B, H)

    outputs: list[list[int]] = [[] for _ in prompts]
    stats = [SpeculativeStats(forwards=1) for _ in prompts]
    active = torch.arange(batch, device=device)  # the prompt index of each cache row
    lengths = prompt_lengths  # real positions per cache row (a row's root is not in the cache yet)
    going = _record(outputs, stats, active.tolist(), [[int(r)] for r in roots], max_new_tokens, eos_token_ids)
    nodes = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the last step's kept nodes: none yet
    counts = torch.zeros(batch, dtype=torch.long, device=device)
    cache_length = cache.get_seq_length()
    tree = drafter.tree
    while going:
        keep = torch.tensor(going, device=device)
        if len(going) < len(active) or counts.any():  # rows ended, or the last step's nodes await compaction
            compact_cache(cache, keep, lengths[keep], nodes[keep], counts[keep], cache_length)
        active, lengths, roots, hidden = active[keep], (lengths + counts)[keep], roots[keep], hidden[keep]
        tokens = batch_candidates(roots, drafter.draft_logits(hidden, roots), tree)  # (B, N+1)
        cache_length = cache.get_seq_length()
        positions, mask = batch_tree_inputs(tree, lengths, cache_length, model.dtype)
        out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=cache,
                    use_cache=True, output_hidden_states=True)
        predictions = out.logits.argmax(dim=-1)  # (B, N+1)
        nodes, counts = accepted_paths(tree, greedy_match(tokens, predictions, tree))  # (B, D+1), (B,)
        last_node = nodes.gather(1, (counts - 1)[:, None])[:, 0]  # (B,) the last accepted node predicts the bonus
        rows = torch.arange(len(active), device=device)
        roots = predictions[rows, last_node]  # the bonus tokens: the next roots
        hidden = out.hidden_states[-1][rows, last_node]  # (B, H)
        path_tokens = tokens.gather(1, nodes)  # (B, D+1), root first
        steps = [path_tokens[b, 1 : counts[b]].tolist() + [int(roots[b])] for b in range(len(active))]
        going = _record(outputs, stats, active.tolist(), steps, max_new_tokens, eos_token_ids, drafted=tree.size - 1)
    return outputs, stats


def _record(outputs: list[list[int]], stats: list[SpeculativeStats], prompts: list[int], steps: list[list[int]],
            max_new_tokens: int, eos_token_ids: set[int], drafted: int | None = None) -> list[int]:
    """Append each cache row's step tokens to its prompt's output (up to an end token or ``max_new_tokens``) and
    count them — the prefill's (``drafted`` None) or a draft–verify cycle's that offered ``drafted`` drafts per row;
    returns the cache rows that go on decoding."""
    going = []
    for b, (index, step) in enumerate(zip(prompts, steps, strict=True)):
        room = max_new_tokens - len(outputs[index])
        kept, ended = emitted(step, room, eos_token_ids)
        outputs[index] += kept
        stats[index].generated_tokens += len(kept)
        if drafted is not None:
            stats[index].forwards += 1
            stats[index].drafted_tokens += drafted
            stats[index].accepted_lengths.append(len(kept))
            stats[index].accepted_drafts += min(len(step) - 1, len(kept))  # the bonus is no draft
        if not ended and len(outputs[index]) < max_new_tokens:
            going.append(b)
    return going
