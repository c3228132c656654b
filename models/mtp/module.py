"""A parameter-sharing multi-token-prediction (MTP) module over a frozen-or-training causal LM, its losses,
and its chained drafts for speculative decoding.

MTP-RL, "Acceleration of Reinforcement Learning Rollouts with Policy-Aligned Multi-Token Prediction"
(docs/mtp.md): §2.1 (the DeepSeek-V3 MTP module and eq. 1's weighted cross-entropy), §3.1
(the MTP-equipped stage: K depths that share ONE set of parameters, embedding and output head shared with
the main model), §3.2 (eq. 2–4, the advantage-aware KL + CE loss used during RL).

The module. Depth k at position i reads the previous depth's state there and the embedding of the token
k positions ahead, h^0 being the main model's final hidden state:

    h'^k_i = Proj([RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i)])      # 2H → H, no bias
    h^k_i  = DecoderLayer(h'^k_{≤i})                                   # causal over positions, RoPE at i
    p^k_i  = softmax(lm_head(final_norm(h^k_i)))                       # predicts t_{i+k+1}

One :class:`MTPModule` owns the projection, the two norms and one decoder layer; it is applied K times.
The embedding, the final norm and the LM head are the main model's, passed in at call time, so they are
never copied into the module's checkpoint and are trained (or not) with the main model.

Drafting (:class:`MTPDrafter`). After the main model has produced the root t_{L} from h^0_{L-1}, depth 1
at position L−1 drafts t_{L+1}, depth 2 (fed that draft) t_{L+2}, … — K chained drafts, one verification.
The decoder layer attends over earlier positions *of its own depth*, so the drafter keeps one KV cache per
depth holding the positions whose inputs are final (depth k: positions ≤ L − k) and recomputes only the
k − 1 positions that still depend on drafts: the drafts equal a teacher-forced forward over the same tokens
(tests compare them). :func:`mtp_generate` plugs it into the speculative loop of :mod:`models.engine.speculative`
with greedy verification (lossless) or speculative sampling (exact in distribution), and can run plain steps
while the drafts do not pay (:class:`models.engine.config.Adaptation`): no depth runs then, and the next draft
catches every depth up over the skipped positions in one forward each. :class:`MTPBatchDrafter` does the same for a
batch of sequences with one forward per depth for all rows (batched rollouts, :mod:`models.engine.batched`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache

from models.common.files import atomic_path
from models.engine.batched import compact_cache, keep_rows, too_much_junk
from models.engine.config import Adaptation
from models.engine.kv_cache import cache_kwargs
from models.engine.speculative import (
    AdaptiveDrafting,
    BonusVerifier,
    Draft,
    SamplingVerifier,
    SpeculativeStats,
    TreeVerifier,
    Verdict,
    chain_tree,
    draw,
    draw_rows,
    prefill,
    root_tree,
    speculative_generate,
    temperature_probs,
    top_tokens,
)
from models.mtp.config import MTPInit


@dataclass(frozen=True)
class MTPModuleConfig:
    """What rebuilds a saved module (the decoder layer's shape comes from the main model's config)."""

    num_depths: int  # K: chained predictions t+2 … t+K+1
    init: MTPInit = "last_layer"

    @classmethod
    def read(cls, folder: Path) -> MTPModuleConfig:
        """The config saved with a module in ``folder``."""
        path = Path(folder) / "mtp.json"
        if not path.is_file():
            raise FileNotFoundError(f"no MTP module in {folder} (mtp.json missing): run the train_mtp stage")
        return cls(**json.loads(path.read_text()))


def causal_additive_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype
                         ) -> torch.Tensor:
    """(1, 1, Q, K) float mask: 0 where the key's position ≤ the query's, dtype-min elsewhere.

    Explicit, because with a KV cache a None mask makes SDPA align its causal triangle top-left (wrong)."""
    allowed = key_positions[None, :] <= query_positions[:, None]  # (Q, K)
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


class MTPModule(nn.Module):
    """One shared MTP block (projection, norms, decoder layer) applied at K depths. See the module docstring."""

    def __init__(self, base, config: MTPModuleConfig):
        super().__init__()
        if config.init not in get_args(MTPInit):
            raise ValueError(f"MTP init must be one of {get_args(MTPInit)}, got {config.init!r}")
        if config.num_depths < 1:
            raise ValueError(f"an MTP module needs at least one depth, got {config.num_depths}")
        self.config = config
        decoder = base.get_decoder()
        last = decoder.layers[-1]
        hidden_size = base.config.hidden_size
        weight = base.get_output_embeddings().weight
        norm_class, eps = type(decoder.norm), getattr(decoder.norm, "variance_epsilon", 1e-6)
        self.embedding_norm = norm_class(hidden_size, eps=eps)
        self.hidden_norm = norm_class(hidden_size, eps=eps)
        self.projection = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        if config.init == "last_layer":
            # Start as the identity on the normed hidden state (like Medusa's zero-initialised heads): the layer is
            # a copy of the main model's last layer with its two output projections zeroed, so it adds nothing
            # yet, and the projection passes the hidden half through. Training then learns the shift by one token
            # with the embedding half. Measured here on ~100 responses: held-out depth-1 top-1 0.47 against 0.10
            # for a projection that sums both halves into an unzeroed layer; a random layer needs far more data.
            self.layer = copy.deepcopy(last)
            with torch.no_grad():
                self.layer.self_attn.o_proj.weight.zero_()
                self.layer.mlp.down_proj.weight.zero_()
                self.projection.weight.copy_(torch.cat([torch.zeros(hidden_size, hidden_size),
                                                        torch.eye(hidden_size)], dim=1))
        else:
            self.layer = type(last)(base.config, layer_idx=0)
        self.layer.self_attn.layer_idx = 0  # its own caches hold one layer
        # the tokens drafts may take (EAGLE-3's draft vocabulary, :func:`frequent_tokens`; None: all), read by
        # :func:`draft_parts`; a plain attribute, not a buffer: it is no trained state
        self.draft_vocab: torch.Tensor | None = None
        self.to(device=weight.device, dtype=weight.dtype)
        self.requires_grad_(True)

    def depth_input(self, base, hidden: torch.Tensor, ahead_tokens: torch.Tensor) -> torch.Tensor:
        """h'^k from h^{k−1} (..., H) and t_{i+k} (...,): the projection of both normed inputs."""
        embedded = base.get_input_embeddings()(ahead_tokens)  # (..., H)
        return self.projection(torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1))

    def layer_forward(self, base, inputs: torch.Tensor, positions: torch.Tensor,
                      cache: DynamicCache | None = None) -> torch.Tensor:
        """The shared decoder layer over (B, Q, H) inputs at ``positions`` (Q,), after any cached positions."""
        past = cache.get_seq_length() if cache is not None else 0
        key_positions = torch.cat([torch.arange(past, device=positions.device), positions])
        mask = causal_additive_mask(positions, key_positions, inputs.dtype)
        return self.layer_step(base, inputs, positions[None], mask, cache)

    def layer_step(self, base, inputs: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                   cache: DynamicCache | None) -> torch.Tensor:
        """The shared decoder layer over (B, Q, H) inputs at ``position_ids`` (B or 1, Q) under the additive ``mask``
        (B or 1, 1, Q, cached + Q); RoPE is applied to the keys it appends to ``cache`` at those positions."""
        rope = base.get_decoder().rotary_emb(inputs, position_ids)
        return self.layer(inputs, attention_mask=mask, position_ids=position_ids, use_cache=cache is not None,
                          position_embeddings=rope, **cache_kwargs(self.layer, cache))

    def forward(self, base, input_ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced states of every depth: K tensors (B, S, H); depth k at i predicts t_{i+k+1}.

        ``hidden`` (B, S, H): the main model's final hidden states of ``input_ids`` (B, S), right-padded
        (padding sits after every real token, so causal attention never lets it reach them). Positions
        whose token t_{i+k} lies past the end read padding and must be masked out of any loss.
        """
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        states, previous = [], hidden
        for k in range(1, self.config.num_depths + 1):
            ahead = F.pad(input_ids[:, k:], (0, k), value=0)  # (B, S): t_{i+k}, 0 past the end
            previous = self.layer_forward(base, self.depth_input(base, previous, ahead), positions)
            states.append(previous)
        return states

    def save(self, folder: Path) -> None:
        """``mtp.safetensors`` + ``mtp.json`` (+ :data:`DRAFT_VOCAB_FILE` with a draft vocabulary), written
        atomically."""
        with atomic_path(Path(folder)) as tmp:
            tmp.mkdir(parents=True)
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, tmp / "mtp.safetensors")
            (tmp / "mtp.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
            if self.draft_vocab is not None:
                save_file({"token_ids": self.draft_vocab.cpu().contiguous()}, tmp / DRAFT_VOCAB_FILE)

    @classmethod
    def load(cls, folder: Path, base) -> MTPModule:
        """A saved module (and its draft vocabulary), on the main model's device and dtype."""
        module = cls(base, MTPModuleConfig.read(folder))
        module.load_state_dict(load_file(Path(folder) / "mtp.safetensors"))
        vocab = Path(folder) / DRAFT_VOCAB_FILE
        module.draft_vocab = load_file(vocab)["token_ids"] if vocab.is_file() else None
        return module


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
"""Beside a saved module's weights: its draft vocabulary's token ids."""


def frequent_tokens(sequences: Sequence[Sequence[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (ties: the lower id), sorted by id: a draft vocabulary
    (EAGLE-3, Li et al. 2025, §3.2; FR-Spec, Zhao et al. 2025)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        counts += torch.bincount(torch.as_tensor(list(sequence), dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    return order[:size].sort().values


def mtp_logits(base, state: torch.Tensor) -> torch.Tensor:
    """The shared head on MTP states: lm_head(final_norm(h)), (..., H) → (..., V)."""
    return base.get_output_embeddings()(base.get_decoder().norm(state))


def vocab_logits(base, state: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """:func:`mtp_logits` restricted to ``vocab``'s tokens (..., V'), in its order; ``vocab`` None: all (..., V)."""
    if vocab is None:
        return mtp_logits(base, state)
    weight = base.get_output_embeddings().weight
    return F.linear(base.get_decoder().norm(state), weight[vocab.to(weight.device)])


def draft_vocab_logits(base, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`mtp_logits` over the draft vocabulary alone when ``base`` (:func:`draft_parts`' copy) has one: the logits
    (..., V') and the vocabulary's token ids (V',); else the whole vocabulary's logits and None. What a drafter that
    ranks candidates reads, without filling V − V' logits with −inf."""
    head = base.get_output_embeddings()
    if isinstance(head, _VocabHead):
        return F.linear(base.get_decoder().norm(state), head.weight), head.vocab
    return mtp_logits(base, state), None


def depth_targets(input_ids: torch.Tensor, target_mask: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth k's targets t_{i+k+1} (B, S) and where they count: the target is a ``target_mask`` token."""
    shift = depth + 1
    targets = F.pad(input_ids[:, shift:], (0, shift), value=0)  # (B, S)
    valid = F.pad(target_mask[:, shift:].bool(), (0, shift), value=False)  # (B, S)
    return targets, valid


def in_vocab(tokens: torch.Tensor, vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's index in ``vocab`` (sorted ids, (V',)) and whether it is there at all (both shaped as
    ``tokens``; the index of a token outside is meaningless)."""
    vocab = vocab.to(tokens.device)
    index = torch.searchsorted(vocab, tokens).clamp(max=len(vocab) - 1)
    return index, vocab[index] == tokens


def mtp_cross_entropy(base, states: Sequence[torch.Tensor], input_ids: torch.Tensor, target_mask: torch.Tensor,
                      depth_weights: Sequence[float], num_targets: Sequence[torch.Tensor | float] | None = None,
                      vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """Eq. 1: Σ_k λ_k · mean over valid positions of −log p^k(t_{i+k+1}). Returns it and each depth's CE.

    ``num_targets``: each depth's number of valid targets over a global batch of which this is one process's
    share (the shares of all processes then sum to the global loss); default: this batch's own counts. A depth
    with no target at all contributes nothing (its CE is NaN).

    ``vocab`` (sorted token ids): the draft vocabulary (:func:`frequent_tokens`). The softmax then runs over its
    tokens alone and targets outside it do not count — a draft can never take them — as EAGLE-3's released
    training does (its ``t2d`` mask). The LM head's matmul and the softmax shrink by V / V' (49,152 / 8,192 for
    SmolLM2): they are most of a training step's time (the one decoder layer is cheap).
    """
    total, per_depth = states[0].new_zeros(()), []
    for k, (state, weight) in enumerate(zip(states, depth_weights, strict=True), start=1):
        targets, valid = depth_targets(input_ids, target_mask, k)
        if vocab is not None:
            targets, known = in_vocab(targets, vocab)
            valid = valid & known
        count = valid.sum() if num_targets is None else num_targets[k - 1]
        if count == 0:
            per_depth.append(float("nan"))
            continue
        ce = F.cross_entropy(vocab_logits(base, state[valid], vocab).float(), targets[valid], reduction="sum") / count
        total = total + weight * ce
        per_depth.append(ce.item())
    return total, per_depth


def advantage_aware_kl(base, states: Sequence[torch.Tensor], main_logits: torch.Tensor, target_mask: torch.Tensor,
                       sample_weights: torch.Tensor, depth_weights: Sequence[float], logits_start: int = 0,
                       num_samples: int | None = None) -> tuple[torch.Tensor, list[float]]:
    """Eq. 3: per sample w_j · (1/S) Σ_i KL(π_main ‖ π_MTP) at the tokens it predicts, averaged over samples
    and summed over depths with λ_k. ``main_logits`` (B, S − logits_start, V): the main model's logits at
    positions ``logits_start`` … S − 1 (position i + k predicts the token depth k predicts from i; only
    positions that predict a ``target_mask`` token are read, so a forward may skip the prompt's logits);
    ``sample_weights`` (B,): w(A_j) of eq. 2. ``num_samples``: the global batch size when this batch is one
    process's share of it (default B).

    The KL sums over the vocabulary; eq. 3's extra 1/V would only rescale the term by ~2e-5 against the CE.
    Returns the loss and each depth's term before λ_k (for the logs).
    """
    total, per_depth = states[0].new_zeros(()), []
    batch = main_logits.shape[0]
    for k, (state, weight) in enumerate(zip(states, depth_weights, strict=True), start=1):
        _, valid = depth_targets(target_mask, target_mask, k)  # (B, S): positions whose target counts
        rows, cols = valid.nonzero(as_tuple=True)
        main_logps = torch.log_softmax(main_logits[rows, cols + k - logits_start].float(), dim=-1)  # (N, V)
        mtp_logps = torch.log_softmax(mtp_logits(base, state[rows, cols]).float(), dim=-1)  # (N, V)
        kl = (main_logps.exp() * (main_logps - mtp_logps)).sum(dim=-1)  # (N,)
        per_sample = torch.zeros(batch, device=kl.device).index_add(0, rows, kl)
        per_sample = per_sample / valid.sum(dim=1).clamp(min=1)  # (B,) token mean per sample
        term = (sample_weights.to(kl.dtype) * per_sample).sum() / (num_samples or batch)
        total = total + weight * term
        per_depth.append(term.item())
    return total, per_depth


def advantage_mask(advantages: torch.Tensor) -> torch.Tensor:
    """Eq. 2: w(A) = 1 where A ≥ 0, else 0."""
    return (advantages >= 0).to(advantages.dtype)


def draft_parts(base, module: MTPModule, dtype: torch.dtype | None = None) -> tuple[nn.Module, MTPModule]:
    """What drafting reads — the main model's embedding, final norm, rotary embedding and LM head, and the MTP
    module — in the drafts' precision and over the module's draft vocabulary: the originals, or copies made once
    per rollout phase.

    Drafts only decide what gets checked (greedy verification) or are corrected exactly (speculative sampling
    uses the very distribution a draft was sampled from), so a cheaper precision or vocabulary never changes what
    comes out; on a CPU with bf16 units bf16 halves the drafts' cost, most of which is reading the LM head. With
    ``module.draft_vocab`` the copy's LM head reads only those rows (8,192 of SmolLM2's 49,152: 0.5 ms against 2.3
    ms per draft on the 2-core CPU) and gives every other token a −inf logit, so no draft takes one and a sampled
    draft's law is zero there.
    """
    vocab = module.draft_vocab
    if dtype is None and vocab is None:
        return base, module
    dtype = dtype or base.get_output_embeddings().weight.dtype
    same = base.get_output_embeddings().weight.dtype == dtype and vocab is None
    drafting_module = module if next(module.parameters()).dtype == dtype else copy.deepcopy(module).to(dtype).eval()
    return (base if same else _DraftHead(base, dtype, vocab)), drafting_module


class PolicyTrail:
    """What an MTP drafter follows of one sequence, and the speculative loop's calls that only follow it
    (:class:`models.engine.speculative.Drafter`'s ``prefill``, ``plain``, ``accept``): the main model's final hidden
    states h^0 of positions 0 … L − 1, the tokens t_1 … t_L (t_L: the root), and per depth k a KV cache and the
    states h^k of the positions whose inputs are final (depth k: positions ≤ L − k), which the drafters fill.

    ``update(hidden, tokens)`` hands over what the main model finalised since the last call: the final hidden
    states of the positions it processed (n, H) and the n tokens that follow them (the last is the new root)."""

    def __init__(self, base, num_depths: int):
        weight = base.get_output_embeddings().weight
        self.dtype = weight.dtype
        self.caches = [DynamicCache() for _ in range(num_depths)]
        empty = weight.new_zeros(0, base.config.hidden_size)
        self.final_states: list[torch.Tensor] = [empty] * num_depths  # h^k of positions with final inputs
        self.hidden = empty  # h^0 of positions 0 … L−1
        self.tokens: list[int] = []  # t_1 … t_L (t_L: the root, not yet run through the main model)

    def prefill(self, model, input_ids: torch.Tensor, cache: DynamicCache, verifier: BonusVerifier) -> list[int]:
        logits, hidden = prefill(model, input_ids, cache)
        root = verifier.choose(logits)
        self.update(hidden, input_ids[0, 1:].tolist() + [root])
        return [root]

    def plain(self) -> Draft:
        # no depth runs now: the next draft brings each depth's cache up to date over the skipped positions
        return Draft(root_tree(), torch.tensor([self.tokens[-1]], device=self.hidden.device))

    def accept(self, draft: Draft, out: tuple[torch.Tensor, torch.Tensor], verdict: Verdict) -> None:
        _, hiddens = out
        self.update(hiddens[verdict.path[: len(verdict.tokens)]], verdict.tokens)

    def update(self, hidden: torch.Tensor, tokens: Sequence[int]) -> None:
        if len(tokens) != len(hidden):
            raise ValueError(f"{len(hidden)} new hidden states but {len(tokens)} new tokens")
        self.hidden = torch.cat([self.hidden, hidden.to(self.dtype)])
        self.tokens += [int(t) for t in tokens]


class MTPDrafter(PolicyTrail):
    """Chained drafts for one sequence, with one KV cache per depth (see the module docstring): the speculative
    loop's drafter (:class:`models.engine.speculative.Drafter`) on a chain of K drafts.

    ``base``/``module``: as :func:`draft_parts` returns them. ``draft_temperature``: 0 = the module's top-1
    tokens; > 0 = drafts drawn from the module at that temperature with ``generator``. After an ``update``
    (:class:`PolicyTrail`), ``draft(choose)`` returns the K draft tokens and their logits (K, V); ``choose(logits
    (V,))`` picks each draft.
    """

    def __init__(self, base, module: MTPModule, draft_temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        super().__init__(base, module.config.num_depths)
        self.base, self.module = base, module
        self.draft_temperature, self.generator = draft_temperature, generator
        self.num_depths = module.config.num_depths
        self.tree = chain_tree(self.num_depths)

    def propose(self, room: int) -> Draft:
        drafts, logits = self.draft(self._choose)
        tokens = torch.tensor([self.tokens[-1], *drafts], device=self.hidden.device)  # (K+1,) the root first
        return Draft(self.tree, tokens, temperature_probs(logits, self.draft_temperature))

    def _choose(self, step_logits: torch.Tensor) -> int:
        """A draft from its logits (V,): the top-1 token at ``draft_temperature`` 0, drawn from no generator (a draw
        from its one-hot law gives the same token), else a draw at that temperature with ``generator``."""
        if self.draft_temperature == 0:
            return int(top_tokens(step_logits))
        return draw(temperature_probs(step_logits, self.draft_temperature), self.generator)

    @torch.no_grad()
    def draft(self, choose) -> tuple[list[int], torch.Tensor]:
        previous, drafts, logits = self.hidden, [], []
        for k in range(1, self.num_depths + 1):
            previous = self.depth_states(k, previous, drafts)
            step_logits = mtp_logits(self.base, previous[-1])  # (V,)
            drafts.append(int(choose(step_logits)))
            logits.append(step_logits)
        return drafts, torch.stack(logits)  # (K, V)

    @torch.no_grad()
    def depth_states(self, k: int, previous: torch.Tensor, drafts: Sequence[int]) -> torch.Tensor:
        """Depth k's states at every position (L, H), from depth k − 1's (``previous``; depth 0: the main model's)
        and the drafts of depths < k; runs only the positions this depth has not cached, and caches those whose
        inputs are final. The last state predicts depth k's draft."""
        length = len(self.hidden)  # L: the root is t_L
        cache, final = self.caches[k - 1], self.final_states[k - 1]
        start = len(final)  # positions before start are cached at this depth
        positions = torch.arange(start, length, device=self.hidden.device)
        # t_{j+k}: a final token up to t_L, a draft beyond
        ahead = torch.tensor([self.tokens[j + k - 1] if j + k <= length else drafts[j + k - length - 1]
                              for j in range(start, length)], dtype=torch.long, device=self.hidden.device)
        inputs = self.module.depth_input(self.base, previous[start:length], ahead)[None]  # (1, Q, H)
        states = self.module.layer_forward(self.base, inputs, positions, cache)[0]  # (Q, H)
        num_final = max(0, length - k + 1 - start)  # depth k's inputs are final up to position L − k
        self.final_states[k - 1] = torch.cat([final, states[:num_final]])
        for layer in cache.layers:  # keep only the final positions' keys and values
            layer.keys = layer.keys[:, :, : start + num_final]
            layer.values = layer.values[:, :, : start + num_final]
        return torch.cat([final, states])  # (L, H)


class BatchPolicyTrail:
    """What an MTP drafter follows of a batch of sequences (:class:`PolicyTrail`'s batch-B counterpart) and the batched
    engine's calls that only follow it (:class:`models.engine.batched.BatchDrafter`'s ``start``, ``accept``,
    ``keep``), in the batched engine's layout (models/engine/batched.py): depth k keeps one KV cache for every row,
    whose row b holds keys of the positions < F_b^k (those whose inputs are final: positions ≤ L_b − k,
    :class:`MTPDrafter`'s bookkeeping) among masked junk columns (a (B, T_k) visibility; keys carry their rotary
    positions, so a column's place never matters). A draft runs at depth k each row's *catch-up* [F_b^k, L_b − k],
    right-aligned and padded on the left (masked, never read), then the positions past L_b − k, which read drafts:
    their keys are cut off the cache after the forward, the catch-up's become visible. Depth k + 1's catch-up reads
    depth k's states at [F_b^{k+1}, L_b − k − 1]: this draft's, plus at most one final state of the last draft
    (F^{k+1} ≥ F^k − 1), kept per depth as its ``tails``. The main model's states since the last draft wait
    right-aligned in ``pending``."""

    def __init__(self, base, num_depths: int):
        self.base, self.num_depths = base, num_depths
        self.dtype = base.get_output_embeddings().weight.dtype

    def start(self, prompts: Sequence[Sequence[int]], hidden: torch.Tensor, roots: torch.Tensor) -> None:
        batch, device = len(prompts), hidden.device
        self.tokens = [[*prompt[1:], root] for prompt, root in zip(prompts, roots.tolist(), strict=True)]
        self.lengths = [len(prompt) for prompt in prompts]  # L_b: positions with the main model's final state
        self.final = [[0] * batch for _ in range(self.num_depths)]  # F_b^k: positions cached at depth k
        self.caches = [DynamicCache() for _ in range(self.num_depths)]
        self.visible = [torch.zeros(batch, 0, dtype=torch.bool, device=device) for _ in range(self.num_depths)]
        hidden_size = hidden.shape[-1]
        self.tails = [torch.zeros(batch, hidden_size, dtype=self.dtype, device=device)
                      for _ in range(self.num_depths - 1)]  # depth k's final state at F_b^{k+1} (< F_b^k)
        self.pending = _append_right_aligned(hidden.new_zeros(batch, 0, hidden_size, dtype=self.dtype),
                                             [0] * batch, hidden.to(self.dtype), self.lengths)

    def _with_tails(self, states: torch.Tensor, count: Sequence[int], tail: torch.Tensor, behind: Sequence[int]
                    ) -> torch.Tensor:
        """(B, Q + 1, H): ``states`` (B, Q, H), row b's last ``count[b]`` real, with ``tail`` (B, H) in the column just
        before them where ``behind[b]`` (F_b^{k−1} − F_b^k) is 1."""
        width = states.shape[1]
        states = F.pad(states, (0, 0, 1, 0))  # (B, Q + 1, H)
        where = [width - n if d else -1 for n, d in zip(count, behind, strict=True)]
        put = torch.arange(width + 1, device=states.device)[None] == torch.tensor(where, device=states.device)[:, None]
        return torch.where(put[..., None], tail[:, None], states)

    def _final_tokens(self, width: int, device) -> torch.Tensor:
        """(B, max(width, 0)): each row's last ``width`` final tokens, up to its root (0 before its first)."""
        final = [[row[i] if i >= 0 else 0 for i in range(len(row) - width, len(row))] for row in self.tokens]
        return torch.tensor(final, dtype=torch.long, device=device).reshape(len(self.tokens), max(0, width))

    def _keep_final(self, k: int, kept: int, counts: Sequence[int]) -> None:
        """After depth k's forward: keep only the first ``kept`` new columns of its cache (the catch-up; the columns
        after it read drafts), mark each row's last ``counts[b]`` of them visible (the rest is padding), and move the
        visible keys together when junk piles up."""
        cache, visible = self.caches[k - 1], self.visible[k - 1]
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, : visible.shape[1] + kept]
            layer.values = layer.values[:, :, : visible.shape[1] + kept]
        columns = torch.arange(kept, device=visible.device)
        added = columns[None] >= kept - torch.tensor(counts, device=visible.device)[:, None]  # (B, kept)
        visible = torch.cat([visible, added], dim=1)
        longest = max(f + n for f, n in zip(self.final[k - 1], counts, strict=True))
        if too_much_junk(visible.shape[1], longest):
            visible = compact_cache(cache, visible)
        self.visible[k - 1] = visible

    def accept(self, hidden: torch.Tensor, tokens: Sequence[Sequence[int]]) -> None:
        waiting = [n - f for n, f in zip(self.lengths, self.final[0], strict=True)]
        self.pending = _append_right_aligned(self.pending, waiting, hidden.to(self.dtype), [len(t) for t in tokens])
        for row, new in zip(self.tokens, tokens, strict=True):
            row += new
        self.lengths = [n + len(new) for n, new in zip(self.lengths, tokens, strict=True)]

    def keep(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        self.tokens = [self.tokens[i] for i in kept]
        self.lengths = [self.lengths[i] for i in kept]
        self.final = [[final[i] for i in kept] for final in self.final]
        self.pending = self.pending[rows]
        self.tails = [tail[rows] for tail in self.tails]
        self.visible = [visible[rows] for visible in self.visible]
        for cache in self.caches:
            keep_rows(cache, rows)


def right_aligned_causal(count: Sequence[int], width: int, device) -> torch.Tensor:
    """(B, W, W) bool: which of a forward's new columns each column sees, row b's last ``count[b]`` of ``width``
    real — a real column sees the real ones up to itself; a padding column sees itself alone (its state is never
    read, and a query that sees nothing would give NaN)."""
    columns = torch.arange(width, device=device)
    first = width - torch.tensor(count, device=device)  # (B,) each row's first real column
    return (columns[None, None, :] <= columns[None, :, None]) & (
        (columns[None, None, :] >= first[:, None, None]) | torch.eye(width, dtype=torch.bool, device=device))


def cached_additive_mask(visible: torch.Tensor, new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, Q, T + Q) additive mask: every query sees the ``visible`` (B, T) cached keys of its row, and the new
    keys ``new`` (B, Q, Q) says."""
    keys = torch.cat([visible[:, None, :].expand(-1, new.shape[1], -1), new], dim=2)  # (B, Q, T + Q)
    return torch.where(keys, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


class MTPBatchDrafter(BatchPolicyTrail):
    """:class:`MTPDrafter` for a batch of sequences (:class:`models.engine.batched.BatchDrafter`): each depth runs the
    shared layer ONCE for the whole batch, its LM head once, and draws every row's draft in one
    :func:`~models.engine.speculative.draw_rows` (each prompt's own generator, as at batch 1), with no host sync —
    K forwards per draft, not B × K. ``generators``: each prompt's, drawing its drafts at ``draft_temperature``
    (None: the default generator). Top-1 drafts (``draft_temperature`` 0) are the argmax, drawn from no generator, as
    :class:`MTPDrafter`'s: a draw from their one-hot law gives the same token, after V exponential draws per row
    (measured at batch 16 over the 49,152-token vocabulary: 17 % of a chain's decoding time).

    The layout is :class:`BatchPolicyTrail`'s. A draft runs, at depth k, the positions [F_b^k, L_b) of every row,
    *right-aligned* in Q_k = max_b (L_b − F_b^k) columns: the last column is every row's position L_b − 1 (its
    draft's), the last k − 1 columns read the same draft tokens in every row (positions past L_b − k), and rows with
    fewer positions are padded on the left.
    """

    def __init__(self, base, module: MTPModule, draft_temperature: float = 0.0,
                 generators: Sequence[torch.Generator | None] | None = None):
        super().__init__(base, module.config.num_depths)
        self.module, self.draft_temperature = module, draft_temperature
        self.given_generators = generators
        self.tree = chain_tree(self.num_depths)

    def start(self, prompts: Sequence[Sequence[int]], hidden: torch.Tensor, roots: torch.Tensor) -> None:
        super().start(prompts, hidden, roots)
        self.generators = list(self.given_generators or [None] * len(prompts))

    @torch.no_grad()
    def propose(self, roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device, lengths = self.pending.device, self.lengths
        batch = len(lengths)
        # every depth's positions to run (Q_b^k = L_b − F_b^k) and its finals after this draft, on the host
        counts = [[n - f for n, f in zip(lengths, final, strict=True)] for final in self.final]
        finals = [[f + max(0, q - k + 1) for f, q in zip(final, count, strict=True)]
                  for k, (final, count) in enumerate(zip(self.final, counts, strict=True), start=1)]
        states, drafts, logits, tails = self.pending, [], [], []  # states: depth k − 1's, right-aligned
        for k in range(1, self.num_depths + 1):
            count = counts[k - 1]
            if k > 1:  # depth k − 1's states of this draft, preceded where needed by its tail of the last draft
                states = self._with_tails(states, counts[k - 2], self.tails[k - 2],
                                          [a - b for a, b in zip(self.final[k - 2], self.final[k - 1], strict=True)])
            width = max(count)
            states = states[:, states.shape[1] - width:]  # (B, Q_k, H)
            ahead = self._ahead_tokens(k, width, drafts, device)  # (B, Q_k): t_{j+k}
            columns = torch.arange(width, device=device)
            positions = (torch.tensor(lengths, device=device)[:, None] - width + columns).clamp(min=0)  # (B, Q_k)
            inputs = self.module.depth_input(self.base, states, ahead)  # (B, Q_k, H)
            mask = self._mask(k, count, width, inputs.dtype)
            states = self.module.layer_step(self.base, inputs, positions, mask, self.caches[k - 1])  # (B, Q_k, H)
            self._keep_final(k, max(0, width - k + 1), [max(0, q - k + 1) for q in count])
            if k < self.num_depths:  # depth k's state at F_b^{k+1} after this draft, the next draft's tail
                tail_columns = [width - n + f - 1 for n, f in zip(lengths, finals[k - 1], strict=True)]
                tails.append(states[torch.arange(batch, device=device),
                                    torch.tensor(tail_columns, device=device).clamp(min=0)])
            step_logits = mtp_logits(self.base, states[:, -1])  # (B, V) every row's last position
            drafts.append(top_tokens(step_logits) if self.draft_temperature == 0
                          else draw_rows(temperature_probs(step_logits, self.draft_temperature), self.generators))
            logits.append(step_logits)
        self.final, self.tails = finals, tails
        self.pending = self.pending[:, :0]
        tokens = torch.cat([roots[:, None], torch.stack(drafts, dim=1).to(roots.device)], dim=1)  # (B, K+1)
        return tokens, temperature_probs(torch.stack(logits, dim=1), self.draft_temperature)  # (B, K, V)

    def _ahead_tokens(self, k: int, width: int, drafts: Sequence[torch.Tensor], device) -> torch.Tensor:
        """(B, Q_k): t_{j+k} at each right-aligned column (position j = L_b − Q_k + c): the row's final tokens up to
        its root, then the drafts of depths < k in the last k − 1 columns (0 in padding columns)."""
        known = width - k + 1  # columns whose token is final (position ≤ L_b − k)
        drafted = drafts[max(0, -known):]  # the drafts these columns read (with few columns, not the earliest)
        return torch.cat([self._final_tokens(known, device)] + [d[:, None].to(device) for d in drafted], dim=1)

    def _mask(self, k: int, count: Sequence[int], width: int, dtype: torch.dtype) -> torch.Tensor:
        """(B, 1, Q_k, T_k + Q_k) additive: a row's real columns see its visible cached keys and its real columns up
        to themselves; padding columns see themselves too (their states are never read)."""
        new = right_aligned_causal(count, width, self.visible[k - 1].device)
        return cached_additive_mask(self.visible[k - 1], new, dtype)

    def keep(self, rows: torch.Tensor) -> None:
        super().keep(rows)
        self.generators = [self.generators[i] for i in rows.tolist()]


def _append_right_aligned(old: torch.Tensor, old_counts: Sequence[int], new: torch.Tensor, new_counts: Sequence[int]
                          ) -> torch.Tensor:
    """(B, W, H) right-aligned: row b's last ``old_counts[b]`` states of ``old`` (B, W_o, H, right-aligned), then the
    first ``new_counts[b]`` of ``new`` (B, W_n, H, left-aligned); W the longest row, shorter rows padded on the left
    (with any state: padding is never read)."""
    width = max(o + n for o, n in zip(old_counts, new_counts, strict=True))
    old_width = old.shape[1]
    index = [[0] * (width - o - n) + list(range(old_width - o, old_width)) + list(range(old_width, old_width + n))
             for o, n in zip(old_counts, new_counts, strict=True)]
    index = torch.tensor(index, device=old.device)[..., None].expand(-1, -1, old.shape[-1])  # (B, W, H)
    return torch.cat([old, new], dim=1).gather(1, index)


def mtp_generate(model, draft_base, module: MTPModule, input_ids: torch.Tensor, max_new_tokens: int,
                 eos_token_ids: set[int], temperature: float = 0.0, generator: torch.Generator | None = None,
                 stats: SpeculativeStats | None = None, draft_temperature: float = 0.0,
                 adaptation: Adaptation | AdaptiveDrafting | None = None) -> list[int]:
    """Decode one prompt (1, L) with K chained MTP drafts and one verification forward per cycle.

    ``temperature`` 0: greedy verification — output identical to greedy decoding. ``temperature`` > 0:
    speculative sampling — output distributed exactly as sampling from the model at that temperature (no
    top-k / top-p), whatever the drafts. ``draft_temperature``: 0 = the MTP module's top-1 tokens (as MTP-RL
    drafts; under sampling a draft then passes with probability p(draft)); > 0 = drafts sampled from the
    module at that temperature (they pass with probability Σ min(p, q)). ``draft_base``/``module``:
    :func:`draft_parts`. ``adaptation``: draft only while the drafts pay for themselves (plain steps otherwise,
    :class:`models.engine.config.Adaptation`, or its state carried across prompts,
    :class:`models.engine.speculative.AdaptiveDrafting`); the output stays as exact. Stops after an end token or
    ``max_new_tokens`` tokens; returns the new tokens.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    verifier = TreeVerifier() if temperature == 0 else SamplingVerifier(temperature, generator)
    drafter = MTPDrafter(draft_base, module, draft_temperature, generator)
    tokens, _ = speculative_generate(model, drafter, verifier, input_ids, max_new_tokens, eos_token_ids, stats,
                                     adaptation=adaptation)
    return tokens


class _DraftHead(nn.Module):
    """The parts of the main model that :class:`MTPModule` reads, copied in another precision, the LM head over the
    draft vocabulary only where one is given."""

    def __init__(self, base, dtype: torch.dtype, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        self.config = base.config
        embedding, lm_head = base.get_input_embeddings(), base.get_output_embeddings()
        self.embedding = copy.deepcopy(embedding).to(dtype)
        if draft_vocab is not None:
            self.lm_head = _VocabHead(lm_head.weight, draft_vocab, dtype)
        else:
            self.lm_head = copy.deepcopy(lm_head).to(dtype)
            if embedding.weight is lm_head.weight:  # tied: one copy
                self.embedding.weight = self.lm_head.weight
        decoder = base.get_decoder()
        self.decoder = _DraftDecoder(copy.deepcopy(decoder.norm).to(dtype), decoder.rotary_emb)

    def get_input_embeddings(self):
        return self.embedding

    def get_output_embeddings(self):
        return self.lm_head

    def get_decoder(self):
        return self.decoder


class _VocabHead(nn.Module):
    """An LM head that reads only the rows of ``vocab`` (V',) and returns logits over the whole vocabulary (..., V),
    −inf outside ``vocab``."""

    def __init__(self, weight: torch.Tensor, vocab: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.register_buffer("vocab", vocab.to(weight.device, torch.long))
        self.weight = nn.Parameter(weight.detach()[self.vocab].to(dtype), requires_grad=False)  # (V', H)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # (..., V')
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))  # (..., V)
        return full.index_copy_(-1, self.vocab, logits)


@dataclass
class _DraftDecoder:
    norm: nn.Module
    rotary_emb: nn.Module
