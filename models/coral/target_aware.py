"""COrAL: target-aware RoPE in the last decoder layer, patch corruption, and the order-agnostic losses.

Xie et al. 2024, "COrAL: Order-Agnostic Language Modeling for Efficient Iterative Refinement"
(docs/coral.md): §2.2 (forward prediction + backward reconstruction, corruption
strategy), §2.3 (target-aware RoPE, eq. 4), Appendix D (offsets, corruption granularity and ratio).

Target-aware RoPE. Ordinary RoPE rotates the query of position m at m: the representation that
predicts the token at m + 1. COrAL rotates the LAST layer's query at the target position instead, so
one forward can predict the token at m + o for several offsets o: each query is repeated once per
offset and rotated at m + o − 1 (offset +1 = rotation at m = the ordinary next-token prediction),
keys keep their own positions, and every copy reuses the causal row of m (it sees keys ≤ m only). No
new parameters. Offsets +1…+4 predict ahead on clean text ("forward prediction"); offsets −8…0
reconstruct the tokens at m − 8…m from a corrupted context ("backward reconstruction").

Composition, not a fork: :func:`target_aware` swaps the last decoder layer of a Hugging Face Llama-family
model (Llama, Mistral, Qwen2, SmolLM2: q/k/v/o projections + RMSNorms + MLP + rotary embedding) for a
:class:`TargetAwareLayer` that reuses its modules, for the duration of one call. Outside that call the
model is untouched: HF ``generate`` and ``save_pretrained`` see the plain model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import rotate_half

from models.engine.kv_cache import cache_kwargs

FORWARD_OFFSETS = (1, 2, 3, 4)
"""Forward prediction: the tokens at m + 1 … m + 4 (Appendix D: forward context window 4)."""
BACKWARD_OFFSETS = tuple(range(-8, 1))
"""Backward reconstruction: the tokens at m − 8 … m (Appendix D: backward context window 8)."""


class TargetAwareLayer(nn.Module):
    """The last decoder layer with target-aware queries: hidden (B, T, H) → (B, O·T, H), offset-major.

    Reuses the wrapped layer's modules (no new parameters). ``detach_input`` cuts the gradient below this
    layer (COrAL's backward reconstruction trains the last layer only).
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, offsets: Sequence[int], detach_input: bool = False):
        super().__init__()
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attention, name):
                raise TypeError(f"target-aware RoPE needs a Llama-family attention with {name}; "
                                f"{type(attention).__name__} has none")
        if any(hasattr(attention, name) for name in ("q_norm", "k_norm")):
            raise TypeError(f"{type(attention).__name__} normalises queries/keys (q_norm/k_norm): not supported")
        self.layer, self.rotary_emb = layer, rotary_emb
        self.offsets, self.detach_input = tuple(offsets), detach_input

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None, position_embeddings=None,
                cache=None, **kwargs) -> torch.Tensor:
        # the decoder hands its layers the KV cache as ``cache`` from transformers 5.24, as ``past_key_values``
        # before (models/engine/kv_cache.py): this layer stands in for theirs, so it takes either
        cache = cache if cache is not None else past_key_values
        layer, attention = self.layer, self.layer.self_attn
        if self.detach_input:
            hidden_states = hidden_states.detach()
        batch, length, _ = hidden_states.shape
        num_offsets = len(self.offsets)
        residual = hidden_states
        x = layer.input_layernorm(hidden_states)
        head_shape = (batch, length, -1, attention.head_dim)
        query = attention.q_proj(x).view(head_shape).transpose(1, 2)  # (B, heads, T, d)
        key = attention.k_proj(x).view(head_shape).transpose(1, 2)  # (B, kv_heads, T, d)
        value = attention.v_proj(x).view(head_shape).transpose(1, 2)
        cos, sin = position_embeddings
        key = _rotate(key, cos, sin)  # keys at their own positions
        if cache is not None:  # the keys/values are the ordinary ones: cacheable as usual
            key, value = cache.update(key, value, attention.layer_idx)
        # each query once per offset, rotated at its target position m + o − 1 (o = +1: the usual m); the angles
        # in the query's dtype, as the keys' are in theirs (a float32 norm weight, say float32 master weights
        # under autocast, would otherwise turn the queries float32 and the keys not)
        target_positions = torch.cat([position_ids + (o - 1) for o in self.offsets], dim=-1)  # (B|1, O·T)
        cos_q, sin_q = self.rotary_emb(query, target_positions)
        query = _rotate(query.repeat(1, 1, num_offsets, 1), cos_q, sin_q)  # (B, heads, O·T, d)
        mask = _causal_rows(attention_mask, length, key.shape[2], hidden_states.device)  # (B|1, 1, T, S)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.repeat(1, 1, num_offsets, 1),
                                             scale=attention.scaling, enable_gqa=True)  # (B, heads, O·T, d)
        out = attention.o_proj(out.transpose(1, 2).reshape(batch, num_offsets * length, -1))  # (B, O·T, H)
        hidden = residual.repeat(1, num_offsets, 1) + out
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))  # (B, O·T, H)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama applies it: x (B, heads, T, d) rotated by the angles of cos/sin (B, T, d)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def _causal_rows(attention_mask: torch.Tensor | None, length: int, total: int, device) -> torch.Tensor:
    """The 4-D mask HF built for the layer (bool or additive float), or — where HF relies on ``is_causal``
    and passes none — the plain causal one: query t (after ``total − length`` cached keys) sees keys ≤ it."""
    if attention_mask is not None:
        return attention_mask
    keys = torch.arange(total, device=device)
    queries = torch.arange(length, device=device) + total - length
    return (keys[None, :] <= queries[:, None])[None, None]  # (1, 1, T, S)


def _decoder(model) -> nn.Module:
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        raise TypeError(f"{type(model).__name__} is not a Llama-family decoder with rotary embeddings")
    return decoder


@contextmanager
def target_aware(model, offsets: Sequence[int], detach_input: bool = False) -> Iterator[None]:
    """Within the block, ``model``'s last decoder layer is target-aware for ``offsets``."""
    decoder = _decoder(model)
    last = decoder.layers[-1]
    decoder.layers[-1] = TargetAwareLayer(last, decoder.rotary_emb, offsets, detach_input)
    try:
        yield
    finally:
        decoder.layers[-1] = last


def target_aware_hidden(model, input_ids: torch.Tensor, offsets: Sequence[int],
                        attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                        cache=None, detach_input: bool = False) -> torch.Tensor:
    """Final (normed) hidden states per offset, (B, O, T, H): ``[:, i, m]`` predicts the token at m + offsets[i]."""
    batch, length = input_ids.shape
    decoder = model.get_decoder()
    with target_aware(model, offsets, detach_input):
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **cache_kwargs(decoder, cache), use_cache=cache is not None).last_hidden_state  # (B, O·T, H)
    return hidden.view(batch, len(offsets), length, -1)  # (B, O, T, H)


class _Capture(nn.Module):
    """Stands in for the last decoder layer: records the hidden states it is given and passes them on."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.hidden_states = hidden_states
        return hidden_states


@torch.no_grad()
def last_layer_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The trunk's output (B, T, H): the hidden states the last decoder layer reads (the embeddings and every
    layer but the last). Stage 1 trains the last layer alone, so this is computed once per sequence and reused
    (:func:`last_layer_hidden`)."""
    decoder = _decoder(model)
    last, capture = decoder.layers[-1], _Capture()
    decoder.layers[-1] = capture
    try:
        decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        decoder.layers[-1] = last
    return capture.hidden_states  # (B, T, H)


def last_layer_hidden(model, layer_input: torch.Tensor, attention_mask: torch.Tensor, offsets: Sequence[int]
                      ) -> torch.Tensor:
    """:func:`target_aware_hidden` of right-padded sequences from their trunk output ``layer_input`` (B, T, H)
    (:func:`last_layer_inputs`): the target-aware last layer and the final norm only, with the mask and positions
    the full forward builds. (B, O, T, H)."""
    from transformers.masking_utils import create_causal_mask

    decoder = _decoder(model)
    batch, length, _ = layer_input.shape
    position_ids = torch.arange(length, device=layer_input.device)[None]  # (1, T)
    # no cache, given by position: its name is ``cache`` from transformers 5.24, ``past_key_values`` before
    mask = create_causal_mask(decoder.config, layer_input, attention_mask, None, position_ids=position_ids)
    layer = TargetAwareLayer(decoder.layers[-1], decoder.rotary_emb, offsets)
    hidden = layer(layer_input, attention_mask=mask, position_ids=position_ids,
                   position_embeddings=decoder.rotary_emb(layer_input, position_ids))  # (B, O·T, H)
    return decoder.norm(hidden).view(batch, len(offsets), length, -1)  # (B, O, T, H)


def target_aware_logits(model, input_ids: torch.Tensor, offsets: Sequence[int], **kwargs) -> torch.Tensor:
    """Logits per offset, (B, O, T, V): every position at every offset (for tests and small inputs)."""
    return model.get_output_embeddings()(target_aware_hidden(model, input_ids, offsets, **kwargs))


# ---------------------------------------------------------------------------------------------------------
# Corruption (§2.2 "Corruption Strategy"; Appendix D: granularity 4, ratio 0.25)


@dataclass(frozen=True)
class Corruption:
    """A corrupted copy of one sequence."""

    input_ids: torch.Tensor  # (T,) the corrupted ids
    corrupted: torch.Tensor  # (T,) bool: positions whose token was changed (the reconstruction targets)
    patch_size: int  # the granularity drawn for this sequence
    num_patches: int  # response patches of that size
    patches: tuple[tuple[int, int, str], ...]  # (start, length, "replace" | "repeat") of each corrupted patch


def corrupt(input_ids: torch.Tensor, response_start: int, length: int, max_patch_size: int, ratio: float,
            replace_probability: float, generator: torch.Generator) -> Corruption:
    """Corrupt the response ``input_ids[response_start:length]`` patch by patch.

    The response is cut into non-overlapping patches of one size drawn in 1…``max_patch_size``; each patch
    is corrupted with probability ``ratio``: with probability ``replace_probability`` it is replaced by a
    same-length span starting elsewhere in the response, otherwise its first token is repeated over it.
    Only changed tokens count as corrupted (a repeated 1-token patch changes nothing).
    """
    def uniform() -> float:
        return float(torch.rand((), generator=generator))

    ids = input_ids.clone()
    patch_size = int(torch.randint(1, max_patch_size + 1, (), generator=generator))
    starts = list(range(response_start, length, patch_size))
    patches = []
    for start in starts:
        if uniform() >= ratio:
            continue
        size = min(patch_size, length - start)
        sources = [s for s in range(response_start, length - size + 1) if s != start]
        if sources and uniform() < replace_probability:
            source = sources[int(torch.randint(len(sources), (), generator=generator))]
            ids[start : start + size] = input_ids[source : source + size]
            patches.append((start, size, "replace"))
        else:
            ids[start : start + size] = input_ids[start]
            patches.append((start, size, "repeat"))
    return Corruption(ids, ids != input_ids, patch_size, len(starts), tuple(patches))


# ---------------------------------------------------------------------------------------------------------
# Losses (§2.2 "Forward Prediction and Backward Reconstruction")


def offset_targets(input_ids: torch.Tensor, target_mask: torch.Tensor, offsets: Sequence[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """For every (offset, position m): the target id at m + o and whether it counts, both (B, O, T).

    ``target_mask`` (B, T) marks the positions that may be targets (response tokens; corrupted tokens).
    """
    length = input_ids.shape[1]
    positions = torch.arange(length, device=input_ids.device)
    targets, valid = [], []
    for o in offsets:
        target = positions + o  # (T,)
        inside = (target >= 0) & (target < length)
        clamped = target.clamp(0, length - 1)
        targets.append(input_ids[:, clamped])  # (B, T)
        valid.append(target_mask[:, clamped].bool() & inside[None])
    return torch.stack(targets, dim=1), torch.stack(valid, dim=1)  # (B, O, T)


def offset_cross_entropy(hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, valid: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the valid (offset, position) rows only — the LM head never sees the rest.

    hidden (B, O, T, H); targets, valid (B, O, T). Returns the per-offset mean (O,), differentiable (0 where an
    offset has no target), and the per-offset count of targets (O,).
    """
    rows = valid.nonzero(as_tuple=True)
    losses = row_cross_entropy(hidden[rows], lm_head, targets[rows])  # (N,)
    offset_index = rows[1]
    counts = torch.bincount(offset_index, minlength=valid.shape[1]).float()  # (O,)
    sums = torch.zeros(valid.shape[1], device=hidden.device).index_add(0, offset_index, losses)
    return sums / counts.clamp(min=1), counts


LOGIT_ROWS_PER_CHUNK = 1024
"""Rows whose vocabulary logits exist at once: at 8B (V = 128k) a chunk's float32 logits take 0.5 GB."""


def logit_chunks(hidden_rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``hidden_rows`` (N, H) in chunks of at most :data:`LOGIT_ROWS_PER_CHUNK` rows (one, empty, when N = 0)."""
    return hidden_rows.split(LOGIT_ROWS_PER_CHUNK)


def row_cross_entropy(hidden_rows: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy (N,) of each hidden row (N, H) against its target (N,), chunk by chunk.

    With gradients, each chunk is checkpointed: its logits and softmax are freed after the forward and
    recomputed in the backward pass, so N · V float32 logits never exist at once (N is up to B · O · T).
    """
    def chunk_loss(rows: torch.Tensor, chunk_targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(lm_head(rows).float(), chunk_targets, reduction="none")

    losses = [checkpoint(chunk_loss, rows, chunk_targets, use_reentrant=False) if torch.is_grad_enabled()
              else chunk_loss(rows, chunk_targets)
              for rows, chunk_targets in zip(logit_chunks(hidden_rows), targets.split(LOGIT_ROWS_PER_CHUNK),
                                             strict=True)]
    return torch.cat(losses)  # (N,)


def weighted_offset_loss(per_offset: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted mean of the per-offset cross-entropies over the offsets that have targets (0 if none)."""
    weights = weights.to(per_offset) * (counts > 0)
    return (weights * per_offset).sum() / weights.sum().clamp(min=1e-12)


def offset_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, offsets: Sequence[int],
                  layer_input: torch.Tensor | None = None, detach_input: bool = False) -> torch.Tensor:
    """(B, O, T, H) of right-padded sequences: the full target-aware forward, or — given ``layer_input``, the
    trunk's output for these ids (:func:`last_layer_inputs`) — the last layer alone (no gradient below it either
    way when ``detach_input``)."""
    if layer_input is not None:
        return last_layer_hidden(model, layer_input, attention_mask, offsets)
    return target_aware_hidden(model, input_ids, offsets, attention_mask=attention_mask, detach_input=detach_input)


def forward_prediction_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            response_mask: torch.Tensor, offsets: Sequence[int] = FORWARD_OFFSETS,
                            layer_input: torch.Tensor | None = None):
    """Clean sequences: predict the response token at m + o from the context ≤ m, o ∈ ``offsets``. ``layer_input``:
    the trunk's cached output for ``input_ids`` (stage 1), else the full forward runs."""
    hidden = offset_hidden(model, input_ids, attention_mask, offsets, layer_input)  # (B, O, T, H)
    targets, valid = offset_targets(input_ids, response_mask, offsets)
    return offset_cross_entropy(hidden, model.get_output_embeddings(), targets, valid)


def backward_reconstruction_loss(model, corrupted_ids: torch.Tensor, clean_ids: torch.Tensor,
                                 attention_mask: torch.Tensor, corrupted_mask: torch.Tensor,
                                 offsets: Sequence[int] = BACKWARD_OFFSETS, layer_input: torch.Tensor | None = None):
    """Corrupted sequences: reconstruct the clean token at m + o (o ≤ 0) from the corrupted context ≤ m, loss on
    corrupted positions only (like BERT); the gradient stops below the last layer (as in COrAL's code).
    ``layer_input``: the trunk's cached output for ``corrupted_ids`` (stage 1), else the full forward runs."""
    hidden = offset_hidden(model, corrupted_ids, attention_mask, offsets, layer_input,
                           detach_input=True)  # (B, O, T, H)
    targets, valid = offset_targets(clean_ids, corrupted_mask, offsets)
    valid &= attention_mask.bool()[:, None, :]  # the predicting position must be a real token
    return offset_cross_entropy(hidden, model.get_output_embeddings(), targets, valid)
