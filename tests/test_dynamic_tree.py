"""The MTP module as an EAGLE-2 dynamic-tree drafter (models/mtp/dynamic_tree.py).

References: a teacher-forced forward of the module over each drafted path (every node's token and value must be
what the module gives that path); the chain drafter (a top-1 tree is its chain); HF greedy ``generate`` token for
token (greedy verification of dynamic trees is lossless, in float32).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.engine.config import DynamicTree
from models.engine.speculative import TreeVerifier, speculative_generate
from models.mtp.dynamic_tree import MTPTreeDrafter
from models.mtp.module import MTPDrafter, MTPModule, draft_parts, frequent_tokens, mtp_logits
from tests.helpers import perturbed_module
from tests.tiny import load_spiky_tiny_llama


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """The spiky tiny Llama and three seeded random prompts (1, 10) of it."""
    prompts = [torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    return load_spiky_tiny_llama(tiny_llama), prompts


def _teacher_forced_logps(model, module, sequence: torch.Tensor, hidden: torch.Tensor, length: int,
                          path: list[int]) -> list[torch.Tensor]:
    """log p of depth k's prediction at position L − 1 (k = 1 … len(path) + 1) for the final tokens t_0 … t_L followed
    by ``path``, from one teacher-forced forward of the module (depths beyond its K reuse the shared layer)."""
    tokens = torch.cat([sequence[:, : length + 1], torch.tensor([path], dtype=torch.long)], dim=1)
    h0 = torch.nn.functional.pad(hidden[:, :length], (0, 0, 0, tokens.shape[1] - length))
    depths = len(path) + 1
    saved, module.config = module.config, replace(module.config, num_depths=depths)
    try:
        with torch.no_grad():
            states = module(model, tokens, h0)
    finally:
        module.config = saved
    return [torch.log_softmax(mtp_logits(model, states[k][0, length - 1]).float(), dim=-1) for k in range(depths)]


@pytest.mark.parametrize("chunks", [[7, 1, 3, 2, 4], [9, 4, 4, 1]])
def test_every_node_is_the_modules_teacher_forced_choice(tiny, chunks):
    """After any sequence of updates, each node of the tree holds the module's rank-r token for its path, as one
    teacher-forced forward over the final tokens and the path's drafts gives it, and the budget nodes kept are those
    of highest path probability among all drafted (re-ranking)."""
    model, _ = tiny
    module = perturbed_module(model, 3)
    shape = DynamicTree(depth=4, top_k=3, frontier=2, budget=9)
    sequence = torch.randint(0, model.config.vocab_size, (1, sum(chunks) + 1),
                             generator=torch.Generator().manual_seed(len(chunks)))
    with torch.no_grad():
        hidden = model(sequence, output_hidden_states=True).hidden_states[-1]
    drafter = MTPTreeDrafter(model, module, shape, budget=9)
    length = 0
    for size in chunks:
        drafter.update(hidden[0, length : length + size], sequence[0, length + 1 : length + size + 1].tolist())
        length += size
        tree, tokens = drafter.draft()
        assert tree.size - 1 == len(tokens) == 9
        token_of = dict(zip(tree.choices, tokens, strict=True))
        values = {}
        for path, token in token_of.items():
            drafts = [token_of[path[:i]] for i in range(1, len(path))]
            logps = _teacher_forced_logps(model, module, sequence, hidden, length, drafts)[-1]
            assert token == int(logps.topk(path[-1] + 1).indices[-1]), f"node {path} is not the rank-{path[-1]} token"
            values[path] = (values[path[:-1]] if len(path) > 1 else 0.0) + float(logps[token])
        # the kept nodes are the likeliest: no kept node is less likely than a dropped child of a kept expanded node
        # (the drafter's own ranking is recomputed here from the teacher-forced values)
        kept_lowest = min(values.values())
        for path in token_of:
            if len(path) < shape.depth and any(q[:-1] == path for q in token_of):  # an expanded node
                drafts = [token_of[path[:i]] for i in range(1, len(path) + 1)]
                logps = _teacher_forced_logps(model, module, sequence, hidden, length, drafts)[-1]
                children = logps.topk(shape.top_k).values
                for rank, child_logp in enumerate(children.tolist()):
                    if (*path, rank) not in token_of:
                        assert values[path] + child_logp <= kept_lowest + 1e-4


def test_a_top1_tree_is_the_chain(tiny):
    """top_k = frontier = 1: the tree is the chain drafter's chain, token for token."""
    model, _ = tiny
    module = perturbed_module(model, 3)
    sequence = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = model(sequence, output_hidden_states=True).hidden_states[-1]
    tree_drafter = MTPTreeDrafter(model, module, DynamicTree(depth=3, top_k=1, frontier=1), budget=3)
    chain_drafter = MTPDrafter(model, module)
    length = 0
    for size in [6, 2, 5, 3]:
        for drafter in (tree_drafter, chain_drafter):
            drafter.update(hidden[0, length : length + size], sequence[0, length + 1 : length + size + 1].tolist())
        length += size
        tree, tokens = tree_drafter.draft()
        chain, _ = chain_drafter.draft(lambda step_logits: int(step_logits.argmax()))
        assert tree.choices == ((0,), (0, 0), (0, 0, 0))
        assert tokens == chain


@pytest.mark.parametrize("shape, vocab", [(DynamicTree(depth=4, top_k=8, frontier=4, budget=20), None),
                                          (DynamicTree(depth=5, top_k=4, frontier=3, budget=12), 160)])
def test_greedy_dynamic_tree_decoding_equals_greedy(tiny, shape, vocab):
    """Greedy verification of dynamic trees emits HF greedy's tokens, one for one, with or without a draft
    vocabulary, and some cycles accept several drafts (the tree's depths and the caches' catch-up are exercised)."""
    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.0)  # the module's initial copy of the last layer: often right here
    draft_vocab = None if vocab is None else torch.arange(vocab) * (model.config.vocab_size // vocab)
    deep = 0
    for ids in prompts:
        reference = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, ids.shape[1]:].tolist()
        module.draft_vocab = draft_vocab
        drafter = MTPTreeDrafter(*draft_parts(model, module), shape, shape.budget)
        tokens, stats = speculative_generate(model, drafter, TreeVerifier(), ids, 24, set())
        assert tokens == reference
        assert stats.drafted_tokens == shape.budget * len(stats.accepted_lengths)
        deep += sum(length > 2 for length in stats.accepted_lengths)
    assert deep, "no cycle accepted two drafts: the test would not exercise the tree's depths"


def test_draft_vocabulary_restricts_the_drafts(tiny):
    model, prompts = tiny
    module = perturbed_module(model, 3)
    vocab = torch.tensor([5, 17, 40, 41, 99])
    module.draft_vocab = vocab
    drafter = MTPTreeDrafter(*draft_parts(model, module), DynamicTree(depth=2, top_k=2, frontier=2), budget=6)
    with torch.no_grad():
        hidden = model(prompts[0], output_hidden_states=True).hidden_states[-1]
    drafter.update(hidden[0], prompts[0][0, 1:].tolist() + [7])
    _, tokens = drafter.draft()
    assert set(tokens) <= set(vocab.tolist()) and len(tokens) == 6


def test_frequent_tokens_by_hand_and_saved_with_the_module(tiny, tmp_path):
    assert frequent_tokens([[3, 3, 1, 2], [2, 3, 0]], size=2, vocab_size=5).tolist() == [2, 3]  # 3 × 3, 2 × 2
    assert frequent_tokens([[4, 4]], size=3, vocab_size=5).tolist() == [0, 1, 4]  # ties: the lower ids
    model, _ = tiny
    module = perturbed_module(model, 2)
    module.save(tmp_path / "plain")
    assert MTPModule.load(tmp_path / "plain", model).draft_vocab is None
    module.draft_vocab = torch.tensor([2, 3, 9])
    module.save(tmp_path / "vocab")
    assert MTPModule.load(tmp_path / "vocab", model).draft_vocab.tolist() == [2, 3, 9]


def test_a_budget_below_one_is_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="at least one node"):
        MTPTreeDrafter(model, perturbed_module(model, 1), DynamicTree(), budget=0)
    with pytest.raises(ValueError, match="at least one node"):
        DynamicTree(budget=0)


def test_a_draft_vocabulary_head_equals_the_full_head_on_its_tokens(tiny):
    """The draft copy's LM head gives the full head's logits on the vocabulary's tokens, −inf elsewhere; chained
    drafts through it stay lossless under greedy verification and are always vocabulary tokens."""
    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.0)
    vocab = torch.arange(0, model.config.vocab_size, 3)
    module.draft_vocab = vocab
    draft_base, draft_module = draft_parts(model, module)
    hidden = torch.randn(4, model.config.hidden_size)
    restricted, full = mtp_logits(draft_base, hidden), mtp_logits(model, hidden)
    torch.testing.assert_close(restricted[:, vocab], full[:, vocab], atol=1e-6, rtol=1e-6)
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool).index_fill(0, vocab, False)
    assert torch.isneginf(restricted[:, outside]).all()
    for ids in prompts:
        reference = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, ids.shape[1]:].tolist()
        tokens, _ = speculative_generate(model, MTPDrafter(draft_base, draft_module), TreeVerifier(), ids, 16, set())
        assert tokens == reference
        drafter = MTPDrafter(draft_base, draft_module)
        with torch.no_grad():
            drafter.update(model(ids, output_hidden_states=True).hidden_states[-1][0], [*ids[0, 1:].tolist(), 7])
        drafts, _ = drafter.draft(lambda step_logits: int(step_logits.argmax()))
        assert set(drafts) <= set(vocab.tolist())
