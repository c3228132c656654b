"""Speculative sampling on a tree of deterministic candidates (models/engine/speculative.py: verify_tree_sampling,
TreeSamplingVerifier).

References: the model's own law, by Pearson's χ² (seeded): the first emitted token ~ p at the root, the second ~ p
at the child the first one reached; the same test applied to deliberately wrong variants of the rule — acceptance
not renormalised after a rejection, the fallback drawn from the unmodified p, a repeated sibling token's mass not
removed — must reject them, which proves it has power; the rule walked step by step in plain Python (SpecInfer §4
with point-mass drafts), seed for seed; the chain verifier with one-hot drafts, seed for seed; the next-token laws
of a plain forward of a tiny random Llama, end to end through ``speculative_generate``.
"""

from __future__ import annotations

import pytest
import torch

from models.engine.batched import BatchSampling
from models.engine.speculative import (
    Draft,
    SamplingVerifier,
    SpeculativeStats,
    TreeDrafter,
    TreeSamplingVerifier,
    _parents,
    build_tree,
    chain_tree,
    root_tree,
    speculative_generate,
    temperature_probs,
    verify_speculative_sampling,
    verify_tree_sampling,
)
from tests.helpers import bf16_tiny, chi_square_p
from tests.tiny import load_spiky_tiny_llama

V = 6

# root ─┬─ (0,) ─┬─ (0,0)        nodes: 0 root, 1 (0,), 2 (1,), 3 (2,), 4 (0,0), 5 (0,1), 6 (1,0)
#       │        └─ (0,1)
#       ├─ (1,) ── (1,0)
#       └─ (2,)
TREE = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
# a fixed law after each node; the candidates are each parent's top-k tokens in rank order, as a top-k drafter's
PROBS = torch.softmax(torch.randn(TREE.size, V, generator=torch.Generator().manual_seed(3)) * 1.2, dim=-1)
TOKENS = torch.tensor([0, *[int(PROBS[p].argsort(descending=True)[r])
                            for p, r in zip(_parents(TREE)[1:].tolist(), TREE.ranks[1:].tolist(), strict=True)]])

# The same tree with the root's two first candidates one token (one top-k never repeats a token; a tree merged from
# several drafters can): the second copy's subtree must never be reached, and the law must not change.
REPEATED = TOKENS.clone()
REPEATED[2] = REPEATED[1]


def walk(tokens: torch.Tensor, probs: torch.Tensor, tree, generator: torch.Generator,
         mistake: str | None = None) -> tuple[list[int], int]:
    """The rule step by step as SpecInfer (§4) states it for point-mass drafts: at the current node with law p, child x
    passes with probability p(x) / Σ p; a rejected x gets p(x) = 0; with no pass, the next token is drawn from p.
    Draws like :func:`verify_tree_sampling`: a uniform per non-root node up front, then one draw.

    ``mistake`` (the negative controls): ``"no renormalising"`` passes x with the node's original p(x);
    ``"fallback from p"`` draws the fallback from the unmodified p; ``"repeat kept"`` reads each x's p from the
    unmodified p (a repeated token's second copy gets its mass back)."""
    parents, candidates = _parents(tree).tolist(), tokens.tolist()
    uniforms = torch.rand(tree.size - 1, generator=generator, device=probs.device).tolist()
    node, path = 0, [0]
    while True:
        p = probs[node].clone()
        for child in (c for c in range(tree.size) if parents[c] == node):
            x = candidates[child]
            mass = probs[node, x] if mistake == "repeat kept" else p[x]
            chance = probs[node, x] if mistake == "no renormalising" else mass / p.sum()
            if uniforms[child - 1] < chance:
                node = child
                path.append(child)
                break
            p[x] = 0.0
        else:
            law = probs[node] if mistake == "fallback from p" else p
            return path, int(torch.multinomial(law, 1, generator=generator))


def sample(verify, tokens: torch.Tensor, draws: int, seed: int = 0,
           device: str = "cpu") -> list[tuple[list[int], list[int]]]:
    """``draws`` verdicts (path, emitted tokens) of ``verify`` on the hand-built tree, one seeded generator; the
    laws and the generator on ``device``."""
    generator, probs = torch.Generator(device=device).manual_seed(seed), PROBS.to(device)
    verdicts = []
    for _ in range(draws):
        path, token = verify(tokens, probs, TREE, generator)
        verdicts.append((path, tokens[path[1:]].tolist() + [token]))
    return verdicts


def p_values(verdicts: list[tuple[list[int], list[int]]], tokens: torch.Tensor) -> tuple[float, float]:
    """χ² p-values of the first emitted token against p at the root, and of the first two jointly, given that the
    first reached a root child with children (then the second is a draw at that child), against p_root(x) · p_x(y)."""
    draws = len(verdicts)
    first = torch.bincount(torch.tensor([emitted[0] for _, emitted in verdicts]), minlength=V).tolist()
    first_p = chi_square_p(dict(enumerate(first)), dict(enumerate(PROBS[0].tolist())), draws)
    parents = _parents(TREE).tolist()
    # the root's children with children of their own; of a repeated token, its first copy (the one that can pass)
    inner = [c for c in range(1, TREE.size) if parents[c] == 0 and c in parents and int(tokens[c]) not in tokens[1:c]]
    pairs: dict[tuple[int, int], int] = {}
    for path, emitted in verdicts:
        if len(path) > 1 and path[1] in inner:
            pairs[emitted[0], emitted[1]] = pairs.get((emitted[0], emitted[1]), 0) + 1
    reach = sum(float(PROBS[0, tokens[c]]) for c in inner)
    joint = {(int(tokens[c]), y): float(PROBS[0, tokens[c]] * PROBS[c, y]) / reach for c in inner for y in range(V)}
    return first_p, chi_square_p(pairs, joint, sum(pairs.values()))


def test_the_tree_emits_the_models_law():
    """6,000 verdicts on a depth-2 tree of top-k candidates: the first token follows p at the root and the first two
    jointly follow the model's law, with every kind of step seen (fallback at the root, at a depth-1 node, at a
    leaf)."""
    verdicts = sample(verify_tree_sampling, TOKENS, 6000)
    assert min(p_values(verdicts, TOKENS)) > 1e-3
    ends = {path[-1] for path, _ in verdicts}
    assert {0, 1, 2, 3, 4, 5, 6} <= ends  # rejected at the root, at an inner node, at a leaf reached


@pytest.mark.parametrize("mistake", ["no renormalising", "fallback from p"])
def test_the_same_test_rejects_the_classic_mistakes(mistake):
    """The negative controls: passing a later sibling with its unrenormalised p(x) under-samples it; drawing the
    fallback from the unmodified p emits rejected candidates again. The χ² test above, with fewer draws, rejects
    both — and the correct walk, with the same draws, passes it."""
    assert min(p_values(sample(lambda *a: walk(*a, mistake=mistake), TOKENS, 1500), TOKENS)) < 1e-6
    assert min(p_values(sample(walk, TOKENS, 1500), TOKENS)) > 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(("tokens", "ends"), [(TOKENS, 7), (REPEATED, 5)], ids=["distinct", "repeated"])
def test_the_vectorised_rule_is_the_step_by_step_walk(tokens, ends, device):
    """One pass over all nodes (one host sync) gives the verdict the sequential walk gives, seed for seed (on the GPU
    with a CUDA generator too): the same path and the same next token, for every verdict; every node ends some path
    (with a repeat, all but the second copy and its child)."""
    mine = sample(verify_tree_sampling, tokens, 1000, seed=1, device=device)
    assert mine == sample(walk, tokens, 1000, seed=1, device=device)
    assert len({tuple(path) for path, _ in mine}) == ends


def test_a_repeated_sibling_token_keeps_the_law_exact():
    """The root's two first candidates hold one token: the second copy (node 2) and its child are never reached, and
    the law stays the model's; a walk that gives the repeat its mass back (p(x) read before the first copy's
    rejection) over-samples that token and fails the same test."""
    verdicts = sample(verify_tree_sampling, REPEATED, 4000)
    assert all(2 not in path and 6 not in path for path, _ in verdicts)
    assert min(p_values(verdicts, REPEATED)) > 1e-3
    assert min(p_values(sample(lambda *a: walk(*a, mistake="repeat kept"), REPEATED, 1500), REPEATED)) < 1e-6


def test_a_chain_is_verified_as_the_chain_verifier_verifies_one_hot_drafts():
    """On a chain of 3 top-1 drafts, the tree rule and speculative sampling with one-hot drafts (Leviathan et al.
    2023: min(1, p/q) = p; residual p without the draft) give the same verdict, seed for seed (the same draws: one
    uniform per draft, then one draw) — so the same law; drafts chosen to pass about half the time."""
    chain = chain_tree(3)
    gen = torch.Generator().manual_seed(5)
    accepted = []
    for seed in range(1000):
        probs = torch.softmax(torch.randn(4, V, generator=gen) * 1.5, dim=-1)  # (D+1, V)
        drafts = [int(torch.multinomial(probs[d], 1, generator=gen)) for d in range(3)]  # likely tokens
        tree_path, tree_token = verify_tree_sampling(torch.tensor([0, *drafts]), probs, chain,
                                                     torch.Generator().manual_seed(seed))
        one_hot = torch.nn.functional.one_hot(torch.tensor(drafts), V).float()  # (D, V)
        chain_accepted, chain_token = verify_speculative_sampling(drafts, one_hot, probs,
                                                                  torch.Generator().manual_seed(seed))
        assert (tree_path, tree_token) == (list(range(chain_accepted + 1)), chain_token), seed
        accepted.append(chain_accepted)
    assert set(accepted) == {0, 1, 2, 3}


def test_the_verifier_plain_steps_stated_laws_and_devices():
    """TreeSamplingVerifier: a plain step (the root alone) is a draw from the model; a chain whose drafts state their
    law is verified against it (the verdict SamplingVerifier gives, seed for seed); a tree's verdict lists the
    accepted tokens then the drawn one. A generator on another device than the probabilities is refused."""
    logits = torch.randn(TREE.size, V, generator=torch.Generator().manual_seed(0))
    out = (logits, None)
    plain = TreeSamplingVerifier(1.0, torch.Generator().manual_seed(0))(Draft(root_tree(), torch.tensor([3])), out)
    assert plain.path == [0] and plain.tokens == [int(torch.multinomial(
        temperature_probs(logits[0], 1.0), 1, generator=torch.Generator().manual_seed(0)))]
    stated = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(1)), dim=-1)  # (D, V) q
    chain = Draft(chain_tree(2), torch.tensor([3, 1, 4]), stated)
    one_hot_rule = 0
    for seed in range(50):
        ours = TreeSamplingVerifier(0.7, torch.Generator().manual_seed(seed))(chain, (logits[:3], None))
        assert ours == SamplingVerifier(0.7, torch.Generator().manual_seed(seed))(chain, (logits[:3], None))
        path, _ = verify_tree_sampling(chain.tokens, temperature_probs(logits[:3], 0.7), chain.tree,
                                       torch.Generator().manual_seed(seed))
        one_hot_rule += path != ours.path
    assert one_hot_rule > 0  # the stated law was used: the one-hot rule would have judged differently
    verdict = TreeSamplingVerifier(0.7, torch.Generator().manual_seed(2))(Draft(TREE, TOKENS), out)
    path, token = verify_tree_sampling(TOKENS, temperature_probs(logits, 0.7), TREE, torch.Generator().manual_seed(2))
    assert (verdict.path, verdict.tokens) == (path, TOKENS[path[1:]].tolist() + [token])
    with pytest.raises(ValueError, match="generator is on cpu"):
        verify_tree_sampling(TOKENS, torch.full((TREE.size, V), 1 / V, device="meta"), TREE, torch.Generator())


def test_the_batched_engine_samples_a_tree_row_by_row_as_batch_1_does():
    """BatchSampling on a shared tree of deterministic candidates: each row's accepted nodes and next token are
    verify_tree_sampling's on that row with the same seed (χ²-tested above); drafts drawn from a stated law are
    verified as a chain only, and a tree of them is refused by name."""
    logits = torch.randn(3, TREE.size, V, generator=torch.Generator().manual_seed(4))
    tokens = torch.stack([TOKENS, TOKENS, torch.tensor([0, 2, 2, 5, 1, 3, 3])])  # the third row repeats siblings
    nodes, counts, next_tokens = BatchSampling(0.7, [torch.Generator().manual_seed(s) for s in range(3)])(
        tokens, None, logits, TREE, [0, 1, 2])
    for row in range(3):
        path, token = verify_tree_sampling(tokens[row], temperature_probs(logits[row], 0.7), TREE,
                                           torch.Generator().manual_seed(row))
        assert nodes[row, : counts[row]].tolist() == path and int(next_tokens[row]) == token
    assert len({(tuple(nodes[r, : counts[r]].tolist()), int(next_tokens[r])) for r in range(3)}) > 1
    with pytest.raises(ValueError, match="verified as one chain shared by every row; this step has 4 paths"):
        BatchSampling(1.0, [None] * 2)(TOKENS.expand(2, -1), torch.ones(2, TREE.depth, V) / V, logits[:2], TREE, [0, 1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@torch.no_grad()
def test_tree_speculative_sampling_of_a_bfloat16_policy(tiny_llama, device):
    """TreeSamplingVerifier on a bf16 policy (on the GPU under cuda) with a generator on the model's device and the
    tree's candidates made on the CPU: seeded runs repeat, other seeds differ, every token is in the vocabulary."""
    model = bf16_tiny(tiny_llama, device)
    ids, vocab = torch.tensor([[5, 17, 42, 9]], device=device), model.config.vocab_size

    def run(seed: int) -> tuple[list[int], SpeculativeStats]:
        drafts = torch.Generator().manual_seed(seed)
        drafter = TreeDrafter(TREE, lambda hidden, root: torch.randn(2, vocab, generator=drafts) * 4)
        verifier = TreeSamplingVerifier(0.8, torch.Generator(device=device).manual_seed(seed))
        return speculative_generate(model, drafter, verifier, ids, 24, set())

    tokens, stats = run(0)
    assert len(tokens) == 24 and all(0 <= t < vocab for t in tokens) and stats.drafted_tokens > 0
    assert run(0)[0] == tokens and run(1)[0] != tokens


class Recording(TreeSamplingVerifier):
    """TreeSamplingVerifier that keeps every verdict's path."""

    paths: list[list[int]] = []

    def __call__(self, draft, out):
        verdict = super().__call__(draft, out)
        self.paths.append(verdict.path)
        return verdict


@torch.no_grad()
def test_tree_speculative_sampling_of_a_tiny_llama_samples_the_model(tiny_llama):
    """End to end: ``speculative_generate`` with a drafter that proposes the model's own top-3 after the root and its
    top-2 after the root's top-1 candidate (Medusa's layout: siblings, rank-1 paths, two drafts accepted at once) and
    TreeSamplingVerifier at T = 0.4, 3 tokens per run over 600 seeds: the first token (the prefill's draw), the first
    two, and the first three (where their pair is frequent) jointly follow the exact laws of plain forwards of the
    model."""
    model = load_spiky_tiny_llama(tiny_llama)
    temperature, draws, prompt = 0.4, 600, torch.tensor([[5, 17, 42]])
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    vocab = model.config.vocab_size
    roots = torch.arange(vocab)[:, None]  # (V, 1) every possible root
    after_root = model(torch.cat([prompt.expand(vocab, -1), roots], dim=1)).logits[:, -1]  # (V, V) by root
    after_best = model(torch.cat([prompt.expand(vocab, -1), roots, after_root.argmax(-1)[:, None]],
                                 dim=1)).logits[:, -1]  # (V, V) by root
    draft_logits = torch.stack([after_root, after_best], dim=1)  # (V, 2, V) by root
    Recording.paths = []
    runs = []
    for seed in range(draws):
        drafter = TreeDrafter(tree, lambda hidden, root: draft_logits[root])
        verifier = Recording(temperature, torch.Generator().manual_seed(seed))
        tokens, _ = speculative_generate(model, drafter, verifier, prompt, 3, set())
        assert len(tokens) == 3
        runs.append(tuple(tokens))
    assert any(len(path) == 3 for path in Recording.paths)  # two drafts accepted in one step
    assert any(len(path) > 1 and path[1] > 1 for path in Recording.paths)  # a rank-1 or rank-2 draft accepted

    first = temperature_probs(model(prompt).logits[0, -1], temperature)  # (V,)
    joint = first[:, None] * temperature_probs(after_root, temperature)  # (V, V) (first, second)
    frequent = [(a, b) for a in range(vocab) for b in range(vocab) if joint[a, b] * draws >= 15]
    context = torch.cat([prompt.expand(len(frequent), -1), torch.tensor(frequent)], dim=1)
    third = temperature_probs(model(context).logits[:, -1], temperature)  # (F, V) after each frequent pair

    def counts(length: int) -> dict[tuple[int, ...], int]:
        seen: dict[tuple[int, ...], int] = {}
        for run in runs:
            seen[run[:length]] = seen.get(run[:length], 0) + 1
        return seen

    laws = [{(a,): float(first[a]) for a in range(vocab)},
            {(a, b): float(joint[a, b]) for a in range(vocab) for b in range(vocab)},
            {(a, b, c): float(joint[a, b] * third[i, c]) for i, (a, b) in enumerate(frequent) for c in range(vocab)}]
    assert len(frequent) >= 3
    assert min(chi_square_p(counts(k + 1), law, draws) for k, law in enumerate(laws)) > 1e-3
