"""The tree speculative-decoding engine (models/engine/speculative.py) on hand-built trees and a tiny random Llama.

References: hand-worked tree structures; a no-cache full forward per tree path (tree attention must
give every node exactly the logits of its own path); a plain forward over the accepted tokens (cache
gathering); HF greedy ``generate`` token for token (losslessness).
"""

from __future__ import annotations

from types import SimpleNamespace

import statistics

import pytest
import torch
from transformers import DynamicCache

from models.engine.config import Adaptation, TypicalAcceptance
from models.engine.kv_cache import cache_kwargs
from models.engine.speculative import (
    AdaptiveDrafting,
    Draft,
    SamplingVerifier,
    SpeculativeStats,
    TreeDrafter,
    TreeVerifier,
    Verdict,
    _parents,
    build_tree,
    chain_tree,
    draw,
    keep_accepted,
    likeliest_paths,
    root_tree,
    sparse_tree,
    speculative_cache,
    speculative_generate,
    speculative_stream,
    tree_attention_inputs,
    tree_candidates,
    tree_forward,
    verify_greedy,
    verify_speculative_sampling,
    verify_typical,
)
from tests.helpers import CHOICES, assert_agrees_up_to_ties, bf16_tiny, chi_square_p, hf_greedy, perturbed_module
from tests.tiny import load_spiky_tiny_llama, sliding_model

QUESTIONS = ["Ben has 4 apples. How many?", "Ivy has 3 cookies and gives 1 to Omar.", "0 1 2 3", "What is 7 * 8?"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """(model, prompt ids) on the tiny Llama with spiky weights (with default weights it repeats one token,
    and every drafter would look perfect)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = load_spiky_tiny_llama(tiny_llama)
    prompts = [tok(q, return_tensors="pt").input_ids for q in QUESTIONS]
    return model, prompts


def test_build_tree_on_a_hand_built_tree():
    tree = build_tree(CHOICES)
    # nodes: 0 root, 1 (0,), 2 (1,), 3 (0,0), 4 (0,1), 5 (1,0), 6 (0,0,0)
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert _parents(tree).tolist() == [-1, 0, 0, 1, 1, 2, 3]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, path in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}.items():
        expected[node, path] = True
    assert torch.equal(tree.ancestors, expected)
    assert tree.paths.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]  # leaves (0,1), (1,0), (0,0,0)
    assert (tree.depth, tree.size, tree.top_k()) == (3, 7, 2)


def test_build_tree_adds_missing_prefixes_and_rejects_bad_choices():
    assert build_tree([(0, 0, 1)]).choices == ((0,), (0, 0), (0, 0, 1))
    assert chain_tree(3).choices == ((0,), (0, 0), (0, 0, 0))
    for bad in ([], [()], [(0, -1)]):
        with pytest.raises(ValueError, match="tree"):
            build_tree(bad)


def test_sparse_tree_takes_the_likeliest_paths_first():
    rank_accuracy = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]]
    # path probabilities: (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (2,) .1, (1,0) .1, (0,2) .06, ...
    assert sparse_tree(rank_accuracy, 4) == [(0,), (0, 0), (1,), (0, 1)]
    assert sparse_tree(rank_accuracy, 1) == [(0,)]
    everything = sparse_tree(rank_accuracy, 100)
    assert len(everything) == 3 + 9 and len(set(everything)) == 12
    assert build_tree(everything).size == 13  # prefix-closed: nothing had to be added
    with pytest.raises(ValueError, match="at least one node"):
        sparse_tree(rank_accuracy, 0)


def test_likeliest_paths_measures_acceptance_jointly_along_a_path():
    # the right token's rank per position at depths +1 and +2; 9 = not among the top 3
    target_ranks = torch.tensor([[0, 0], [0, 0], [1, 9], [9, 9]])
    # jointly, (0, 0) is accepted wherever (0,) is: 2 of 4 positions; the product of per-depth accuracies
    # (sparse_tree's estimate) says 0.5 × 0.5 = 0.25, a tie with (1,)
    assert likeliest_paths(target_ranks, num_ranks=3, count=3) == [((0,), 0.5), ((0, 0), 0.5), ((1,), 0.25)]
    assert sparse_tree([[0.5, 0.25, 0.0], [0.5, 0.0, 0.0]], 3) == [(0,), (0, 0), (1,)]
    assert likeliest_paths(target_ranks, num_ranks=3, count=1) == [((0,), 0.5)]
    # paths never accepted are left out: (1, r) and (2,) have no position
    assert likeliest_paths(target_ranks, num_ranks=3, count=10) == [((0,), 0.5), ((0, 0), 0.5), ((1,), 0.25)]
    # a rank at or past num_ranks is a miss, whatever its value
    assert likeliest_paths(torch.tensor([[2, 0], [5, 0]]), num_ranks=2, count=5) == []
    with pytest.raises(ValueError, match="at least one node"):
        likeliest_paths(target_ranks, num_ranks=3, count=0)


def test_position_ids_and_additive_mask():
    tree = build_tree(CHOICES)
    position_ids, mask = tree_attention_inputs(tree, past_length=5, dtype=torch.float32, device=torch.device("cpu"))
    assert position_ids.tolist() == [[5, 6, 6, 7, 7, 7, 8]]
    assert mask.shape == (1, 1, 7, 12) and mask.dtype == torch.float32
    assert (mask[0, 0, :, :5] == 0).all()  # every node sees the whole prefix
    blocked = torch.finfo(torch.float32).min
    assert torch.equal(mask[0, 0, :, 5:] == 0, tree.ancestors)
    assert (mask[0, 0, :, 5:][~tree.ancestors] == blocked).all()


def test_tree_candidates_read_each_depths_ranked_drafts():
    tree = build_tree(CHOICES)
    draft_logits = torch.tensor([[0.0, 5.0, 1.0, 3.0],  # depth 1: ranks → tokens 1, 3
                                 [4.0, 0.0, 6.0, 1.0],  # depth 2: 2, 0
                                 [0.0, 0.0, 0.0, 9.0]])  # depth 3: 3
    tokens = tree_candidates(7, draft_logits, tree)
    assert tokens.tolist() == [7, 1, 3, 2, 0, 2, 3]
    with pytest.raises(ValueError, match="3 deep"):
        tree_candidates(7, draft_logits[:2], tree)


def _one_hot_logits(predictions: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(predictions), vocab)
    logits[torch.arange(len(predictions)), torch.tensor(predictions)] = 10.0
    return logits


def test_verify_greedy_picks_the_longest_accepted_path():
    tree = build_tree(CHOICES)
    tokens = torch.tensor([7, 1, 3, 2, 0, 2, 3])
    # argmax after each node: root→3 (node 2 matches), node 2→2 (node 5 matches), node 1→2 (node 3 matches),
    # node 3→5 (node 6 does not match)
    predictions = [3, 2, 2, 5, 0, 4, 0]
    assert verify_greedy(tokens, _one_hot_logits(predictions), tree) == [0, 2, 5]
    predictions = [1, 2, 4, 3, 0, 4, 0]  # root→1 (node 1), node 1→2 (node 3), node 3→3 (node 6): depth 3 wins
    assert verify_greedy(tokens, _one_hot_logits(predictions), tree) == [0, 1, 3, 6]
    predictions = [6, 2, 2, 3, 0, 2, 0]  # nothing after the root matches
    assert verify_greedy(tokens, _one_hot_logits(predictions), tree) == [0]


def test_typical_acceptance_takes_a_likely_non_argmax_token():
    tree = chain_tree(1)
    tokens = torch.tensor([0, 2])
    logits = torch.log(torch.tensor([[0.05, 0.55, 0.40, 0.0], [0.25, 0.25, 0.25, 0.25]]).clamp_min(1e-9))
    assert verify_greedy(tokens, logits, tree) == [0]  # token 2 is not the argmax (1 is)
    assert verify_typical(tokens, logits, tree, TypicalAcceptance(typical_threshold=0.09)) == [0, 1]
    assert verify_typical(tokens, logits, tree, TypicalAcceptance(typical_threshold=0.5, typical_alpha=1.0)) == [0]


TREE_TOKENS = torch.tensor([5, 17, 42, 9, 77, 120, 3])


def _tree_step(model, prefix: torch.Tensor):
    """Prefill ``prefix`` (1, L), then one tree forward of TREE_TOKENS on CHOICES: (tree, cache, logits, hidden)."""
    tree = build_tree(CHOICES)
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, **cache_kwargs(model, cache), use_cache=True)
    logits, hidden = tree_forward(model, TREE_TOKENS, tree, cache)
    return tree, cache, logits, hidden


@torch.no_grad()
def test_tree_forward_matches_a_full_forward_of_each_path(tiny):
    model, prompts = tiny
    prefix, tokens = prompts[0], TREE_TOKENS
    tree, cache, logits, hidden = _tree_step(model, prefix)
    assert logits.shape == (7, model.config.vocab_size) and hidden.shape == (7, model.config.hidden_size)
    assert cache.get_seq_length() == prefix.shape[1] + 7
    for node in range(7):
        path = tree.ancestors[node].nonzero().flatten()  # ancestors in node order = root-to-node order
        full = model(input_ids=torch.cat([prefix[0], tokens[path]])[None], output_hidden_states=True)
        torch.testing.assert_close(logits[node], full.logits[0, -1], rtol=0, atol=1e-5)
        torch.testing.assert_close(hidden[node], full.hidden_states[-1][0, -1], rtol=0, atol=1e-5)


@torch.no_grad()
def test_keep_accepted_leaves_the_cache_of_the_accepted_path(tiny):
    model, prompts = tiny
    prefix, tokens = prompts[1], TREE_TOKENS
    _, cache, _, _ = _tree_step(model, prefix)
    accepted = [0, 2, 5]  # a path that is not a prefix of the tree's node order: cropping would be wrong
    keep_accepted(cache, prefix.shape[1], accepted)
    reference = DynamicCache(config=model.config)
    model(input_ids=torch.cat([prefix[0], tokens[accepted]])[None], **cache_kwargs(model, reference), use_cache=True)
    assert cache.get_seq_length() == reference.get_seq_length() == prefix.shape[1] + 3
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-5)


class NoisyOracle:
    """A drafter that knows the greedy continuation and proposes it at rank 0 (60 %), rank 1 (25 %) or
    not at all (15 %): the engine must accept exactly the right tokens and reject the rest."""

    def __init__(self, reference: list[int], stats: SpeculativeStats, vocab: int, depth: int, seed: int):
        self.reference, self.stats, self.vocab, self.depth = reference, stats, vocab, depth
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        done = self.stats.generated_tokens  # tokens yielded so far, the root included
        logits = torch.randn(self.depth, self.vocab, generator=self.gen)
        for d in range(self.depth):
            if done + d < len(self.reference):
                u = torch.rand((), generator=self.gen).item()
                token = self.reference[done + d]
                logits[d, token] = 100.0 if u < 0.6 else (logits[d].max() - 1e-3 if u < 0.85 else -100.0)
        return logits


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@torch.no_grad()
def test_speculative_decoding_is_lossless(tiny, tiny_llama, attn_implementation):
    _, prompts = tiny
    model = load_spiky_tiny_llama(tiny_llama, attn_implementation=attn_implementation)
    tree = build_tree(CHOICES)
    accepted_something = False
    for i, ids in enumerate(prompts):
        for eos, max_new_tokens in ((set(), 40), ({7, 11, 13}, 40), (set(), 5)):
            reference = hf_greedy(model, ids, max_new_tokens, eos)
            stats = SpeculativeStats()
            oracle = NoisyOracle(reference, stats, model.config.vocab_size, tree.depth, seed=i)
            steps = list(speculative_stream(model, TreeDrafter(tree, oracle), TreeVerifier(), ids, max_new_tokens, eos,
                                            stats))
            assert [t for step in steps for t in step] == reference, (i, eos, max_new_tokens)
            assert stats.generated_tokens == len(reference)
            assert sum(stats.accepted_lengths) == len(reference) - 1  # the prefill's token, then each tree forward's
            accepted_something |= max(stats.accepted_lengths, default=1) > 1
            # a useless drafter is just as lossless (every step gains the root alone)
            noise = torch.Generator().manual_seed(i)
            noisy = TreeDrafter(tree, lambda h, r: torch.randn(3, model.config.vocab_size, generator=noise))
            tokens, plain = speculative_generate(model, noisy, TreeVerifier(), ids, max_new_tokens, eos)
            assert tokens == reference
    assert accepted_something  # the test exercised multi-token acceptance


@torch.no_grad()
def test_mean_accepted_length_counts_tokens_per_forward(tiny):
    model, prompts = tiny
    reference = hf_greedy(model, prompts[2], 30, set())
    stats = SpeculativeStats()
    chain = chain_tree(3)

    def always_right(hidden, root):
        done = stats.generated_tokens
        logits = torch.zeros(3, model.config.vocab_size)
        for d in range(3):
            if done + d < len(reference):
                logits[d, reference[done + d]] = 1.0
        return logits

    tokens = [t for step in speculative_stream(model, TreeDrafter(chain, always_right), TreeVerifier(), prompts[2], 30,
                                               set(), stats) for t in step]
    assert tokens == reference
    # 1 prefill token, then 4 tokens (3 drafts + the bonus) per tree forward: 1 + 4·7 = 29, one more step for the 30th
    assert stats.accepted_lengths == [4] * 7 + [1]
    assert stats.forwards == 9 and stats.mean_accepted_length == pytest.approx(30 / 9)


def test_typical_acceptance_accepts_whatever_greedy_accepts():
    """An argmax always passes the typical threshold (max p ≥ e^(−H) > α·e^(−H)), so on the same tree forward the
    typical path is never shorter than the greedy one."""
    tree = build_tree(CHOICES)
    parents = _parents(tree).clamp(min=0)
    gen = torch.Generator().manual_seed(0)
    rule = TypicalAcceptance()
    longer = 0
    for _ in range(200):
        logits = torch.randn(tree.size, 16, generator=gen) * 3
        tokens = torch.randint(0, 16, (tree.size,), generator=gen)
        copy_argmax = torch.rand(tree.size, generator=gen) < 0.6
        tokens = torch.where(copy_argmax, logits.argmax(-1)[parents], tokens)
        greedy, typical = verify_greedy(tokens, logits, tree), verify_typical(tokens, logits, tree, rule)
        assert len(typical) >= len(greedy)
        longer += len(typical) > len(greedy)
    assert longer > 0  # and it does accept non-argmax tokens


@torch.no_grad()
def test_typical_acceptance_decodes_end_to_end(tiny):
    """Against one plain forward over prompt + output: every emitted token is typical under the model's distribution
    at its position (p > min(ε, α·e^(−H)); the argmax always is), and each one that is not greedy's is an accepted
    draft (a bonus token is the argmax) — and there is one, so the run is not greedy decoding. The counters, by
    hand: the prefill's forward and token, then one forward per cycle offering the tree's 6 drafts."""
    model, prompts = tiny
    rule = TypicalAcceptance()
    noise = torch.Generator().manual_seed(0)
    noisy = TreeDrafter(build_tree(CHOICES), lambda h, r: torch.randn(3, model.config.vocab_size, generator=noise))
    tokens, stats = speculative_generate(model, noisy, TreeVerifier(rule), prompts[0], 20, set())
    assert len(tokens) == 20
    start = prompts[0].shape[1] - 1
    logits = model(torch.cat([prompts[0], torch.tensor([tokens])], dim=1)).logits[0, start:-1]  # (20, V)
    probs = torch.softmax(logits.float() / rule.typical_temperature, dim=-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
    threshold = torch.minimum(torch.full_like(entropy, rule.typical_threshold),
                              rule.typical_alpha * torch.exp(-entropy))
    assert (probs[torch.arange(20), torch.tensor(tokens)] > threshold).all()
    not_greedy = int((logits.argmax(dim=-1) != torch.tensor(tokens)).sum())
    assert 0 < not_greedy <= stats.accepted_drafts
    cycles = len(stats.accepted_lengths)
    assert stats.forwards == 1 + cycles and sum(stats.accepted_lengths) == 20 - 1
    assert stats.drafted_tokens == 6 * cycles and stats.accepted_drafts == 20 - 1 - cycles


def test_batched_input_is_refused(tiny):
    model, prompts = tiny
    with pytest.raises(ValueError, match="one prompt at a time"):
        speculative_generate(model, TreeDrafter(chain_tree(2), lambda h, r: torch.zeros(3, 8)), TreeVerifier(),
                             prompts[0].repeat(2, 1), 4, set())


# ---------------------------------------------------------------------------------------------------------
# sliding-window attention (Mistral: every layer; Qwen2 / Gemma style: mixed with full-attention layers)

SLIDING_PROMPT = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("kind", "attn_implementation"),
                         [("mistral", "sdpa"), ("mistral", "eager"), ("mixed", "sdpa")])
@torch.no_grad()
def test_speculative_decoding_is_lossless_beyond_a_sliding_window(kind, attn_implementation):
    """The defect: the cache kept keys/values by absolute index, but a sliding-window layer holds only its last
    window − 1 positions and counts its length apart (``cumulative_length``) — the tree forward crashed on the
    mask's width, and a cache cut to the tree's nodes would have lost the window's oldest keys. Now a prompt of
    9 and 30 new tokens, window 6: token for token plain greedy decoding, with multi-token steps."""
    model = sliding_model(kind, attn_implementation)
    tree = build_tree(CHOICES)
    reference = hf_greedy(model, SLIDING_PROMPT, 30, set())
    stats = SpeculativeStats()
    oracle = NoisyOracle(reference, stats, model.config.vocab_size, tree.depth, seed=0)
    tokens = [t for step in speculative_stream(model, TreeDrafter(tree, oracle), TreeVerifier(), SLIDING_PROMPT, 30,
                                               set(), stats) for t in step]
    assert tokens == reference and len(set(reference)) > 5  # not one token repeated
    assert max(stats.accepted_lengths) > 1
    # plain steps keep the window's cache as they found it (nothing to gather, the window still cut back)
    noise = torch.Generator().manual_seed(0)
    drafter = TreeDrafter(tree, lambda h, r: torch.randn(3, model.config.vocab_size, generator=noise))
    adaptive, stats = speculative_generate(model, drafter, TreeVerifier(), SLIDING_PROMPT, 30, set(),
                                           adaptation=Adaptation(window=2, probe_every=4, cycle_cost=1.5))
    assert adaptive == reference and stats.plain_forwards > 10


@pytest.mark.parametrize("kind", ["mistral", "mixed"])
@torch.no_grad()
def test_keep_accepted_leaves_a_sliding_window_cache_as_a_plain_forward_would(kind):
    """After a tree forward past the window, each layer holds what a plain forward of prefix + accepted path
    leaves: the full layer every position, the sliding layer the last window − 1 and the true length."""
    model = sliding_model(kind)
    cache = speculative_cache(model)
    model(input_ids=SLIDING_PROMPT, **cache_kwargs(model, cache), use_cache=True)
    tree_forward(model, TREE_TOKENS % 64, build_tree(CHOICES), cache)
    accepted = [0, 2, 5]
    keep_accepted(cache, SLIDING_PROMPT.shape[1], accepted)
    reference = DynamicCache(config=model.config)
    model(input_ids=torch.cat([SLIDING_PROMPT[0], TREE_TOKENS[accepted] % 64])[None],
          **cache_kwargs(model, reference), use_cache=True)
    assert [layer.is_sliding for layer in cache.layers] == ([True, True] if kind == "mistral" else [True, False])
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        assert mine.get_seq_length() == theirs.get_seq_length() == SLIDING_PROMPT.shape[1] + 3
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-5)


def test_a_sliding_window_mask_blocks_keys_a_window_back():
    """Node at depth d (position past + d) sees prefix positions > past + d − window: the oldest kept
    prefix keys drop out one per depth."""
    tree = chain_tree(3)
    _, mask = tree_attention_inputs(tree, past_length=20, dtype=torch.float32, device=torch.device("cpu"),
                                    window=4, kept_prefix=3)  # keys: positions 17, 18, 19, then the 4 nodes
    assert (mask[0, 0] == 0).tolist() == [
        [True, True, True, True, False, False, False],
        [False, True, True, True, True, False, False],
        [False, False, True, True, True, True, False],
        [False, False, False, True, True, True, True],
    ]


# ---------------------------------------------------------------------------------------------------------
# devices and dtypes: bf16 on the CPU here, bf16 on the GPU where one is visible


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@torch.no_grad()
def test_tree_decoding_of_a_bfloat16_policy(tiny, tiny_llama, device):
    """A bf16 policy (on the GPU under cuda) with drafts made on the CPU: tokens, masks and verification follow
    the model's device and dtype; greedy tree decoding agrees with greedy decoding up to bf16 near-ties."""
    _, prompts = tiny
    model = bf16_tiny(tiny_llama, device)
    tree = build_tree(CHOICES)
    for i, ids in enumerate(prompts[:2]):
        ids = ids.to(device)
        reference = hf_greedy(model, ids, 30, set())
        stats = SpeculativeStats()
        oracle = NoisyOracle(reference, stats, model.config.vocab_size, tree.depth, seed=i)  # CPU logits
        tokens, _ = speculative_generate(model, TreeDrafter(tree, oracle), TreeVerifier(), ids, 30, set(), stats)
        assert len(tokens) == 30
        assert_agrees_up_to_ties(model, ids, tokens, reference)
        assert max(stats.accepted_lengths) > 1


class OneHotChain(TreeDrafter):
    """A chain drafter that states its drafts' law (one-hot: top-1 drafts), on the CPU, for speculative sampling."""

    def propose(self, room: int) -> Draft:
        draft = super().propose(room)
        probs = torch.nn.functional.one_hot(draft.tokens[1:].cpu(), self.vocab).float()  # (D, V)
        return Draft(draft.tree, draft.tokens, probs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@torch.no_grad()
def test_speculative_sampling_of_a_bfloat16_policy(tiny, tiny_llama, device):
    """SamplingVerifier on a bf16 policy with a generator on the model's device (a CUDA generator under cuda) and
    the drafts' law on the CPU: seeded runs repeat, and every token is in the vocabulary."""
    _, prompts = tiny
    model = bf16_tiny(tiny_llama, device)
    ids = prompts[0].to(device)
    vocab = model.config.vocab_size

    def run(seed: int) -> tuple[list[int], SpeculativeStats]:
        drafts = torch.Generator().manual_seed(seed)
        drafter = OneHotChain(chain_tree(3), lambda h, r: torch.randn(3, vocab, generator=drafts))
        drafter.vocab = vocab
        verifier = SamplingVerifier(0.8, torch.Generator(device=device).manual_seed(seed))
        return speculative_generate(model, drafter, verifier, ids, 24, set())

    tokens, stats = run(0)
    assert len(tokens) == 24 and all(0 <= t < vocab for t in tokens) and stats.drafted_tokens > 0
    assert run(0)[0] == tokens and run(1)[0] != tokens


def test_a_generator_on_another_device_is_refused_naming_the_fix():
    probs = torch.full((8,), 1 / 8, device="meta")
    with pytest.raises(ValueError, match=r"torch.Generator\(device='meta'\)"):
        draw(probs, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="generator is on cpu"):
        verify_speculative_sampling([1], torch.zeros(1, 8), torch.full((2, 8), 1 / 8, device="meta"),
                                    torch.Generator())


# ---------------------------------------------------------------------------------------------------------
# the adaptive loop: draft only while it pays (models.engine.config.Adaptation)


class Scripted:
    """Draft logits that are exactly right (the greedy continuation at rank 0 at every depth) at the positions
    ``right(done)`` says, and never right elsewhere (random, the right token pushed to the bottom); counts calls."""

    def __init__(self, reference: list[int], stats: SpeculativeStats, vocab: int, depth: int, right, seed: int = 0):
        self.reference, self.stats, self.vocab, self.depth, self.right = reference, stats, vocab, depth, right
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0
        self.at: list[int] = []  # tokens out when each draft was asked for

    def __call__(self, hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        self.calls += 1
        done = self.stats.generated_tokens  # tokens out so far, the root included
        self.at.append(done)
        logits = torch.randn(self.depth, self.vocab, generator=self.gen)
        for d in range(min(self.depth, len(self.reference) - done)):
            logits[d, self.reference[done + d]] = 100.0 if self.right(done) else -100.0
        return logits


@pytest.mark.parametrize(("right_from", "depth", "lengths", "plain"), [
    # useless drafts: 4 cycles of 1 token (τ 1 < c 1.5) → 8 plain steps, a probe that fails (gap doubles to 16),
    # 16 plain, a probe (gap 32), the last 9 plain
    (None, 3, [1] * 6, 33),
    # right from the 20th token on: the probe at 13 still fails and doubles the gap, the one at 30 gains 4 →
    # τ = (1+1+1+4)/4 = 1.75 ≥ c: drafting resumes and stays (the last cycle is cut at 40 tokens)
    (20, 3, [1, 1, 1, 1, 1, 4, 4, 2], 24),
    # always right: never a plain step
    (0, 3, [4] * 9 + [3], 0),
])
@torch.no_grad()
def test_adaptive_decoding_falls_back_probes_and_resumes_losslessly(tiny, right_from, depth, lengths, plain):
    """Hand-worked decisions of the rule (window 4, first probe after 8 plain tokens, c = 1.5 plain steps) on a prompt
    of 40 greedy tokens: the output is greedy's, token for token, and the drafter is called once per cycle only (a
    plain step runs no drafter)."""
    model, prompts = tiny
    adaptation = Adaptation(window=4, probe_every=8, cycle_cost=1.5)
    for ids in prompts:
        reference = hf_greedy(model, ids, 40, set())
        stats = SpeculativeStats()
        drafts = Scripted(reference, stats, model.config.vocab_size, depth,
                          lambda done: right_from is not None and done >= right_from)
        tokens, _ = speculative_generate(model, TreeDrafter(chain_tree(depth), drafts), TreeVerifier(), ids, 40, set(),
                                         stats, adaptation=adaptation)
        assert tokens == reference
        assert stats.accepted_lengths == lengths and stats.plain_forwards == plain
        assert drafts.calls == len(lengths)
        assert stats.forwards == 1 + len(lengths) + plain and stats.generated_tokens == 40
        assert stats.drafted_tokens == depth * len(lengths)  # τ and α count the cycles only


@torch.no_grad()
def test_a_drafting_state_carries_its_decisions_to_the_next_prompt(tiny):
    """Useless drafts (c = 1.5): decided afresh, each 40-token prompt pays for 4 cycles and 2 probes again (as in the
    hand-worked case above); with one AdaptiveDrafting for both, the second prompt keeps the first's window and gap:
    it opens with one probe, which fails (the gap doubles to 64), then 38 plain tokens."""
    model, prompts = tiny
    adaptation = Adaptation(window=4, probe_every=8, cycle_cost=1.5)
    drafting = AdaptiveDrafting(adaptation)
    for ids in prompts[:2]:
        reference = hf_greedy(model, ids, 40, set())
        runs = {}
        for name, state in (("fresh", adaptation), ("carried", drafting)):
            stats = SpeculativeStats()
            drafts = Scripted(reference, stats, model.config.vocab_size, 3, lambda done: False)
            tokens, _ = speculative_generate(model, TreeDrafter(chain_tree(3), drafts), TreeVerifier(), ids, 40, set(),
                                             stats, adaptation=state)
            assert tokens == reference
            runs[name] = (stats.accepted_lengths, stats.plain_forwards, drafts.at)
        assert runs["fresh"][:2] == ([1] * 6, 33)
        first = ids is prompts[0]
        assert runs["carried"] == (([1] * 6, 33, runs["fresh"][2]) if first else ([1], 38, [1]))
    assert drafting.gap == 64 and not drafting.paying


@torch.no_grad()
def test_a_prompt_after_one_where_drafting_did_not_pay_opens_with_a_probe(tiny):
    """Drafts useless on the first prompt and always right on the second (one drafting state, c = 1.5): the second
    prompt's first step probes, gains 4, τ = (1 + 1 + 1 + 4) / 4 ≥ c, and it drafts all the way, as a fresh state
    would, instead of waiting out the gap of 32 the first prompt left."""
    model, prompts = tiny
    drafting = AdaptiveDrafting(Adaptation(window=4, probe_every=8, cycle_cost=1.5))
    for ids, right in ((prompts[0], False), (prompts[1], True)):
        reference = hf_greedy(model, ids, 40, set())
        stats = SpeculativeStats()
        drafts = Scripted(reference, stats, model.config.vocab_size, 3, lambda done, right=right: right)
        tokens, _ = speculative_generate(model, TreeDrafter(chain_tree(3), drafts), TreeVerifier(), ids, 40, set(),
                                         stats, adaptation=drafting)
        assert tokens == reference
    assert stats.accepted_lengths == [4] * 9 + [3] and stats.plain_forwards == 0 and drafts.at[0] == 1


def test_the_first_decision_comes_early_and_then_tau_averages_the_whole_window():
    """c = 1.5 (configured, so no clock): four cycles gaining 1 token stop a fresh state (first_decision 4); in the
    steady state four such cycles after four that gained 4 do not (τ over the window of 8 is 2.5), a fifth does not
    either (2.125), and only when the window holds mostly poor cycles does it stop."""
    drafting = AdaptiveDrafting(Adaptation(window=8, first_decision=4, cycle_cost=1.5))
    for _ in range(4):
        assert drafting.paying
        drafting.record(True, 1, 0.0)
    assert not drafting.paying and drafting.drafts() is False
    drafting = AdaptiveDrafting(Adaptation(window=8, first_decision=4, cycle_cost=1.5))
    for gain in (4, 4, 4, 4, 1, 1, 1, 1, 1):
        drafting.record(True, gain, 0.0)
        assert drafting.paying
    for paying in (True, False):  # the window: 4, 4, 1 × 6 → 1.75; then 4, 1 × 7 → 1.375
        drafting.record(True, 1, 0.0)
        assert drafting.paying is paying
    with pytest.raises(ValueError, match="first_decision"):
        Adaptation(first_decision=0)


@pytest.mark.parametrize("margin", [0.0, 0.1])
def test_a_measured_cost_needs_the_margin_a_configured_one_does_not(margin):
    """A plain step of 1 s and cycles of 1.5 s measure c = 1.5; cycles gaining 2, 1, 2, 1 tokens (τ = 1.5) pay only
    without the margin (1.5 < 1.5 · 1.1). With c configured as 1.5 the same gains pay whatever the margin."""
    measured = AdaptiveDrafting(Adaptation(window=4, first_decision=4, margin=margin))
    measured.record(False, 1, 1.0)
    for gain in (2, 1, 2, 1):
        measured.record(True, gain, 1.5)
    assert measured.tau() == 1.5 and measured.cost() == 1.5
    assert measured.paying is (margin == 0.0)
    configured = AdaptiveDrafting(Adaptation(window=4, first_decision=4, cycle_cost=1.5, margin=margin))
    for gain in (2, 1, 2, 1):
        configured.record(True, gain, 0.0)
    assert configured.paying


def test_a_measured_cost_is_never_below_one_plain_step():
    """One slow plain step (2 s) timed, cycles of 1 s: the ratio 0.5 is a timing artefact (a cycle runs the plain
    step's forward and more), so c = 1 and cycles that accept nothing (τ = 1 < 1 · 1.1) stop drafting, where c = 0.5
    would have kept them going. Cycles gaining 2 still pay (2 ≥ 1.1)."""
    for gain, paying in ((1, False), (2, True)):
        drafting = AdaptiveDrafting(Adaptation(window=4, first_decision=4))
        drafting.record(False, 1, 2.0)
        for _ in range(4):
            drafting.record(True, gain, 1.0)
        assert drafting.cost() == 1.0 and drafting.paying is paying


def test_a_paying_drafter_re_times_a_plain_step_every_plain_every_cycles():
    """A measured c whose only plain sample was slow (3 s against cycles of 2 s: c = 1) lets cycles gaining 1.5 pay
    (1.5 ≥ 1.1); after ``plain_every`` (4) cycles the next step is plain and timed (1 s): c = 2 / median(3, 1) = 1
    still, so drafting goes on, and after four more cycles a third plain step of 1 s makes c = 2: the same gains stop.
    A configured c never re-times."""
    drafting = AdaptiveDrafting(Adaptation(window=8, first_decision=4, plain_every=4))
    assert drafting.drafts() is False  # the first step is plain, to time one
    drafting.record(False, 1, 3.0)
    steps = []
    for _ in range(10):
        drafts = drafting.drafts()
        steps.append(drafts)
        drafting.record(drafts, 1.5 if drafts else 1, 2.0 if drafts else 1.0)
    assert steps == [True] * 4 + [False] + [True] * 4 + [False]  # plain, timed, after every four cycles
    assert list(drafting.plain_seconds) == [(1, 3.0), (1, 1.0), (1, 1.0)] and drafting.cost() == 2.0
    drafting.record(True, 1.5, 2.0)
    assert not drafting.paying
    configured = AdaptiveDrafting(Adaptation(window=8, first_decision=4, plain_every=4, cycle_cost=1.0))
    for _ in range(12):
        assert configured.drafts()
        configured.record(True, 1.5, 0.0)


def test_tau_counts_tokens_per_row_so_a_batchs_last_row_weighs_as_one_row():
    """c = 2.9 (configured). Seven cycles of 16 rows gaining 48 tokens (3 per row), then one of the last row alone
    gaining 1: per row over the window τ = (7 · 48 + 1) / (7 · 16 + 1) = 337 / 113 ≈ 2.98 ≥ 2.9, drafting pays; the
    mean of the cycles' per-row gains, (7 · 3 + 1) / 8 = 2.75, would have stopped it. Then six more cycles of that row
    gaining 1 each leave one 16-row cycle in the window: τ = (48 + 7) / (16 + 7) ≈ 2.39, it stops; the next batch's
    first cycle, 16 rows gaining 4 each, brings τ to (64 + 7) / (16 + 7) ≈ 3.09: it pays again, at once."""
    drafting = AdaptiveDrafting(Adaptation(window=8, first_decision=4, cycle_cost=2.9))
    for _ in range(7):
        drafting.record(True, 48, 0.0, rows=16)
    drafting.record(True, 1, 0.0, rows=1)
    assert drafting.tau() == pytest.approx(337 / 113) and drafting.paying
    for _ in range(6):
        drafting.record(True, 1, 0.0, rows=1)
    assert drafting.tau() == pytest.approx(55 / 23) and not drafting.paying
    drafting.record(True, 64, 0.0, rows=16)
    assert drafting.tau() == pytest.approx(71 / 23) and drafting.paying


def test_a_measured_cost_compares_a_cycle_with_a_plain_step_of_as_many_rows():
    """Plain steps timed at 1 row (20 ms, three of them) and at 16 rows (30 ms); cycles at 16 rows take 90 ms: c =
    90 / 30 = 3, and cycles gaining 3.5 tokens per row pay (3.5 ≥ 3 · 1.1). Against the median of every plain step
    (20 ms) c would be 4.5 and they would not. A cycle at 3 rows (40 ms) reads the plain step of the nearest row count
    measured, 1 row: 40 / 20 = 2; at 9 rows, as near 1 as 16, the larger: 16 rows."""
    drafting = AdaptiveDrafting(Adaptation(window=8, first_decision=4))
    for rows, seconds in ((1, 0.020), (1, 0.020), (1, 0.020), (16, 0.030)):
        drafting.record(False, rows, seconds, rows=rows)
    for _ in range(4):
        drafting.record(True, 3.5 * 16, 0.090, rows=16)
    assert drafting.cost() == pytest.approx(3.0) and drafting.paying
    assert drafting.plain_step_seconds(3) == 0.020 and drafting.plain_step_seconds(9) == 0.030
    assert drafting.plain_steps == 0 and drafting.drafts()


def _ticks(stats: SpeculativeStats, drafts: Scripted):
    """A clock that ticks 1 per model forward and 3 per draft."""
    return lambda: stats.forwards + 3 * drafts.calls


@torch.no_grad()
def test_a_measured_cycle_cost_decides_from_the_clock(tiny):
    """c measured from the run's own step times, on a clock that ticks 1 per model forward and 3 per draft (a cycle
    costs 4 plain steps): the first step is plain (it times one); a perfect 3-deep chain gains 4 per cycle and keeps
    drafting, a perfect 1-deep chain gains 2 and falls back to plain steps, probing after 8 plain tokens, then 16.
    No margin: τ = c = 4 is the tie it decides (the margin: test_a_measured_cost_needs_the_margin_…)."""
    model, prompts = tiny
    ids = prompts[0]
    reference = hf_greedy(model, ids, 40, set())
    adaptation = Adaptation(window=4, probe_every=8, margin=0.0)
    for depth, lengths, plain in ((3, [4] * 9 + [2], 1), (1, [2] * 6, 27)):
        stats = SpeculativeStats()
        drafts = Scripted(reference, stats, model.config.vocab_size, depth, lambda done: True)
        tokens, _ = speculative_generate(model, TreeDrafter(chain_tree(depth), drafts), TreeVerifier(), ids, 40, set(),
                                         stats, adaptation=adaptation, clock=_ticks(stats, drafts))
        assert tokens == reference
        assert stats.accepted_lengths == lengths and stats.plain_forwards == plain


@torch.no_grad()
def test_adaptive_medusa_decoding_equals_greedy_and_skips_the_heads(tiny):
    """Real Medusa heads, made useless at random: the adaptive decoder gives HF greedy's tokens (as the plain engine
    does), mostly in plain steps, and its heads run once per draft cycle — never in a plain step."""
    from models.medusa.heads import MedusaDrafter, heads_for

    model, prompts = tiny
    heads = heads_for(model, num_heads=3)
    gen = torch.Generator().manual_seed(0)
    for p in heads.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen))
    tree = build_tree(CHOICES)
    calls = []
    for ids in prompts:
        reference = hf_greedy(model, ids, 32, set())
        plain_engine, _ = speculative_generate(model, MedusaDrafter(model, heads, tree), TreeVerifier(), ids, 32, set())
        drafter = MedusaDrafter(model, heads, tree)
        calls.clear()
        drafter.heads.register_forward_hook(lambda *_: calls.append(1))
        tokens, stats = speculative_generate(model, drafter, TreeVerifier(), ids, 32, set(),
                                             adaptation=Adaptation(window=2, probe_every=4, cycle_cost=1.5))
        assert tokens == plain_engine == reference
        assert stats.plain_forwards > len(stats.accepted_lengths) and len(calls) == len(stats.accepted_lengths)


@torch.no_grad()
def test_adaptive_mtp_decoding_equals_greedy_and_drafts_as_if_it_never_paused(tiny):
    """MTP's chained drafter across plain steps: greedy's tokens, the shared layer runs K times per cycle and never in
    a plain step, and each cycle's draft logits equal those the always-drafting engine computes at the same output
    length (the depth caches catch up on the skipped positions exactly)."""
    from models.mtp.module import MTPDrafter, mtp_generate

    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.05)

    class Recording(MTPDrafter):
        def draft(self, choose):
            drafts, logits = super().draft(choose)
            self.seen[len(self.tokens)] = logits
            return drafts, logits

    def run(adaptation):
        drafter = Recording(model, module)
        drafter.seen = {}
        stats = SpeculativeStats()
        tokens, _ = speculative_generate(model, drafter, TreeVerifier(), ids, 32, set(), stats, adaptation=adaptation)
        return tokens, stats, drafter.seen

    compared = paused = 0
    calls = []
    hook = module.layer.register_forward_hook(lambda *_: calls.append(1))
    for ids in prompts:
        reference = hf_greedy(model, ids, 32, set())
        always, _, always_seen = run(None)
        calls.clear()
        tokens, stats, seen = run(Adaptation(window=2, probe_every=3, cycle_cost=2.5))
        assert tokens == always == reference
        assert len(calls) == 3 * len(stats.accepted_lengths)
        assert mtp_generate(model, model, module, ids, 32, set(), adaptation=Adaptation(cycle_cost=2.5)) == reference
        paused += stats.plain_forwards
        for length in seen.keys() & always_seen.keys():
            torch.testing.assert_close(seen[length], always_seen[length], atol=2e-4, rtol=1e-4)
            compared += 1
    hook.remove()
    assert paused > 0 and compared > len(prompts)  # drafts after plain steps were compared


V = 5
_TARGET = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 1.5, dim=-1)  # p(next | last)
_DRAFTS = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 1.5, dim=-1)  # q(next | last)


_CHAIN = chain_tree(2)


def _bigram_forward(model, tokens: torch.Tensor, tree, cache):
    """A bigram "model": the logits after each node depend on its token alone."""
    return _TARGET[tokens].log(), tokens[:, None].float()


class BigramChain:
    """Two chained drafts sampled from the bigram q (their law stated), and plain steps, for speculative sampling."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def prefill(self, model, input_ids, cache, verifier):
        self.root = verifier.choose(_TARGET[int(input_ids[0, -1])].log())
        return [self.root]

    def propose(self, room: int) -> Draft:
        drafts, laws, last = [], [], self.root
        for _ in range(2):
            laws.append(_DRAFTS[last])
            last = draw(laws[-1], self.generator)
            drafts.append(last)
        return Draft(_CHAIN, torch.tensor([self.root, *drafts]), torch.stack(laws))

    def plain(self) -> Draft:
        return Draft(root_tree(), torch.tensor([self.root]))

    def accept(self, draft, out, verdict) -> None:
        self.root = verdict.tokens[-1]


class Gullible(SamplingVerifier):
    """The negative control: takes every draft as it comes (then the model's bonus token)."""

    def __call__(self, draft, out):
        if draft.tree.size == 1:
            return super().__call__(draft, out)
        drafts = draft.tokens[1:].tolist()
        return Verdict(list(range(len(drafts) + 1)), [*drafts, self.choose(out[0][-1])])


@torch.no_grad()
def test_adaptive_speculative_sampling_samples_the_model_exactly():
    """Speculative sampling whose every next step is decided by the last cycle's acceptance (window 1, c = 2.5: a
    cycle that did not accept both drafts is followed by a plain step, then a probe): on a bigram model the law of
    each of the 5 output tokens, and of tokens 3–4 jointly, is exactly the model's (p's powers), with drafts from a
    very different q. Taking every draft (the negative control) fails the same test."""
    from transformers import LlamaConfig


    model = SimpleNamespace(config=LlamaConfig(vocab_size=V, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                               num_attention_heads=1), device=torch.device("cpu"))
    prompt = torch.tensor([[0]])
    adaptation = Adaptation(window=1, probe_every=1, cycle_cost=2.5)
    exact = [torch.linalg.matrix_power(_TARGET, k)[0] for k in range(1, 6)]  # law of the k-th output token
    joint = exact[2][:, None] * _TARGET  # (token 3, token 4)
    draws = 2000

    def sample(verifier_class) -> tuple[torch.Tensor, SpeculativeStats]:
        gen, stats = torch.Generator().manual_seed(0), SpeculativeStats()
        outputs = [speculative_generate(model, BigramChain(gen), verifier_class(1.0, gen), prompt, 5, set(), stats,
                                        _bigram_forward, adaptation)[0] for _ in range(draws)]
        return torch.tensor(outputs), stats

    def p_values(outputs: torch.Tensor) -> list[float]:
        laws = [chi_square_p(dict(enumerate(torch.bincount(outputs[:, k], minlength=V).tolist())),
                             {v: float(exact[k][v]) for v in range(V)}, draws) for k in range(5)]
        pairs = torch.bincount(outputs[:, 2] * V + outputs[:, 3], minlength=V * V).tolist()
        return [*laws, chi_square_p(dict(enumerate(pairs)), dict(enumerate(joint.flatten().tolist())), draws)]

    outputs, stats = sample(SamplingVerifier)
    assert outputs.shape == (draws, 5)
    assert stats.plain_forwards > 0 and 0 < stats.accepted_drafts < stats.drafted_tokens  # every kind of step ran
    assert min(p_values(outputs)) > 1e-3
    assert min(p_values(sample(Gullible)[0])[1:]) < 1e-6


def test_adaptation_is_refused_without_plain_steps_and_checks_its_settings(tiny):
    model, prompts = tiny
    with pytest.raises(TypeError, match="has no plain"):
        speculative_generate(model, object(), TreeVerifier(), prompts[0], 4, set(), adaptation=Adaptation())
    for bad in ({"window": 0}, {"probe_every": 0}, {"cycle_cost": 0.0}, {"probe_every": 16, "max_probe_every": 8}):
        with pytest.raises(ValueError):
            Adaptation(**bad)


def test_verification_costs_time_each_width_interleaved_and_take_the_median(tiny):
    """On the tiny Llama with a scripted clock: one warm-up round (dropped), then rounds of every width in turn; each
    width's cost is the median of its rounds' times."""
    from models.engine.speculative import verification_costs

    model, _ = tiny
    # per (round, width) forward: the elapsed seconds the clock shows; round 0 is the warm-up
    elapsed = [100.0, 100.0, 1.0, 5.0, 3.0, 9.0, 2.0, 7.0]  # widths (1, 4) × rounds 0 … 3
    ticks = iter([t for e in elapsed for t in (0.0, e)])
    costs = verification_costs(model, [1, 4], context_length=12, repeats=3, clock=lambda: next(ticks))
    assert costs == {1: 2.0, 4: 7.0}
    assert next(ticks, None) is None  # every forward timed, none more
    real = verification_costs(model, [1, 2, 8], context_length=5, repeats=2)
    assert list(real) == [1, 2, 8] and all(seconds > 0 for seconds in real.values())
    with pytest.raises(ValueError, match="≥ 1"):
        verification_costs(model, [0, 4], context_length=5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_verification_costs_of_a_bfloat16_policy(tiny_llama, device):
    """The prefill and the timed forwards run on the model's device, in its dtype (CUDA synchronised by the clock)."""
    from models.engine.speculative import verification_costs

    costs = verification_costs(bf16_tiny(tiny_llama, device), [1, 16], context_length=9, repeats=1)
    assert list(costs) == [1, 16] and all(seconds > 0 for seconds in costs.values())


def test_the_budget_context_is_the_median_prompt_plus_half_a_response():
    from models.engine.speculative import budget_context

    assert budget_context([3, 5, 10, 20], 64) == 7 + 32  # median 7.5, truncated
    assert budget_context([9], 5) == 9 + 2


def test_top_tokens_is_the_argmax_first_on_ties():
    """:func:`top_tokens` (``max``, fast on bf16 CPU logits) picks what ``argmax`` picks, the first index on a tie, in
    every dtype the policy may decode in; logits with few distinct values make ties common."""
    from models.engine.speculative import top_tokens

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = torch.randint(0, 4, (16, 3, 512), generator=generator).to(dtype)  # (B, N+1, V)
        assert torch.equal(top_tokens(logits), logits.argmax(dim=-1)), dtype
        assert int(top_tokens(logits[0, 0])) == int(logits[0, 0].argmax())
        assert (logits == logits.amax(dim=-1, keepdim=True)).sum(dim=-1).gt(1).any()  # ties were there to break
