"""The MTP module as an EAGLE-2 dynamic-tree drafter (models/mtp/dynamic_tree.py).

References: a teacher-forced forward of the module over each drafted path (every node's token and value must be
what the module gives that path); the chain drafter (a top-1 tree is its chain); HF greedy ``generate`` token for
token (greedy verification of dynamic trees is lossless, in float32).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from models.engine.config import DynamicTree
from models.engine.speculative import TreeVerifier, speculative_generate
from models.mtp.dynamic_tree import MTPBatchTreeDrafter, MTPTreeDrafter
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


# ---------------------------------------------------------------------------------------------------------
# at batch B: per-row trees in the batched engine (models/engine/batched.py)


class RecordingTreeDrafter(MTPBatchTreeDrafter):
    """The batched tree drafter, recording by prompt every row's tree of each cycle as the set of its real nodes'
    token paths from the root (a node's tokens along its path: tokens and shape at once)."""

    def start(self, prompts, hidden, roots):
        self.rows, self.trees = list(range(len(prompts))), [[] for _ in prompts]
        super().start(prompts, hidden, roots)

    def propose(self, roots):
        tokens, probs = super().propose(roots)
        for row, prompt in enumerate(self.rows):
            self.trees[prompt].append(_token_paths(tokens[row], self.tree.paths[row]))
        return tokens, probs

    def keep(self, rows):
        self.rows = [self.rows[i] for i in rows.tolist()]
        super().keep(rows)


def _token_paths(tokens: torch.Tensor, paths: torch.Tensor) -> set[tuple[int, ...]]:
    """Every node on ``paths`` (P, D+1) as its tokens from the root's child down, read from ``tokens`` (N+1,)."""
    nodes = [[n for n in path if n >= 0] for path in paths.tolist()]
    return {tuple(tokens[path[1 : i + 1]].tolist()) for path in nodes for i in range(1, len(path))}


class RecordingBatchOneDrafter(MTPTreeDrafter):
    def propose(self, room):
        draft = super().propose(room)
        trees.append(_token_paths(draft.tokens, draft.tree.paths))
        return draft


trees: list[set[tuple[int, ...]]] = []


@pytest.mark.parametrize("shape, budget, vocab", [(DynamicTree(depth=4, top_k=3, frontier=2), 9, None),
                                                  (DynamicTree(depth=5, top_k=4, frontier=3), 12, 160)])
def test_batched_dynamic_trees_are_greedy_and_each_rows_batch_1_tree(tiny, shape, budget, vocab):
    """Prompts of different lengths (one shorter than the tree's depth), one ending early on an end token, the rest at
    max_new_tokens: the batched output is HF greedy's, token for token, and every row's tree of every cycle is the
    one :class:`MTPTreeDrafter` drafts at batch 1 for that prompt (tokens and shape), with or without a draft
    vocabulary; the rows' trees differ (the per-row path is exercised)."""
    from models.engine.batched import BatchGreedy, batched_speculative_generate
    from tests.helpers import hf_greedy, random_prompts

    model, _ = tiny
    module = perturbed_module(model, 3, scale=0.05)
    module.draft_vocab = None if vocab is None else torch.arange(vocab) * (model.config.vocab_size // vocab)
    parts = draft_parts(model, module)
    prompts = [[7], *random_prompts(4, model.config.vocab_size, seed=11)]  # [7]: L = 1 < depth at first
    end = hf_greedy(model, torch.tensor([prompts[2]]), 3, set())[-1]  # prompt 2 ends at its third token
    references = [hf_greedy(model, torch.tensor([p]), 20, {end}) for p in prompts]
    assert len(references[2]) <= 3 and any(len(r) == 20 for r in references)
    drafter = RecordingTreeDrafter(*parts, shape, budget)
    outputs, stats = batched_speculative_generate(model, drafter, BatchGreedy(), prompts, 20, {end})
    assert outputs == references
    for prompt, row_trees in zip(prompts, drafter.trees, strict=True):
        trees.clear()
        speculative_generate(model, RecordingBatchOneDrafter(*parts, shape, budget), TreeVerifier(),
                             torch.tensor([prompt]), 20, {end})
        assert row_trees == trees
    first = [row_trees[0] for row_trees in drafter.trees]
    assert len({frozenset(t) for t in first}) == len(first), "the rows' first trees should differ"
    assert len({frozenset(len(p) for p in t) for t in first}) > 1, "the rows' first trees should differ in shape"
    assert len(first[0]) < budget  # the one-token prompt drafts one depth only: fewer nodes than the budget
    assert sum(length > 2 for s in stats for length in s.accepted_lengths), "no cycle accepted two drafts"


def test_a_per_row_tree_step_accepts_each_rows_path():
    """Two rows, two different trees (hand-worked): greedy verification follows each row's own tree."""
    from models.engine.speculative import RowTrees, accepted_paths, build_tree, greedy_match

    trees_ = RowTrees.stack([build_tree([(0,), (1,), (0, 0)]),  # root, a, b, a → c
                             build_tree([(0,), (0, 0), (0, 0, 0)])])  # root → a → b → c: a chain
    tokens = torch.tensor([[5, 6, 7, 8],
                           [5, 6, 7, 8]])
    predictions = torch.tensor([[6, 8, 0, 0],  # after the root 6 (node 1), after node 1 8 (node 3)
                                [6, 7, 0, 0]])  # after the root 6, after node 1 7, after node 2 not 8
    nodes, counts = accepted_paths(trees_, greedy_match(tokens, predictions, trees_))
    assert counts.tolist() == [3, 3]
    assert nodes[0, :3].tolist() == [0, 1, 3] and nodes[1, :3].tolist() == [0, 1, 2]
    # the shared-tree reading of row 0's tree gives row 0's answer: one code path for both
    shared = build_tree([(0,), (1,), (0, 0)])
    nodes, counts = accepted_paths(shared, greedy_match(tokens[:1], predictions[:1], shared))
    assert counts.tolist() == [3] and nodes[0].tolist() == [0, 1, 3]


def test_row_trees_mask_each_row_by_its_own_ancestors():
    from models.engine.batched import batch_tree_inputs
    from models.engine.speculative import RowTrees, build_tree

    trees_ = RowTrees.stack([build_tree([(0,), (1,)]), build_tree([(0,), (0, 0)])])  # siblings; a chain
    visible = torch.tensor([[True, False], [True, True]])
    positions, mask = batch_tree_inputs(trees_, visible, dtype=torch.float32)
    assert positions.tolist() == [[1, 2, 2], [2, 3, 4]]
    seen = (mask[:, 0] == 0).int().tolist()
    assert seen[0] == [[1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 1, 0, 1]]
    assert seen[1] == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_batched_tree_sampling_draws_each_row_as_it_would_alone(tiny):
    """Speculative sampling of each row's dynamic tree at batch B (BatchSampling → verify_tree_rows) gives every
    prompt the tokens batch-1 tree sampling (TreeSamplingVerifier, χ²-tested in tests/test_tree_sampling.py) gives it
    from the same seed: the same trees, the same random numbers read in the same order, float32."""
    from models.engine.batched import BatchSampling, batched_speculative_generate
    from models.engine.speculative import TreeSamplingVerifier

    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.0)
    shape = DynamicTree(depth=3, top_k=3, frontier=2, budget=6)
    batch = [ids[0].tolist() for ids in prompts]
    batch[1] = batch[1][:7]  # rows of different lengths (each longer than the depth: every tree has 6 nodes)
    seeds = [11, 12, 13]
    batched, stats = batched_speculative_generate(
        model, MTPBatchTreeDrafter(*draft_parts(model, module), shape, shape.budget),
        BatchSampling(0.3, [torch.Generator().manual_seed(s) for s in seeds]), batch, 20, set())
    for row, seed, tokens in zip(batch, seeds, batched, strict=True):
        alone, _ = speculative_generate(model, MTPTreeDrafter(*draft_parts(model, module), shape, shape.budget),
                                        TreeSamplingVerifier(0.3, torch.Generator().manual_seed(seed)),
                                        torch.tensor([row]), 20, set())
        assert tokens == alone
    assert sum(length > 2 for s in stats for length in s.accepted_lengths), "no cycle accepted two drafts"
    reseeded, _ = batched_speculative_generate(
        model, MTPBatchTreeDrafter(*draft_parts(model, module), shape, shape.budget),
        BatchSampling(0.3, [torch.Generator().manual_seed(s + 100) for s in seeds]), batch, 20, set())
    assert reseeded != batched, "the outputs should depend on the seeds (else equal outputs would prove nothing)"


def test_tree_sampling_never_tries_a_rows_filler_nodes():
    """A row that drafted fewer nodes than the budget pads its tree with filler (on no path): a filler node holding
    a real sibling's token must neither shadow it (an earlier sibling with the same token is a rejected one) nor
    remove its token from the residual law. Row 0: filler node 1 and real node 2 both hold token 6, p(6) = 1 at
    the root, so node 2 passes for sure and the next token is p's at node 2 (one-hot 9); row 1, its own chain."""
    from models.engine.speculative import RowTrees, build_tree, verify_tree_rows

    chain = build_tree([(0, 0)])  # root → 1 → 2
    depths = torch.tensor([[0, 1, 1], [0, 1, 2]])
    ancestors = torch.stack([torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), chain.ancestors])
    trees = RowTrees.of_nodes(depths, ancestors, real=torch.tensor([[True, False, True], [True, True, True]]))
    tokens = torch.tensor([[5, 6, 6], [5, 7, 8]])
    probs = torch.zeros(2, 3, 12)
    probs[0, 0, 6] = probs[0, 1, 3] = probs[0, 2, 9] = 1.0
    probs[1, 0, 7] = probs[1, 1, 8] = probs[1, 2, 4] = 1.0  # row 1: both drafts certain, then the bonus 4
    nodes, counts, next_tokens = verify_tree_rows(tokens, probs, trees, [torch.Generator().manual_seed(0)] * 2)
    assert counts.tolist() == [2, 3] and nodes[0, :2].tolist() == [0, 2] and nodes[1].tolist() == [0, 1, 2]
    assert next_tokens.tolist() == [9, 4]


def test_adaptive_batched_dynamic_trees_catch_up_after_plain_steps(tiny):
    """With a cycle cost no tree can pay, the batch mostly runs plain steps (no draft: the depths' catch-up grows) and
    probes now and then: every row's output is still its greedy decoding."""
    from models.engine.batched import BatchGreedy, batched_speculative_generate
    from models.engine.config import Adaptation
    from tests.helpers import hf_greedy, random_prompts

    model, _ = tiny
    prompts = random_prompts(4, model.config.vocab_size, seed=5)
    references = [hf_greedy(model, torch.tensor([p]), 30, set()) for p in prompts]
    drafter = MTPBatchTreeDrafter(model, perturbed_module(model, 2, scale=0.05), DynamicTree(depth=3, top_k=2), 5)
    outputs, stats = batched_speculative_generate(model, drafter, BatchGreedy(), prompts, 30, set(),
                                                  adaptation=Adaptation(window=2, probe_every=4, cycle_cost=6.0))
    assert outputs == references
    assert min(row.plain_forwards for row in stats) > 5 and min(len(row.accepted_lengths) for row in stats) >= 3


# ---------------------------------------------------------------------------------------------------------
# the budget, calibrated (budget: auto)

def test_a_smaller_or_shallower_tree_accepts_the_drafts_ranked_below_its_budget(tiny):
    """What calibration reads off one decoding with the widest tree (:func:`kept_drafts`): a tree of n nodes drafted d
    deep, in the same state, accepts exactly the accepted drafts no deeper than d ranked below n among the nodes no
    deeper than d. Checked on each prompt's first cycle (after it the runs' states part) against decoding with every
    budget at every depth. The drafter reads a sharpened copy of the LM head, so a confident child outranks its
    parent's siblings and the re-ranking is not the tree's node order (depth first), which a rank taken from that
    order would miss; and a first cycle that accepts two drafts or more, which a depth-1 tree cuts to one."""
    from models.mtp.dynamic_tree import _RecordingTreeDrafter, kept_drafts, pool_size

    model, _ = tiny
    base = copy.deepcopy(model)
    head = base.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach() * 4.0)  # (V, H); tied: the drafts' embeddings too
    module = perturbed_module(model, 3, scale=0.0)
    shape = DynamicTree(depth=4, top_k=3, frontier=2)
    pool = pool_size(shape)
    assert pool == 3 + 3 * 2 * 3
    reordered = deep = 0
    for seed in range(8):
        ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(seed))
        recording = _RecordingTreeDrafter(base, module, shape, pool, clock=lambda: 0.0)
        speculative_generate(model, recording, TreeVerifier(), ids, 8, set())
        first, ranked = recording.accepted_drafts[0], recording.ranked[0]
        assert [rank for rank, _ in first] == sorted(rank for rank, _ in first)  # a node ranks after its parent
        assert [depth for _, depth in first] == list(range(1, len(first) + 1)) and len(ranked) == pool
        deep += len(first) >= 2
        for depth in range(1, shape.depth + 1):
            shallower = shape.model_copy(update={"depth": depth})
            for budget in range(1, pool_size(shallower) + 1):
                _, stats = speculative_generate(model, MTPTreeDrafter(base, module, shallower, budget),
                                                TreeVerifier(), ids, 8, set())
                kept = kept_drafts(first, ranked, budget, depth)
                assert stats.accepted_lengths[0] - 1 == kept, (seed, depth, budget, first)
        reordered += recording.value_ranks != sorted(recording.value_ranks)
    assert deep and reordered, "no first cycle accepted two drafts, or the re-ranking was the node order"


def test_best_tree_weighs_tokens_per_cycle_against_the_cycle_cost():
    """Hand-worked: V(1) 10, V(4) 11, V(8) 14, V(16) 22; drafting D(2) 2, D(3) 4; τ(3, 3) 2.0, τ(7, 3) 2.6,
    τ(15, 3) 3.0 and at depth 2 τ(3, 2) 1.9, τ(7, 2) 2.2, τ(15, 2) 2.3. With F = 3 the tokens per second at depth 3
    are 2.0 / 18 = 0.111, 2.6 / 21 = 0.124, 3.0 / 29 = 0.103, at depth 2 1.9 / 16 = 0.119, 2.2 / 19 = 0.116,
    2.3 / 27 = 0.085: 7 nodes, depth 3. If depth 3 drafts dearer (D(3) 8): 2.6 / 25 = 0.104 < 0.119: 3 nodes, depth 2.
    With F = 60 (a dear cycle) 3.0 / 86 = 0.0349 is the best: the wider, deeper tree pays."""
    from models.mtp.dynamic_tree import BudgetCalibration, best_tree

    costs = {1: 10.0, 4: 11.0, 8: 14.0, 16: 22.0}
    tau = {(3, 3): 2.0, (7, 3): 2.6, (15, 3): 3.0, (3, 2): 1.9, (7, 2): 2.2, (15, 2): 2.3}
    assert best_tree(costs, 3.0, {2: 2.0, 3: 4.0}, tau) == (7, 3)
    assert best_tree(costs, 3.0, {2: 2.0, 3: 8.0}, tau) == (3, 2)
    assert best_tree(costs, 60.0, {2: 2.0, 3: 4.0}, tau) == (15, 3)
    assert best_tree({1: 1.0, 2: 2.0, 3: 3.0}, 0.0, {1: 0.0, 2: 0.0},
                     {(1, 1): 2.0, (2, 1): 3.0, (1, 2): 2.0}) == (1, 1)  # ties: the smaller tree, then the shallower
    calibration = BudgetCalibration(costs, 3.0, {2: 2.0, 3: 4.0}, tau, cycles=10, budget=7, depth=3)
    assert calibration.expected_speedup(7) == pytest.approx(2.6 * 10 / 21)
    assert calibration.expected_speedup(3, 2) == pytest.approx(1.9 * 10 / 16)
    rows = calibration.rows()
    assert [r["width"] for r in rows] == [1, 4, 8, 16] and "tau" not in rows[0]
    assert rows[3] == pytest.approx({"width": 16, "nodes": 15, "ms": 22000.0, "cost_vs_one_token": 2.2, "tau": 3.0,
                                     "expected_speedup": 3.0 * 10 / 29})
    expected = [{"depth": 2, "draft_ms": 2000.0, "nodes": 3, "tau": 1.9, "expected_speedup": 1.9 * 10 / 16},
                {"depth": 3, "draft_ms": 4000.0, "nodes": 7, "tau": 2.6, "expected_speedup": 2.6 * 10 / 21}]
    rows = calibration.depth_rows()
    assert [row == pytest.approx(want) for row, want in zip(rows, expected, strict=True)] == [True] * 2
    with pytest.raises(ValueError, match="widths \\[32\\]"):
        best_tree(costs, 5.0, {3: 1.0}, {(31, 3): 4.0})
    with pytest.raises(ValueError, match="depths \\[4\\]"):
        best_tree(costs, 5.0, {3: 1.0}, {(7, 4): 4.0})


def test_calibration_measures_tau_and_drafting_of_the_widest_tree_and_picks_the_best(tiny):
    """:func:`calibrate_budget` on a clock that ticks once per reading: every forward costs one tick, a draft of 3
    depths reads it as it starts, as each depth and the re-ranking start and at its end (drafting through depth d:
    d + 1 ticks to the next start, plus the re-ranking's 1), and a cycle 6, so F = 6 − 5 − V = 0. τ of the widest tree
    equals that of decoding the same prompts with it (the last cycle of each prompt excluded: the loop does not hand
    it to the drafter), and that of a shallower tree decoding with it on the first cycle; τ grows with the budget;
    the tree is :func:`best_tree`'s. Training prompts beyond ``calibration_prompts`` are not read."""
    from models.mtp.dynamic_tree import best_tree, calibrate_budget, resolved_tree

    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.0)
    shape = DynamicTree(depth=3, top_k=3, frontier=2, calibration_prompts=2)
    ticks = iter(range(10**6))
    calibration = calibrate_budget(model, model, module, shape, prompts, 20, set(), context_length=12,
                                   clock=lambda: float(next(ticks)))
    assert sorted(calibration.costs) == [1, 4, 8, 16] and set(calibration.costs.values()) == {1.0}  # pool 15
    assert calibration.fixed_seconds == 0.0 and calibration.draft_seconds == {1: 3.0, 2: 4.0, 3: 5.0}
    taus = [calibration.tokens_per_cycle[n, 3] for n in (3, 7, 15)]
    assert taus == sorted(taus) and taus[-1] > taus[0] > 1.0
    gained = []
    for ids in prompts:
        _, stats = speculative_generate(model, MTPTreeDrafter(model, module, shape, 15), TreeVerifier(), ids, 20, set())
        gained += stats.accepted_lengths[:-1]
    assert calibration.cycles == len(gained)
    assert calibration.tokens_per_cycle[15, 3] == pytest.approx(sum(gained) / len(gained))
    assert (calibration.budget, calibration.depth) == best_tree(calibration.costs, 0.0, calibration.draft_seconds,
                                                                calibration.tokens_per_cycle)
    # resolved_tree: a configured budget is taken as it is, depth too; auto calibrates on the first calibration_prompts
    configured = shape.model_copy(update={"budget": 5})
    assert resolved_tree(model, model, module, configured, prompts, 20, set()) == (configured, None)
    resolved, used = resolved_tree(model, model, module, shape, prompts, 20, set())
    assert (resolved.budget, resolved.depth) == (used.budget, used.depth) and used.cycles < calibration.cycles
    assert resolved.model_copy(update={"budget": "auto", "depth": 3}) == shape
