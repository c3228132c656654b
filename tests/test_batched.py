"""Batched tree speculative decoding (models/engine/batched.py): lossless at every batch size, against per-row HF
greedy at batch 1, token for token (float32; bf16 rounds a batch differently, which the benchmark measures)."""

from __future__ import annotations

import pytest
import torch

from models.engine.batched import (
    BatchGreedy,
    BatchSampling,
    HeadsDrafter,
    batch_tree_inputs,
    batched_speculative_generate,
)
from models.engine.speculative import accepted_paths, build_tree, chain_tree, greedy_match
from tests.helpers import (
    CHOICES,
    RecordingBatchDrafter,
    assert_agrees_up_to_ties,
    bf16_tiny,
    chi_square_p,
    hf_greedy,
    perturbed_module,
    random_prompts,
)
from tests.tiny import SLIDING_WINDOW, load_spiky_tiny_llama, sliding_model


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_spiky_tiny_llama(tiny_llama)


def batched_tree_generate(model, drafter: HeadsDrafter, prompts, max_new_tokens: int, eos: set[int]):
    """Greedy-verified batched decoding with a heads drafter."""
    return batched_speculative_generate(model, drafter, BatchGreedy(), prompts, max_new_tokens, eos)


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
    prompts = random_prompts(batch, model.config.vocab_size, seed=batch)
    tree = build_tree(CHOICES)
    multi_token_steps = 0
    for eos, max_new_tokens in ((set(), 30), ({7, 11, 13}, 30), (set(), 4), (set(), 1)):
        references = [hf_greedy(model, torch.tensor([p]), max_new_tokens, eos) for p in prompts]
        oracle = HiddenOracle(model, prompts, references, tree.depth, seed=batch)
        outputs, stats = batched_tree_generate(model, HeadsDrafter(tree, oracle), prompts, max_new_tokens, eos)
        assert outputs == references, (eos, max_new_tokens)
        assert oracle.largest_distance < 1e-5 and oracle.stale_states == 0  # drafts read the last accepted state
        for reference, row in zip(references, stats, strict=True):
            assert row.generated_tokens == len(reference)
            assert sum(row.accepted_lengths) == len(reference) - 1  # the prefill's token, then each step's
            assert row.forwards == 1 + len(row.accepted_lengths)  # a row leaves the batch's forwards when it ends
            multi_token_steps += sum(n > 1 for n in row.accepted_lengths)
        # a useless drafter is just as lossless
        noise = torch.Generator().manual_seed(batch)
        noisy = HeadsDrafter(tree, lambda h, r, noise=noise: torch.randn(len(h), tree.depth, model.config.vocab_size,
                                                                        generator=noise))
        assert batched_tree_generate(model, noisy, prompts, max_new_tokens, eos)[0] == references
    assert multi_token_steps > batch  # the rows accepted multi-token paths, at different steps


@torch.no_grad()
def test_rejected_nodes_stay_as_masked_junk_until_compacted(model, monkeypatch):
    """A drafter that is always wrong leaves N rejected nodes per row per step in the cache, masked; once the junk
    outgrows the rows, one compaction moves every row's real keys together. The output stays greedy's throughout,
    before and after compacting, and rows of different lengths keep their own positions."""
    import models.engine.batched as batched

    compactions = []

    def counting(cache, visible):
        compactions.append(visible.shape[1] - int(visible.sum(dim=1).max()))  # the junk columns it removes
        return compact(cache, visible)

    compact = batched.compact_cache
    monkeypatch.setattr(batched, "compact_cache", counting)
    prompts = random_prompts(3, model.config.vocab_size, seed=21)
    references = [hf_greedy(model, torch.tensor([p]), 60, set()) for p in prompts]
    tree = build_tree(CHOICES)
    wrong = HeadsDrafter(tree, lambda h, r: torch.full((len(h), tree.depth, model.config.vocab_size), -1e4)
                         .index_fill_(2, torch.tensor([1, 2]), 1e4))  # tokens 1 and 2 at every depth
    outputs, _ = batched_tree_generate(model, wrong, prompts, 60, set())
    assert outputs == references
    assert compactions and min(compactions) > 64  # rejected nodes piled up as junk, then were compacted away


@torch.no_grad()
def test_rows_that_end_early_leave_the_batch(model):
    """One row ends after its first token (an end token), the others run on: their outputs stay greedy's and the
    ended row takes part in no tree forward."""
    prompts = random_prompts(3, model.config.vocab_size, seed=7)
    first = hf_greedy(model, torch.tensor([prompts[1]]), 1, set())[0]
    references = [hf_greedy(model, torch.tensor([p]), 12, {first}) for p in prompts]
    assert references[1] == [first] and any(len(r) > 1 for r in references)
    chain = chain_tree(2)
    noise = torch.Generator().manual_seed(0)
    drafter = HeadsDrafter(chain, lambda h, r: torch.randn(len(h), 2, model.config.vocab_size, generator=noise))
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
    visible = torch.tensor([[True, True, False, False], [True, True, True, True]])  # row 0: 2 real keys, row 1: 4
    positions, mask = batch_tree_inputs(tree, visible, dtype=torch.float32)
    assert positions.tolist() == [[2, 3, 3], [4, 5, 5]]
    visible = (mask[:, 0] == 0).int().tolist()  # (B, N+1, T+N+1)
    assert visible[0] == [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0, 1]]
    assert visible[1] == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]


def test_a_sliding_window_model_is_refused_naming_its_layers():
    model = sliding_model("mistral")
    drafter = HeadsDrafter(chain_tree(1), lambda h, r: torch.zeros(len(h), 1, model.config.vocab_size))
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        batched_tree_generate(model, drafter, [[1, 2, 3] * SLIDING_WINDOW, [4, 5]], 4, set())


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
@torch.no_grad()
def test_batched_mtp_drafting_equals_per_row_greedy_and_drafts_as_at_batch_1(model, batch):
    """MTP's chained drafts through the same engine: per-row HF greedy token for token, and every row's drafts, cycle
    by cycle, are the ones the batch-1 MTP drafter proposes on that prompt (each row reads its own depth caches)."""
    from models.engine.speculative import TreeVerifier, speculative_generate
    from models.mtp.module import MTPBatchDrafter, MTPDrafter

    class RecordingDrafter(MTPDrafter):
        def propose(self, room):
            draft = super().propose(room)
            drafts.append(draft.tokens[1:].tolist())
            return draft

    prompts = random_prompts(batch, model.config.vocab_size, seed=100 + batch)
    module = perturbed_module(model, 2, scale=0.0)
    references = [hf_greedy(model, torch.tensor([p]), 24, set()) for p in prompts]
    drafter = RecordingBatchDrafter(MTPBatchDrafter(model, module))
    outputs, stats = batched_speculative_generate(model, drafter, BatchGreedy(), prompts, 24, set())
    assert outputs == references
    for prompt, row_drafts in zip(prompts, drafter.drafts, strict=True):
        drafts = []
        speculative_generate(model, RecordingDrafter(model, module), TreeVerifier(), torch.tensor([prompt]), 24, set())
        assert row_drafts == drafts
    assert sum(len(d) for d in drafter.drafts) > batch  # several cycles per row


def _second_token_laws(model, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each prompt's exact law of its first sampled token p(a) (V,) and of its second, Σ_a p(a) p(b | a) (V,), at
    T = 1, computed over the whole vocabulary."""
    laws = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        first = torch.softmax(model(ids).logits[0, -1], dim=-1)  # (V,)
        every = torch.arange(len(first))
        continued = torch.cat([ids.expand(len(every), -1), every[:, None]], dim=1)  # every possible first token
        second = torch.softmax(model(continued).logits[:, -1], dim=-1)  # (V, V)
        laws.append((first, (first[:, None] * second).sum(dim=0)))
    return laws


class GullibleBatch(BatchSampling):
    """The negative control: keeps every draft as it comes, then the model's own token."""

    def __call__(self, tokens, probs, logits, tree, prompts):
        nodes, counts, roots = super().__call__(tokens, probs, logits, tree, prompts)
        bonus = torch.cat([torch.multinomial(torch.softmax(logits[b, -1], dim=-1), 1, generator=self.generators[p])
                           for b, p in enumerate(prompts)])
        return nodes, torch.full_like(counts, tree.size), bonus


@pytest.mark.parametrize("draft_temperature", [1.0, 0.0])
@torch.no_grad()
def test_batched_speculative_sampling_keeps_every_rows_distribution(model, draft_temperature):
    """Three prompts of different lengths, 400 rows each (interleaved), decoded together at T = 1 with MTP drafts
    (sampled or top-1), each row with its own generator: every prompt's first and second output tokens (the second:
    a drafted position) follow that prompt's exact laws (χ² per row position). Keeping every draft (the negative
    control) fails the same test on the second token."""
    from models.mtp.module import MTPBatchDrafter

    prompts = [[5, 9, 14], [3, 8, 21, 7, 30, 11, 6], [12, 4]]
    copies = 400
    laws = _second_token_laws(model, prompts)
    module = perturbed_module(model, 2, scale=0.3)
    rows = [prompts[i % len(prompts)] for i in range(copies * len(prompts))]  # neighbouring rows: other prompts

    def sample(verifier_class) -> tuple[list[list[int]], list]:
        generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(rows))]
        drafter = MTPBatchDrafter(model, module, draft_temperature, generators)
        return batched_speculative_generate(model, drafter, verifier_class(1.0, generators), rows, 2, set())

    def p_values(outputs: list[list[int]]) -> list[float]:
        values = []
        for i, (first, second) in enumerate(laws):
            mine = torch.tensor(outputs[i :: len(prompts)])  # (copies, 2)
            for position, law in enumerate((first, second)):
                counts = dict(enumerate(torch.bincount(mine[:, position], minlength=len(law)).tolist()))
                values.append(chi_square_p(counts, {v: float(law[v]) for v in range(len(law))}, copies))
        return values

    outputs, stats = sample(BatchSampling)
    assert 0 < sum(s.accepted_drafts for s in stats) < sum(s.drafted_tokens for s in stats)  # both verdicts ran
    assert min(p_values(outputs)) > 1e-3
    gullible = p_values(sample(GullibleBatch)[0])
    assert min(gullible[1::2]) < 1e-6  # the second tokens: the drafts' law, not the model's


@torch.no_grad()
def test_adaptive_batched_decoding_runs_plain_steps_and_stays_greedy(model):
    """With a cycle cost no draft can pay (c = 4 with 2 drafts), the batch falls back to plain steps, probes, and
    its output is still every row's greedy decoding."""
    from models.engine.config import Adaptation
    from models.mtp.module import MTPBatchDrafter

    prompts = random_prompts(5, model.config.vocab_size, seed=3)
    references = [hf_greedy(model, torch.tensor([p]), 30, set()) for p in prompts]
    drafter = MTPBatchDrafter(model, perturbed_module(model, 2, scale=0.05))
    outputs, stats = batched_speculative_generate(model, drafter, BatchGreedy(), prompts, 30, set(),
                                                  adaptation=Adaptation(window=2, probe_every=4, cycle_cost=4.0))
    assert outputs == references
    plain = {row.plain_forwards for row in stats}
    cycles = {len(row.accepted_lengths) for row in stats}
    assert min(plain) > 10 and 2 <= min(cycles) < 10  # mostly plain, with the first window and probes drafting


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@torch.no_grad()
def test_batched_mtp_decoding_of_a_bfloat16_policy(tiny_llama, device):
    """A bf16 policy (on the GPU under cuda): batched MTP drafting greedy-verified agrees with per-row greedy up to
    bf16 near-ties, and batched speculative sampling draws with generators on the policy's device."""
    from models.mtp.module import MTPBatchDrafter

    model = bf16_tiny(tiny_llama, device)
    prompts = random_prompts(5, model.config.vocab_size, seed=11)
    module = perturbed_module(model, 2, scale=0.0)
    outputs, _ = batched_speculative_generate(model, MTPBatchDrafter(model, module), BatchGreedy(), prompts, 16, set())
    for prompt, tokens in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt], device=device)
        assert_agrees_up_to_ties(model, ids, tokens, hf_greedy(model, ids, 16, set()))
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(len(prompts))]
    sampled, stats = batched_speculative_generate(model, MTPBatchDrafter(model, module, 1.0, generators),
                                                  BatchSampling(1.0, generators), prompts, 16, set())
    assert [len(tokens) for tokens in sampled] == [16] * len(prompts) and sum(s.drafted_tokens for s in stats) > 0
