"""Batched tree speculative decoding (models/engine/batched.py): lossless at every batch size, against per-row HF
greedy at batch 1, token for token (float32; bf16 rounds a batch differently, which the benchmark measures)."""

from __future__ import annotations

import pytest
import torch

from models.engine.batched import batch_tree_inputs, batched_tree_generate
from models.engine.speculative import TreeDrafter, accepted_paths, build_tree, chain_tree, greedy_match
from tests.test_speculative import CHOICES, WINDOW, _greedy, _sliding_model
from tests.tiny import load_spiky_tiny_llama


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_spiky_tiny_llama(tiny_llama)


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` random prompts of 2 to 19 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 20, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class HiddenOracle:
    """A batched drafter that knows every row's greedy continuation. It finds which prompt and position a row is
    at from the hidden state it is handed (nearest among the states of a full forward over prompt + greedy output),
    then proposes the next tokens at rank 0 (60 %), rank 1 (25 %) or not at all (15 %). It also checks what the
    engine hands over: the state must be one of those (``largest_distance``) and the root the token it predicts
    (``stale_states``: a state of an earlier token would still be lossless, only slower)."""

    def __init__(self, model, prompts: list[list[int]], references: list[list[int]], depth: int, seed: int):
        states, futures, self.next_tokens = [], [], []
        for ids, reference in zip(prompts, references, strict=True):
            sequence = ids + reference
            hidden = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]  # (L, H)
            for p in range(len(ids) - 1, len(sequence)):  # the state at p predicts p + 1 (the root), drafts p + 2 …
                states.append(hidden[p])
                futures.append(sequence[p + 2 : p + 2 + depth])
                self.next_tokens.append(sequence[p + 1] if p + 1 < len(sequence) else None)  # None: beyond the output
        self.states, self.futures, self.depth = torch.stack(states), futures, depth
        self.vocab = model.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.largest_distance = 0.0  # relative to the state's norm
        self.stale_states = 0

    def __call__(self, hidden: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        distances = (hidden.float()[:, None] - self.states[None]).norm(dim=-1)  # (B, S), exact (cdist's matmul is not)
        nearest = distances.argmin(dim=1)
        relative = distances.min(dim=1).values / hidden.float().norm(dim=1)
        self.largest_distance = max(self.largest_distance, float(relative.max()))
        logits = torch.randn(len(hidden), self.depth, self.vocab, generator=self.gen)  # (B, D, V)
        for b, state in enumerate(nearest.tolist()):
            self.stale_states += int(self.next_tokens[state] not in (None, int(roots[b])))
            for d, token in enumerate(self.futures[state]):
                u = torch.rand((), generator=self.gen).item()
                logits[b, d, token] = 100.0 if u < 0.6 else (logits[b, d].max() - 1e-3 if u < 0.85 else -100.0)
        return logits


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
@torch.no_grad()
def test_batched_tree_decoding_equals_per_row_greedy(model, batch):
    prompts = _prompts(batch, model.config.vocab_size, seed=batch)
    tree = build_tree(CHOICES)
    multi_token_steps = 0
    for eos, max_new_tokens in ((set(), 30), ({7, 11, 13}, 30), (set(), 4), (set(), 1)):
        references = [_greedy(model, torch.tensor([p]), max_new_tokens, eos) for p in prompts]
        oracle = HiddenOracle(model, prompts, references, tree.depth, seed=batch)
        outputs, stats = batched_tree_generate(model, TreeDrafter(tree, oracle), prompts, max_new_tokens, eos)
        assert outputs == references, (eos, max_new_tokens)
        assert oracle.largest_distance < 1e-5 and oracle.stale_states == 0  # drafts read the last accepted state
        for reference, row in zip(references, stats, strict=True):
            assert row.generated_tokens == len(reference)
            assert sum(row.accepted_lengths) == len(reference) - 1  # the prefill's token, then each step's
            assert row.forwards == 1 + len(row.accepted_lengths)  # a row leaves the batch's forwards when it ends
            multi_token_steps += sum(n > 1 for n in row.accepted_lengths)
        # a useless drafter is just as lossless
        noise = torch.Generator().manual_seed(batch)
        noisy = TreeDrafter(tree, lambda h, r, noise=noise: torch.randn(len(h), tree.depth, model.config.vocab_size,
                                                                        generator=noise))
        assert batched_tree_generate(model, noisy, prompts, max_new_tokens, eos)[0] == references
    assert multi_token_steps > batch  # the rows accepted multi-token paths, at different steps


@torch.no_grad()
def test_rows_that_end_early_leave_the_batch(model):
    """One row ends after its first token (an end token), the others run on: their outputs stay greedy's and the
    ended row takes part in no tree forward."""
    prompts = _prompts(3, model.config.vocab_size, seed=7)
    first = _greedy(model, torch.tensor([prompts[1]]), 1, set())[0]
    references = [_greedy(model, torch.tensor([p]), 12, {first}) for p in prompts]
    assert references[1] == [first] and any(len(r) > 1 for r in references)
    chain = chain_tree(2)
    noise = torch.Generator().manual_seed(0)
    drafter = TreeDrafter(chain, lambda h, r: torch.randn(len(h), 2, model.config.vocab_size, generator=noise))
    outputs, stats = batched_tree_generate(model, drafter, prompts, 12, {first})
    assert outputs == references
    assert stats[1].forwards == 1 and stats[1].accepted_lengths == []


def test_accepted_paths_per_row_on_a_hand_built_tree():
    tree = build_tree([(0,), (1,), (0, 0)])  # nodes: root, (0,), (1,), (0,0)
    tokens = torch.tensor([[5, 6, 7, 8],  # the argmax after the root is 7: node 2 accepted, its path ends there
                           [5, 6, 7, 8],  # after the root 6, after node 1 8: the whole path root → 1 → 3
                           [5, 6, 7, 8]])  # nothing matches: the root alone
    predictions = torch.tensor([[7, 0, 0, 0],
                                [6, 8, 0, 0],
                                [1, 1, 1, 1]])
    nodes, counts = accepted_paths(tree, greedy_match(tokens, predictions, tree))
    assert counts.tolist() == [2, 3, 1]
    assert nodes[0, :2].tolist() == [0, 2] and nodes[1].tolist() == [0, 1, 3] and nodes[2, 0] == 0


def test_each_row_sees_its_own_prefix_and_ancestors():
    tree = build_tree([(0,), (1,)])  # root and two siblings
    positions, mask = batch_tree_inputs(tree, torch.tensor([2, 4]), cache_length=4, dtype=torch.float32)
    assert positions.tolist() == [[2, 3, 3], [4, 5, 5]]
    visible = (mask[:, 0] == 0).int().tolist()  # (B, N+1, T+N+1)
    assert visible[0] == [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0, 1]]
    assert visible[1] == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]


def test_a_sliding_window_model_is_refused_naming_its_layers():
    model = _sliding_model("mistral")
    drafter = TreeDrafter(chain_tree(1), lambda h, r: torch.zeros(len(h), 1, model.config.vocab_size))
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        batched_tree_generate(model, drafter, [[1, 2, 3] * WINDOW, [4, 5]], 4, set())
