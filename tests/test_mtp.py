"""The MTP module (models/mtp.py), its equip training (models/mtp_training.py) and MTP speculative decoding.

References: hand-built shapes and targets; a teacher-forced forward over the same tokens (the cached chained
drafts must equal it); HF greedy ``generate`` token for token (greedy losslessness); exact distributions
(speculative sampling: chi-square tests with fixed seeds, each with a negative control that must fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from models.engine.speculative import (
    SpeculativeStats,
    TreeVerifier,
    speculative_stream,
    verify_speculative_sampling,
)
from models.mtp.module import (
    MTPDrafter,
    MTPModule,
    MTPModuleConfig,
    depth_targets,
    draft_parts,
    mtp_cross_entropy,
    mtp_generate,
    mtp_logits,
)
from tests.helpers import chi_square_p, perturbed_module, rl_stage, run_rl_stage, scores_table
from tests.tiny import load_spiky_tiny_llama

QUESTIONS = ["Ben has 4 apples. How many?", "Ivy has 3 cookies and gives 1 to Omar.", "What is 7 * 8?"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    model = load_spiky_tiny_llama(tiny_llama)
    return model, [tok(q, return_tensors="pt").input_ids for q in QUESTIONS]


def test_module_shapes_and_shared_parameters(tiny):
    model, _ = tiny
    hidden_size = model.config.hidden_size
    one, three = MTPModule(model, MTPModuleConfig(1)), MTPModule(model, MTPModuleConfig(3))
    # K depths share ONE set of parameters: the module's size does not grow with K
    assert sum(p.numel() for p in one.parameters()) == sum(p.numel() for p in three.parameters())
    layer_size = sum(p.numel() for p in model.get_decoder().layers[-1].parameters())
    assert sum(p.numel() for p in three.parameters()) == 2 * hidden_size * hidden_size + 2 * hidden_size + layer_size
    # the embedding, final norm and LM head are the main model's, never the module's own
    own = {id(p) for p in three.parameters()}
    shared = [model.get_input_embeddings().weight, model.get_output_embeddings().weight,
              *model.get_decoder().norm.parameters()]
    assert not any(id(p) in own for p in shared)
    own_parts = {name.split(".")[0] for name in three.state_dict()}
    assert own_parts == {"embedding_norm", "hidden_norm", "projection", "layer"}
    # the same layer runs once per depth
    calls = []
    handle = three.layer.register_forward_hook(lambda *_: calls.append(1))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 9))
    hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]
    states = three(model, input_ids, hidden)
    handle.remove()
    assert len(calls) == 3 and len(states) == 3
    assert all(s.shape == (2, 9, hidden_size) for s in states)
    assert mtp_logits(model, states[0]).shape == (2, 9, model.config.vocab_size)


def test_depth_targets_by_hand():
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    targets, valid = depth_targets(input_ids, mask, depth=1)  # depth 1 at i predicts t_{i+2}
    assert targets.tolist() == [[3, 4, 5, 6, 0, 0]]
    assert valid.tolist() == [[True, True, True, True, False, False]]
    targets, valid = depth_targets(input_ids, mask, depth=3)
    assert targets.tolist() == [[5, 6, 0, 0, 0, 0]]
    assert valid.tolist() == [[True, True, False, False, False, False]]


def test_cross_entropy_weights_each_depth(tiny):
    model, _ = tiny
    module = perturbed_module(model, 2)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 8))
    mask = torch.ones_like(input_ids)
    hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]
    states = module(model, input_ids, hidden)
    total, per_depth = mtp_cross_entropy(model, states, input_ids, mask, [0.6, 0.4])
    by_hand = []
    for k, state in enumerate(states, start=1):
        logits = mtp_logits(model, state[:, : 8 - k - 1])  # positions whose target t_{i+k+1} exists
        by_hand.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         input_ids[:, k + 1 :].reshape(-1)).item())
    assert per_depth == pytest.approx(by_hand, abs=1e-5)
    assert total.item() == pytest.approx(0.6 * by_hand[0] + 0.4 * by_hand[1], abs=1e-5)


def test_cross_entropy_over_a_draft_vocabulary_skips_targets_outside_it(tiny):
    model, _ = tiny
    module = perturbed_module(model, 1)
    input_ids = torch.tensor([[3, 7, 9, 11, 7, 20, 9, 5]])
    hidden = model(input_ids, output_hidden_states=True).hidden_states[-1]
    states = module(model, input_ids, hidden)
    vocab = torch.tensor([2, 7, 9, 30])  # targets t_{i+2} = 9, 11, 7, 20, 9, 5: 11, 20 and 5 are outside
    _, (ce,) = mtp_cross_entropy(model, states, input_ids, torch.ones_like(input_ids), [1.0], vocab=vocab)
    logits = mtp_logits(model, states[0][0, [0, 2, 4]])[:, vocab]  # positions whose target is 9, 7, 9
    by_hand = torch.nn.functional.cross_entropy(logits, torch.tensor([2, 1, 2])).item()
    assert ce == pytest.approx(by_hand, abs=1e-5)
    _, (whole,) = mtp_cross_entropy(model, states, input_ids, torch.ones_like(input_ids), [1.0])
    assert abs(whole - ce) > 0.1  # the whole vocabulary's softmax and targets give another loss


@pytest.mark.parametrize("chunks", [[7, 1, 3, 2, 4], [9, 4, 4, 1]])
def test_cached_chained_drafts_equal_a_teacher_forced_forward(tiny, chunks):
    """After any sequence of updates, each depth's draft logits are those of one teacher-forced forward over the
    final tokens followed by the drafts (the caches keep exactly the positions whose inputs are final)."""
    model, _ = tiny
    module = perturbed_module(model, 3)
    # seeded: an unseeded draw once landed 2.35e-4 from the teacher-forced logits (float32 sums in another order)
    sequence = torch.randint(0, model.config.vocab_size, (1, sum(chunks) + 1),
                             generator=torch.Generator().manual_seed(len(chunks)))
    with torch.no_grad():
        hidden = model(sequence, output_hidden_states=True).hidden_states[-1]
    drafter = MTPDrafter(model, module)
    length = 0
    for size in chunks:
        drafter.update(hidden[0, length : length + size], sequence[0, length + 1 : length + size + 1].tolist())
        length += size
        drafts, logits = drafter.draft(lambda step_logits: int(step_logits.argmax()))
        # teacher forcing over t_0 … t_L, then the drafts; h^0 only matters up to position L − 1
        tokens = torch.cat([sequence[:, : length + 1], torch.tensor([drafts])], dim=1)
        h0 = torch.nn.functional.pad(hidden[:, :length], (0, 0, 0, tokens.shape[1] - length))
        with torch.no_grad():
            states = module(model, tokens, h0)
        for k in range(3):
            torch.testing.assert_close(logits[k], mtp_logits(model, states[k][0, length - 1]), atol=2e-4, rtol=1e-4)
            assert drafts[k] == int(logits[k].argmax())


@pytest.mark.parametrize("draft_dtype", [None, torch.bfloat16])
def test_greedy_mtp_decoding_equals_greedy(tiny, draft_dtype):
    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.05)
    accepted_some = False
    for ids in prompts:
        reference = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, ids.shape[1]:].tolist()
        stats = SpeculativeStats()
        tokens = mtp_generate(model, *draft_parts(model, module, draft_dtype), ids, 24, set(), 0.0, stats=stats)
        assert tokens == reference
        assert stats.generated_tokens == 24
        assert stats.drafted_tokens == 3 * len(stats.accepted_lengths)
        assert stats.tokens_per_cycle == pytest.approx(1 + stats.accepted_drafts / len(stats.accepted_lengths))
        accepted_some |= stats.accepted_drafts > 0
    assert accepted_some, "no draft was ever accepted: the test would not exercise the cache bookkeeping"


def test_mtp_decoding_stops_at_an_end_token_accepted_mid_chunk(tiny):
    """An end token that arrives inside a cycle's accepted chunk (drafts + bonus) ends the output right there:
    the chunk's later tokens reach neither the output nor the counters."""
    model, prompts = tiny
    module = perturbed_module(model, 3, scale=0.05)
    checked = 0
    for ids in prompts:
        chunks = list(speculative_stream(model, MTPDrafter(model, module), TreeVerifier(), ids, 24, set()))
        produced = [t for chunk in chunks for t in chunk]
        starts = [sum(map(len, chunks[:c])) for c in range(len(chunks))]
        # positions inside a chunk of ≥ 2 tokens, not its last, holding a token's first occurrence
        inside = [start + i for start, chunk in zip(starts, chunks, strict=True) for i in range(len(chunk) - 1)
                  if produced.index(chunk[i]) == start + i]
        for position in inside:
            stats = SpeculativeStats()
            tokens = mtp_generate(model, model, module, ids, 24, {produced[position]}, 0.0, stats=stats)
            assert tokens == produced[: position + 1]
            assert stats.generated_tokens == position + 1
            checked += 1
    assert checked, "no chunk of several tokens: the test would not exercise a mid-chunk end token"


@pytest.mark.parametrize("top1_drafts", [False, True])
def test_speculative_sampling_preserves_the_target_distribution(top1_drafts):
    """Synthetic p and q over 6 tokens, 2 drafts: the first emitted token follows p exactly, although the drafts
    come from a very different q (sampled, or its top-1 token: a one-hot q); accepting every draft (the negative
    control) fails the same test."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    target = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)  # p at root, after d1, after d2
    draft = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)  # q of d1, d2 (independent of p)
    if top1_drafts:
        draft = torch.nn.functional.one_hot(draft.argmax(-1), vocab).float()
    draws = 20_000
    emitted, naive = {}, {}
    for _ in range(draws):
        d = [int(torch.multinomial(draft[i], 1, generator=gen)) for i in range(2)]
        accepted, next_token = verify_speculative_sampling(d, draft, target, gen)
        first = d[0] if accepted >= 1 else next_token
        emitted[first] = emitted.get(first, 0) + 1
        naive[d[0]] = naive.get(d[0], 0) + 1
    # the first emitted token's law is p[0] (later tokens condition on it; p here is context-free for d ≥ 1)
    exact = {v: float(target[0, v]) for v in range(vocab)}
    assert chi_square_p(emitted, exact, draws) > 1e-3
    assert chi_square_p(naive, exact, draws) < 1e-6


@pytest.mark.parametrize("draft_temperature", [1.0, 0.0])
def test_speculative_sampling_with_mtp_drafts_samples_the_model_exactly(tiny, draft_temperature):
    """End to end on the tiny Llama at T = 1, with sampled or top-1 drafts: the second token of MTP speculative
    sampling (the first drafted position) has exactly the model's marginal Σ_a p(a) p(b | a), computed over the
    whole vocabulary."""
    model, prompts = tiny
    module = perturbed_module(model, 2, scale=0.3)
    ids = prompts[2]
    with torch.no_grad():
        first = torch.softmax(model(ids).logits[0, -1], dim=-1)  # (V,)
        every = torch.arange(len(first))
        continued = torch.cat([ids.expand(len(every), -1), every[:, None]], dim=1)  # every possible first token
        second = torch.softmax(model(continued).logits[:, -1], dim=-1)  # (V, V)
        marginal = (first[:, None] * second).sum(dim=0)  # (V,)
    exact = {v: float(marginal[v]) for v in range(len(marginal))}
    gen = torch.Generator().manual_seed(1)
    draws, counts, stats = 1200, {}, SpeculativeStats()
    for _ in range(draws):
        tokens = mtp_generate(model, model, module, ids, 2, set(), 1.0, gen, stats, draft_temperature)
        counts[tokens[1]] = counts.get(tokens[1], 0) + 1
    assert 0 < stats.accepted_drafts < stats.drafted_tokens  # both acceptance and residual draws happened
    assert chi_square_p(counts, exact, draws) > 1e-3
    # negative control: the first token's distribution is not the second's
    first_law = {v: float(first[v]) for v in range(len(first))}
    assert chi_square_p(counts, first_law, draws) < 1e-6


def _distilled_sequences(tokenizer, count: int = 8):
    import pandas as pd

    from models.common.sequences import sft_sequences

    prompt = "<|im_start|>user\nBen has 4 apples.<|im_end|>\n<|im_start|>assistant\n"
    responses = pd.DataFrame({"prompt": [prompt] * count,
                              "response": ["The answer is 6. Ben has 4 apples and 2 more."] * count})
    return sft_sequences(tokenizer, responses)


def test_equip_training_changes_only_the_module_and_lowers_the_loss(tiny_llama, tmp_path):
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained
    from models.mtp.config import MTPTraining
    from models.mtp.training import chain_acceptance, frozen_states, train_mtp_module
    from tasks.mtp import _chain_evaluation

    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32"))
    sequences = _distilled_sequences(policy.tokenizer)
    hidden = frozen_states(policy, sequences, tmp_path, batch_size=3)
    assert [len(h) for h in hidden] == [len(ids) for ids, _ in sequences]
    before = {name: p.clone() for name, p in policy.model.named_parameters()}
    cfg = MTPTraining(epochs=6, batch_size=4, learning_rate=3e-3)
    module, history = train_mtp_module(policy, sequences, hidden, 2, cfg)
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())
    start = MTPModule(policy.model, MTPModuleConfig(2))
    assert any(not torch.equal(a, b) for a, b in zip(start.state_dict().values(), module.state_dict().values()))
    assert history["loss"][-1] < history["loss"][0]
    assert len(history["ce_depth_1"]) == len(history["loss"]) == 6 * 2
    # eight copies of one response, in batches of 3, 3 and 2: the same counts for each, padding or not
    acceptance = chain_acceptance(policy, module, sequences, hidden, batch_size=3)
    response_tokens = sum(sequences[0][1])  # every depth's target lies inside it
    chains = response_tokens - 2  # cycles whose root is a decoded token and whose 2 drafts have targets
    assert acceptance.targets.tolist() == [[response_tokens] * 2] * 8
    assert acceptance.positions.tolist() == [chains] * 8
    assert (acceptance.hits == acceptance.hits[0]).all() and (acceptance.accepted == acceptance.accepted[0]).all()
    assert acceptance.accepted[0] <= 2 * chains
    evaluation = _chain_evaluation(acceptance)
    assert evaluation["top1_depth_1"] == pytest.approx(float(acceptance.hits[0, 0] / response_tokens))
    assert evaluation["expected_tau"] == pytest.approx(1 + float(acceptance.accepted[0] / chains))
    assert evaluation["expected_acceptance_rate"] == pytest.approx((evaluation["expected_tau"] - 1) / 2)
    assert evaluation["expected_tau_low"] == pytest.approx(evaluation["expected_tau"])  # identical responses
    assert (evaluation["positions"], evaluation["responses"]) == (8 * chains, 8)
    # a draft vocabulary without the response's tokens: no top-1 can hit; with only them, more do
    response = sorted({t for t, counted in zip(*sequences[0], strict=True) if counted})
    others = torch.tensor(sorted(set(range(policy.model.config.vocab_size)) - set(response)))
    module.draft_vocab = others
    assert chain_acceptance(policy, module, sequences, hidden).hits.sum() == 0
    module.draft_vocab = torch.tensor(response)
    among_response_tokens = chain_acceptance(policy, module, sequences, hidden).hits
    assert (among_response_tokens >= acceptance.hits).all() and among_response_tokens.sum() > acceptance.hits.sum()


def test_equip_training_stops_on_the_validation_loss_and_keeps_the_best_module(tiny_llama, tmp_path):
    """With validation sequences the epochs are a budget: one held-out loss per epoch run, training stops after
    ``patience`` epochs without a new best, and the returned module's validation loss (eq. 1 recomputed here in one
    batch) is the best recorded one — the best epoch's weights, not the last epoch's."""
    import pandas as pd

    from models.common.sequences import padding_id, right_pad, sft_sequences
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained
    from models.mtp.config import MTPTraining
    from models.mtp.module import mtp_cross_entropy
    from models.mtp.training import depth_weights, frozen_states, train_mtp_module

    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32"))
    sequences = _distilled_sequences(policy.tokenizer)
    prompt = "<|im_start|>user\nIvy has 3 cookies.<|im_end|>\n<|im_start|>assistant\n"
    validation = sft_sequences(policy.tokenizer, pd.DataFrame({"prompt": [prompt] * 3, "response": [
        "Ivy has 3 cookies and eats 1.", "The answer is 2.", "She has 2 cookies left."]}))
    hidden = frozen_states(policy, sequences, tmp_path / "train", batch_size=3)
    validation_hidden = frozen_states(policy, validation, tmp_path / "validation", batch_size=3)
    # a rate high enough to overshoot: the validation loss rises after a few epochs
    cfg = MTPTraining(epochs=12, batch_size=4, learning_rate=3e-2, patience=2, warmup_ratio=0.0)
    module, history = train_mtp_module(policy, sequences, hidden, 2, cfg, held_out=(validation, validation_hidden))
    losses, best_epoch = history["held_out_loss"], history["best_epoch"][0]
    assert len(losses) < 12 and len(history["loss"]) == 2 * len(losses)  # stopped early, 2 batches per epoch
    assert losses[best_epoch - 1] == min(losses) and len(losses) == best_epoch + 2
    batch = right_pad(validation, padding_id(policy.tokenizer))
    batch["hidden"] = torch.nn.utils.rnn.pad_sequence(list(validation_hidden), batch_first=True)
    with torch.no_grad():
        states = module(policy.model, batch["input_ids"], batch["hidden"])
        loss, _ = mtp_cross_entropy(policy.model, states, batch["input_ids"], batch["response_mask"],
                                    depth_weights(cfg.ce_weights, 2))
    assert float(loss) == pytest.approx(min(losses), rel=1e-5)


def test_chain_acceptance_counts_each_response_alone(tiny, tiny_llama, tmp_path):
    """Per-response counts of a batch with padding equal each response's counted alone; on the model's own greedy
    continuations (n response tokens after a prompt longer than K + 1) every depth has n targets, and n − K positions
    start a full chain: a cycle's root is a decoded token (the prefill decides the first, which no draft targets) and
    its K drafts' targets exist; the perturbed module's drafts are sometimes right."""
    from transformers import AutoTokenizer

    from models.engine.policy import Policy
    from models.mtp.training import chain_acceptance, frozen_states

    model, prompts = tiny
    policy = Policy(model, AutoTokenizer.from_pretrained(tiny_llama), torch.device("cpu"), "spiky")
    module = perturbed_module(model, 2, scale=0.05)
    sequences = []
    for ids, n in zip(prompts, (24, 12, 3), strict=True):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)[0]
        sequences.append((out.tolist(), [0] * ids.shape[1] + [1] * n))
    hidden = frozen_states(policy, sequences, tmp_path, batch_size=2)
    batched = chain_acceptance(policy, module, sequences, hidden, batch_size=2)
    alone = [chain_acceptance(policy, module, [sequences[i]], hidden.select([i])) for i in range(3)]
    for counts in ("hits", "targets", "accepted", "positions"):
        assert torch.equal(getattr(batched, counts), torch.cat([getattr(a, counts) for a in alone])), counts
    assert batched.targets.tolist() == [[24, 24], [12, 12], [3, 3]] and batched.positions.tolist() == [22, 10, 1]
    assert batched.accepted.sum() > 0 and (batched.hits <= batched.targets).all()
    assert (batched.accepted <= 2 * batched.positions).all()


def test_held_out_chain_evaluation_by_hand():
    """Two responses: depth 1 hits 1 of 2 and 3 of 4 targets, depth 2 2 of 2 and none of 2; the greedy chain
    accepts 2 drafts over 2 positions and 1 over 2. Accuracies and τ are ratios of sums (4/6, 2/4, 1 + 3/4); a
    resample of two responses is AA, AB or BB, each at least ¼ likely, so τ's 95 % interval runs from BB's 1.5 to
    AA's 2, and α = (τ − 1) / K's from 0.25 to 0.5."""
    from models.mtp.training import ChainAcceptance
    from tasks.mtp import _chain_evaluation

    evaluation = _chain_evaluation(ChainAcceptance(
        hits=torch.tensor([[1.0, 2.0], [3.0, 0.0]]), targets=torch.tensor([[2.0, 2.0], [4.0, 2.0]]),
        accepted=torch.tensor([2.0, 1.0]), positions=torch.tensor([2.0, 2.0])))
    assert evaluation["top1_depth_1"] == pytest.approx(4 / 6) and evaluation["top1_depth_2"] == pytest.approx(0.5)
    assert [evaluation[f"expected_tau{end}"] for end in ("", "_low", "_high")] == [1.75, 1.5, 2]
    assert (evaluation["expected_acceptance_rate_low"], evaluation["expected_acceptance_rate_high"]) == (0.25, 0.5)
    assert (evaluation["positions"], evaluation["responses"]) == (4, 2)
    empty = _chain_evaluation(ChainAcceptance(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.zeros(1)))
    assert math.isnan(empty["top1_depth_1"]) and math.isnan(empty["expected_tau"])


def test_frozen_states_stream_from_disk_in_the_policy_dtype(tiny_llama, tmp_path):
    """The equip stage's cache of the frozen policy's states lives on disk in the policy's dtype (it once lived in
    RAM in float32: ~200 GB for an 8B policy's data) and reads back exactly what a forward gives."""
    from safetensors import safe_open

    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained
    from models.mtp.training import frozen_states

    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="bfloat16"))
    sequences = _distilled_sequences(policy.tokenizer, 5)
    hidden = frozen_states(policy, sequences, tmp_path, batch_size=2)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 3  # batches of 2, 2 and 1
    with safe_open(files[0], framework="pt") as first:
        assert first.get_slice("0").get_dtype() == "BF16"
    ids = torch.tensor([sequences[3][0]])
    with torch.no_grad():
        direct = policy.model(ids, output_hidden_states=True).hidden_states[-1][0]
    assert hidden[3].dtype == torch.bfloat16
    torch.testing.assert_close(hidden[3], direct)
    chosen = hidden.select([4, 1])
    assert len(chosen) == 2 and torch.equal(chosen[1], hidden[1]) and torch.equal(chosen[0], hidden[4])


def test_equip_training_in_bfloat16(tiny_llama, tmp_path):
    """A bf16 policy: the module is made in bf16, trains (float32 master weights inside the loop), comes back and
    is saved in bf16, and drafts for MTP decoding (greedy and speculative sampling) without a dtype error."""
    from safetensors import safe_open

    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained
    from models.mtp.config import MTPTraining
    from models.mtp.training import chain_acceptance, frozen_states, train_mtp_module

    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cpu", dtype="bfloat16"))
    sequences = _distilled_sequences(policy.tokenizer)
    hidden = frozen_states(policy, sequences, tmp_path / "states")
    start = MTPModule(policy.model, MTPModuleConfig(2))
    module, history = train_mtp_module(policy, sequences, hidden, 2, MTPTraining(epochs=2, batch_size=4))
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(start.state_dict().values(), module.state_dict().values()))
    assert all(math.isfinite(loss) for loss in history["loss"])
    assert chain_acceptance(policy, module, sequences, hidden).positions.sum() > 0
    module.save(tmp_path / "module")
    with safe_open(tmp_path / "module" / "mtp.safetensors", framework="pt") as saved:
        names = saved.keys()  # a safetensors handle, not a dict: it has no __iter__
        assert {saved.get_slice(name).get_dtype() for name in names} == {"BF16"}
    ids = torch.tensor([sequences[0][0][:6]])
    stats = SpeculativeStats()
    assert len(mtp_generate(policy.model, policy.model, module, ids, 8, set(), 0.0, stats=stats)) == 8
    generator = torch.Generator().manual_seed(0)
    assert len(mtp_generate(policy.model, policy.model, module, ids, 8, set(), 0.8, generator, stats)) == 8
    assert stats.drafted_tokens > 0


def test_module_round_trips_through_save_and_load(tiny, tmp_path):
    model, _ = tiny
    module = perturbed_module(model, 3)
    module.save(tmp_path / "module")
    loaded = MTPModule.load(tmp_path / "module", model)
    assert loaded.config == module.config
    for (name, a), b in zip(module.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="train_mtp"):
        MTPModule.load(tmp_path / "nothing", model)


OPEN_PROMPTS = {"Write a haiku about autumn.": None, "Describe a quiet harbour at dawn.": None}


@pytest.fixture
def scored(monkeypatch) -> list[tuple]:
    """Every call of the score method of the labelers the stage builds: (questions, responses, answers, scores)."""
    import tasks.mtp

    calls, build = [], tasks.mtp.build_labeler

    def building(spec):
        labeler = build(spec)
        score = labeler.score

        def recording(questions, responses, answers, **kwargs):
            scores = score(questions, responses, answers, **kwargs)
            calls.append((list(questions), list(responses), list(answers), scores))
            return scores

        labeler.score = recording
        return labeler

    monkeypatch.setattr(tasks.mtp, "build_labeler", building)
    return calls


def _mean(values) -> float:
    return sum(values) / len(values)


def test_rl_stage_rewarded_by_a_reward_model_uses_prompts_without_answers(tiny_llama, tiny_classifier, tmp_path,
                                                                          scored):
    """label.labeler hf-classifier: GRPO on open prompts (no answers) rewarded by the reward model, whose scores
    also make the held-out reward before / after (the means of its calls on the held-out greedy responses); held-out
    accuracy left out (one held-out prompt has no answer): absent from the metrics and history, NaN in the table.
    The report names the reward model. The verifiable labeler on the same prompts fails, naming the missing
    answers."""
    import json

    import pandas as pd

    label = {"labeler": "hf-classifier", "model": str(tiny_classifier), "device": "cpu"}
    held_out = {"What is 2 + 3?": "5", **OPEN_PROMPTS}
    cfg = rl_stage(tmp_path / "rm", tiny_llama, OPEN_PROMPTS, held_out, label=label,
                   mtp_rl={"variants": ["vanilla", "mtp_rl"], "rollout_batch_size": 1,  # 2 units
                           "curve_batch_sizes": [1, 2], "curve_batches": 2})
    result = run_rl_stage(cfg)
    out = cfg.path(cfg.paths.mtp_rl_dir)
    history = json.loads((out / "history.json").read_text())
    m = result.metrics
    # held out before; per variant its GRPO step (G = 2 rollouts of one prompt) and held out after
    assert len(scored) == 5
    for call in scored[0::2]:
        assert call[0] == list(held_out)[:2] and call[2] == ["5", None]  # eval_prompts: 2
    for call in scored[1::2]:
        assert call[0] in ([question] * 2 for question in OPEN_PROMPTS) and call[2] == [None, None]
    assert m["reward_before"] == _mean(scored[0][3]) == history["reward_before"]
    assert m["vanilla.reward_after"] == _mean(scored[2][3]) and m["mtp_rl.reward_after"] == _mean(scored[4][3])
    assert history["variants"]["vanilla"][0]["reward"] == pytest.approx(_mean(scored[1][3]), abs=1e-6)
    assert result.curves["mtp_rl.per_step.reward"] == [pytest.approx(_mean(scored[3][3]), abs=1e-6)]
    assert not set(scored[3][3]) <= {0.0, 1.0}  # real-valued scores
    assert not [key for key in m if "accuracy" in key]
    assert (history["labeler"], history["label_model"]) == ("hf-classifier", str(tiny_classifier))
    assert history["reward_after"] == {"vanilla": m["vanilla.reward_after"], "mtp_rl": m["mtp_rl.reward_after"]}
    assert "accuracy_before" not in history and "accuracy_after" not in history
    table = pd.read_csv(out / "table.csv").set_index("variant")
    assert table["accuracy_before"].isna().all() and table["accuracy_after"].isna().all()
    assert table.loc["mtp_rl", "reward_after"] == pytest.approx(m["mtp_rl.reward_after"], abs=1e-12)
    # per prompt in history.json; means with intervals over the two held-out prompts in the table and the metrics
    assert history["held_out_per_prompt"]["after"]["mtp_rl"]["reward"] == scored[4][3]
    assert table.loc["mtp_rl", "reward_after_low"] == m["mtp_rl.reward_after_low"] == min(scored[4][3])
    assert table.loc["mtp_rl", "reward_change"] == pytest.approx(_mean(scored[4][3]) - _mean(scored[0][3]))
    assert m["mtp_rl.tau_pooled_low"] <= m["mtp_rl.tau_pooled"] <= m["mtp_rl.tau_pooled_high"]
    assert "mtp_rl.rollout_speedup_high" in m
    # one step: τ of the first and last steps is the run's; tokens per target forward, 1 for plain sampling
    assert m["mtp_rl.tau_start"] == m["mtp_rl.tau_end"] == m["mtp_rl.tau_pooled"]
    assert m["vanilla.tokens_per_forward"] == 1.0 and m["mtp_rl.tokens_per_forward"] >= 1.0
    assert "mtp_rl.tokens_per_forward_high" in m and (m["rl_prompts_kept"], m["rl_prompts_dropped"]) == (2, 0)
    assert result.curves["mtp_rl.per_step.nonzero_advantage_share"] == [m["mtp_rl.nonzero_advantage_share"]]
    assert (out / "nonzero_advantage_share.png").is_file()
    # the rollout speed curve before RL: vanilla (its tokens/s) and MTP drafting (speedup over it) per batch size
    curve = pd.read_csv(out / "rollout_curve.csv")
    assert list(zip(curve["batch"], curve["decoder"], strict=True)) == [(b, d) for b in (1, 2)
                                                                        for d in ("vanilla", "mtp")]
    mtp = curve[curve["decoder"] == "mtp"]
    assert (mtp["speedup_vs_reference_low"] <= mtp["speedup_vs_reference_high"]).all()
    assert mtp["tokens_per_forward"].notna().all() and curve.loc[curve["decoder"] == "vanilla",
                                                                 "speedup_vs_reference"].isna().all()
    assert m["rollout_curve.mtp.batch2.speedup_vs_reference"] == pytest.approx(
        mtp.set_index("batch").loc[2, "speedup_vs_reference"])
    assert m["rollout_curve.mtp.batch2.speedup_vs_reference_low"] <= m["rollout_curve.mtp.batch2.speedup_vs_reference"]
    # greedy decoding of the held-out prompts: greedy-verified MTP drafting equals HF batched greedy (float32)
    decoding = pd.read_csv(out / "decoding_curve.csv")
    assert list(zip(decoding["batch"], decoding["decoder"], strict=True)) == [(b, d) for b in (1, 2)
                                                                              for d in ("greedy", "mtp")]
    assert (decoding.loc[decoding["decoder"] == "mtp", "identical_to_reference"] == 1.0).all()
    assert "decoding_curve.mtp.batch1.speedup_vs_reference_high" in m
    assert "## MTP drafting against batch size" in (out / "report.md").read_text()
    assert (out / "speed_curve.png").is_file()
    assert f"hf-classifier `{tiny_classifier}`" in (out / "report.md").read_text()

    verifiable = rl_stage(tmp_path / "verifiable", tiny_llama, OPEN_PROMPTS, OPEN_PROMPTS)
    with pytest.raises(ValueError, match="no train prompt has a known answer"):
        run_rl_stage(verifiable)


def test_rl_stage_with_the_verifiable_labeler_leaves_out_prompts_without_answers(tiny_llama, tmp_path, scored):
    """label.labeler verifiable: prompts without an answer are left out of training and the held-out set, and the
    held-out reward is the accuracy."""
    cfg = rl_stage(tmp_path, tiny_llama, {"Write a haiku about autumn.": None, "What is 2 + 3?": "5"},
                   {"What is 4 * 2?": "8", "Describe a quiet harbour at dawn.": None, "What is 9 - 7?": "2"},
                   mtp_rl={"variants": ["vanilla"]})
    m = run_rl_stage(cfg).metrics
    assert [(call[0], call[2]) for call in scored] == [
        (["What is 4 * 2?", "What is 9 - 7?"], ["8", "2"]), (["What is 2 + 3?"] * 2, ["5"] * 2),
        (["What is 4 * 2?", "What is 9 - 7?"], ["8", "2"])]
    assert m["reward_before"] == _mean(scored[0][3]) == m["accuracy_before"]
    assert m["vanilla.reward_after"] == _mean(scored[2][3]) == m["vanilla.accuracy_after"]


def _rollout(seconds: float, tokens: int, cycles: int = 0, cycle_tokens: int = 0, drafted: int = 0,
             accepted: int = 0, forwards: int | None = None) -> dict:
    """A rollout batch's counters; ``forwards`` default: one per token (plain sampling)."""
    return {"seconds": seconds, "tokens": tokens, "cycles": cycles, "cycle_tokens": cycle_tokens, "drafted": drafted,
            "accepted": accepted, "forwards": tokens if forwards is None else forwards}


def _record(step: int, rollouts: list[dict], nonzero_advantage_share: float = 1.0) -> dict:
    """A step's record of :func:`models.mtp.rl.step_record`, as far as the summary reads it."""
    cycles = sum(r["cycles"] for r in rollouts) or sum(r["tokens"] for r in rollouts)
    return {"step": step, "rollout_seconds": sum(r["seconds"] for r in rollouts),
            "rollout_tokens": sum(r["tokens"] for r in rollouts), "cycles": cycles, "tau": 1.0, "reward": 0.5,
            "nonzero_advantage_share": nonzero_advantage_share, "rollouts": rollouts}


def test_rl_summary_intervals_by_hand():
    """One step of two rollouts per variant. Vanilla: 10 tokens in 1 s and 10 in 2 s; MTP-RL: 10 tokens in 1 s
    (5 cycles, 5 of 15 drafts accepted) and 30 in 1 s (10 cycles, 20 of 30). Speedup (40 / 2) / (20 / 3) = 3; a
    paired resample is rollout 1 twice (10/1 over 10/1 = 1), rollout 2 twice (30/1 over 10/2 = 6) or both (3), so
    the interval is [1, 6], which does not exclude 1. τ = 40 / 15 over [2, 3], α = 25 / 45 over [1/3, 2/3]. Held
    out on two prompts: rewards 0, 0 before; 1, 1 after MTP-RL (a change of 1 on both: significant), 0, 1 after
    vanilla (½, over [0, 1]: not); accuracy unknown."""
    from tasks.mtp import _summary

    histories = {"vanilla": [_record(1, [_rollout(1, 10), _rollout(2, 10)])],
                 "mtp_rl": [_record(1, [_rollout(1, 10, 5, 10, 15, 5, forwards=6),
                                        _rollout(1, 30, 10, 30, 30, 20, forwards=11)])]}
    rows = _summary(histories, {"vanilla": False, "mtp_rl": True}, {"reward": [0.0, 0.0]},
                    {"vanilla": {"reward": [0.0, 1.0]}, "mtp_rl": {"reward": [1.0, 1.0]}}, False, 5)
    vanilla, mtp = rows

    def interval(row: dict, key: str) -> list[float]:
        return [row[key + end] for end in ("", "_low", "_high")]

    assert interval(mtp, "rollout_speedup") == pytest.approx([3.0, 1.0, 6.0])
    assert not mtp["rollout_speedup_significant"]
    assert interval(mtp, "tau_pooled") == pytest.approx([40 / 15, 2.0, 3.0])
    assert interval(mtp, "acceptance_rate_pooled") == pytest.approx([25 / 45, 1 / 3, 2 / 3])
    # 40 tokens in 17 forwards (each row's prefill and cycles), 20 / 6 over [10 / 6, 30 / 11]; plain sampling: 1
    assert interval(mtp, "tokens_per_forward") == pytest.approx([40 / 17, 10 / 6, 30 / 11])
    assert interval(vanilla, "tokens_per_forward") == [1.0, 1.0, 1.0]
    # one step: the first and last windows are that step
    assert mtp["tau_window"] == 1 and interval(mtp, "tau_start") == interval(mtp, "tau_end") == interval(
        mtp, "tau_pooled")
    assert mtp["break_even_tau"] == pytest.approx((1000 * 2 / 15) / (1000 * 3 / 20))
    assert interval(vanilla, "tau_pooled") == [1.0, 1.0, 1.0] and interval(vanilla, "rollout_speedup") == [1.0, 1.0, 1.0]
    assert interval(mtp, "reward_change") == [1.0, 1.0, 1.0] and mtp["reward_after_significant"]
    assert interval(vanilla, "reward_after") == interval(vanilla, "reward_change") == [0.5, 0.0, 1.0]
    assert not vanilla["reward_after_significant"] and math.isnan(mtp["accuracy_change"])
    # adaptive drafting: the rollout time includes plain steps that no cycle counts, so a cycle's time is unknown
    vanilla, mtp = _summary(histories, {"vanilla": False, "mtp_rl": True}, {"reward": [0.0, 0.0]},
                            {"vanilla": {"reward": [0.0, 1.0]}, "mtp_rl": {"reward": [1.0, 1.0]}}, True, 5)
    assert math.isnan(mtp["ms_per_cycle"]) and math.isnan(mtp["break_even_tau"])
    assert vanilla["ms_per_cycle"] == 1000 * 3 / 20 and vanilla["break_even_tau"] == 1.0


def test_rl_summary_tau_over_the_first_and_last_steps_by_hand():
    """Two steps of two rollout batches (10 cycles each) per variant, ``tau_window`` 5 cut to half the steps (1).
    MTP-RL: 20 + 20 tokens in step 1 (τ 2), 30 + 20 in step 2 (τ 2.5 over [2, 3]); τ_end / τ_start = 1.25 over
    [1, 1.5] (the start window constant): it held. Frozen: 20 + 20, then 15 + 15 (τ 1.5): it fell, significantly.
    MTP-RL's τ_end over the frozen module's, batch by batch: 2.5 / 1.5 = 5 / 3 over [20 / 15, 30 / 15]. Mixed
    groups: 1 and ½ of the groups (mean ¾ over [½, 1])."""
    from tasks.mtp import _summary

    def step(number: int, cycle_tokens: list[int], share: float) -> dict:
        return _record(number, [_rollout(1, t, 10, t, 30, t - 10, forwards=11) for t in cycle_tokens], share)

    histories = {"mtp_rl": [step(1, [20, 20], 1.0), step(2, [30, 20], 0.5)],
                 "frozen_mtp": [step(1, [20, 20], 1.0), step(2, [15, 15], 0.5)]}
    held_out = {"reward": [0.0, 1.0]}
    mtp, frozen = _summary(histories, {"mtp_rl": True, "frozen_mtp": True}, held_out,
                           {"mtp_rl": held_out, "frozen_mtp": held_out}, True, 5)

    def interval(row: dict, key: str) -> list[float]:
        return [row[key + end] for end in ("", "_low", "_high")]

    assert mtp["tau_window"] == 1
    assert interval(mtp, "tau_start") == [2.0, 2.0, 2.0] and interval(mtp, "tau_end") == pytest.approx([2.5, 2.0, 3.0])
    assert interval(mtp, "tau_end_over_start") == pytest.approx([1.25, 1.0, 1.5])
    assert not mtp["tau_end_over_start_significant"]
    assert interval(frozen, "tau_end_over_start") == pytest.approx([0.75, 0.75, 0.75])
    assert frozen["tau_end_over_start_significant"]
    assert interval(mtp, "tau_end_vs_frozen_mtp") == pytest.approx([5 / 3, 4 / 3, 2.0])
    assert mtp["tau_end_vs_frozen_mtp_significant"]
    assert interval(mtp, "nonzero_advantage_share") == pytest.approx([0.75, 0.5, 1.0])
    assert math.isnan(mtp["rollout_speedup"])  # no vanilla run


def test_spread_prompts_keep_exactly_those_with_a_pass_rate_strictly_between_0_and_1():
    """A label stage's table, 4 samples per prompt: pass rates ¼ and ¾ are kept; 0, 1 and a prompt never sampled
    are not. Real-valued scores (a reward model): kept when they differ at all."""
    import pandas as pd

    from tasks.mtp import _spread_prompts

    prompts = pd.DataFrame({"prompt_id": ["quarter", "none", "all", "three", "unsampled", "rm_flat", "rm_spread"],
                            "question": list("abcdefg")})
    scores = scores_table({"quarter": [1.0, 0.0, 0.0, 0.0], "none": [0.0] * 4, "all": [1.0] * 4,
                           "three": [1.0, 1.0, 0.0, 1.0], "rm_flat": [0.3] * 4, "rm_spread": [0.3, 0.3, 0.31, 0.3]})
    pass_rates = scores.dropna(subset=["correct"]).groupby("prompt_id")["correct"].mean()
    assert pass_rates.to_dict() == {"all": 1.0, "none": 0.0, "quarter": 0.25, "three": 0.75}
    kept = _spread_prompts(prompts, scores)
    assert kept["prompt_id"].tolist() == ["quarter", "three", "rm_spread"]
    assert kept["question"].tolist() == ["a", "d", "g"]  # the prompts' own rows, in their order


def test_rl_stage_draws_its_prompts_from_those_with_a_reward_spread(tiny_llama, tmp_path, scored):
    """prompt_filter spread (the default): of two training prompts, the one whose label-stage samples all failed is
    left out (kept 1, dropped 1 in the metrics); with none left, an error naming the setting; ``all`` uses both."""
    train = {"What is 2 + 3?": "5", "What is 4 * 2?": "8"}
    held_out = {"What is 9 - 7?": "2"}
    flat = {"What is 2 + 3?": [0.0, 0.0, 0.0, 0.0], "What is 4 * 2?": [1.0, 0.0, 0.0, 1.0]}
    one_step = {"variants": ["vanilla"], "steps": 1, "curve_batch_sizes": []}
    m = run_rl_stage(rl_stage(tmp_path / "spread", tiny_llama, train, held_out, flat, mtp_rl=one_step)).metrics
    assert (m["rl_prompts_kept"], m["rl_prompts_dropped"]) == (1, 1)
    assert scored[1][0] == ["What is 4 * 2?"] * 2  # the step's rollouts (held out before, then the step)
    assert 0.0 <= m["vanilla.nonzero_advantage_share"] <= 1.0
    every = rl_stage(tmp_path / "all", tiny_llama, train, held_out, flat, mtp_rl={**one_step, "steps": 2,
                                                                                  "prompt_filter": "all"})
    assert run_rl_stage(every).metrics["rl_prompts_kept"] == 2
    none = rl_stage(tmp_path / "none", tiny_llama, train, held_out, {q: [0.0] * 4 for q in train}, mtp_rl=one_step)
    with pytest.raises(ValueError, match="prompt_filter spread: 0 of 2 training prompts qualify"):
        run_rl_stage(none)


def test_rl_stage_calibrates_an_auto_dynamic_tree_budget_once(tiny_llama, tmp_path, scored):
    """``mtp_rl.dynamic_tree.budget: auto``: the budget and depth are calibrated once, at the stage's start, on the
    training prompts (:func:`models.mtp.dynamic_tree.resolved_tree`), and every drafting variant's rollouts draft
    trees of them."""
    import models.mtp.rl
    import tasks.mtp
    from models.mtp import dynamic_tree

    calibrations, budgets = [], []

    def calibrated(*args):
        calibrations.append(args)
        return dynamic_tree.resolved_tree(*args)

    def drafter(base, module, shape, budget):
        budgets.append((shape.budget, shape.depth, budget))
        return dynamic_tree.MTPBatchTreeDrafter(base, module, shape, budget)

    cfg = rl_stage(tmp_path, tiny_llama, {"What is 2 + 3?": "5", "What is 4 * 2?": "8"}, {"What is 9 - 7?": "2"},
                   mtp_rl={"variants": ["mtp_rl", "frozen_mtp"], "steps": 1, "curve_batch_sizes": [],
                           "dynamic_tree": {"depth": 3, "top_k": 2, "frontier": 2, "calibration_prompts": 1}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks.mtp, "resolved_tree", calibrated)
        mp.setattr(models.mtp.rl, "MTPBatchTreeDrafter", drafter)  # the rollouts' drafter
        m = run_rl_stage(cfg).metrics
    assert len(calibrations) == 1  # once, for every variant
    budget, depth = m["dynamic_tree.budget"], m["dynamic_tree.depth"]
    assert budget in {3, 7, 10} and depth in {1, 2, 3}  # pool 10: widths 4, 8, 11
    assert m["dynamic_tree.budget_expected_speedup"] > 0
    assert budgets and set(budgets) == {(budget, depth, budget)}  # every rollout batch of both variants: the calibrated


def test_rl_config_fields_validate():
    """The MTP-RL section's new fields: the prompt filter's two values, groups of at least 2, a window of a step
    or more; the defaults draw from prompts with a spread in groups of 8."""
    from foresight.config import ConfigError, parse_config
    from models.mtp.config import MTPRLConfig

    defaults = MTPRLConfig()
    assert (defaults.prompt_filter, defaults.group_size) == ("spread", 8)
    for bad in ({"prompt_filter": "some"}, {"group_size": 1}, {"tau_window": 0}):
        with pytest.raises(ConfigError, match=f"mtp_rl.{next(iter(bad))}"):
            parse_config({"mtp_rl": bad})
    assert parse_config({"mtp_rl": {"prompt_filter": "all", "tau_window": 3}}).mtp_rl.tau_window == 3


class _Handed(Exception):
    """Stops a stage where it hands its config to the model code."""


def test_params_keys_reach_the_components_the_stages_hand_on(tiny_llama, tmp_path, monkeypatch):
    """No silent fall-through: the ``mtp`` section is an :class:`MTPTraining` and ``mtp_rl`` an
    :class:`MTPRLTraining`, and the stages hand the model code the sections themselves, so params keys naming a
    component's fields reach it: ``mtp.patience`` and ``mtp.num_depths`` the equip training
    (``train_mtp_module``), ``mtp_rl.beta`` and ``mtp_rl.adaptation.probe_every`` / ``cycle_cost`` the GRPO run
    (``train_variant``: its variant's CE weight and its drafted rollouts' decision rule)."""
    from prefect.logging import disable_run_logger

    from foresight.storage import write_table
    import tasks.mtp
    from models.mtp import rl
    from models.mtp.config import MTPConfig, MTPRLConfig, MTPRLTraining, MTPTraining
    from tasks.mtp import train_mtp_task

    assert issubclass(MTPConfig, MTPTraining) and issubclass(MTPRLConfig, MTPRLTraining)
    train = {"What is 2 + 3?": "5", "What is 4 + 1?": "5"}
    cfg = rl_stage(tmp_path, tiny_llama, train, {"What is 1 + 1?": "2"},
                   mtp={"data": "correct", "patience": 3, "num_depths": 3},
                   mtp_rl={"beta": 0.5, "curve_batch_sizes": [], "variants": ["mtp_rl"],
                           "adaptation": {"probe_every": 5, "max_probe_every": 20, "cycle_cost": 1.5}})
    # samples of six prompts, each scored 1 (correct) and 0: the equip stage learns from the correct ones
    table = scores_table({f"train{i}": [1.0, 0.0] for i in range(6)})
    table["prompt"] = [f"Question {row}: what is {row} + 1?" for row in table["prompt_id"]]
    table["response"] = ["The answer is one more.", "I do not know."] * 6
    write_table(table, cfg.path(cfg.paths.scores))
    handed = {}

    def stop(name):
        def hand(*args, **kwargs):
            handed[name] = args
            raise _Handed
        return hand

    monkeypatch.setattr(tasks.mtp, "train_mtp_module", stop("equip"))
    monkeypatch.setattr(tasks.mtp, "train_variant", stop("rl"))
    with disable_run_logger(), pytest.raises(_Handed):
        train_mtp_task.fn(cfg)
    num_depths, equip = handed["equip"][3:5]  # (policy, sequences, hidden, num_depths, cfg, …)
    assert isinstance(equip, MTPTraining) and (equip.patience, num_depths) == (3, 3)
    with pytest.raises(_Handed):
        run_rl_stage(cfg)
    grpo = handed["rl"][7]  # (policy, module, variant, prompts, questions, answers, reward_fn, cfg, …)
    assert isinstance(grpo, MTPRLTraining) and grpo.beta == 0.5
    assert rl.variant("mtp_rl", grpo).ce_weight == 0.5
    rule = rl.rollout_drafting(grpo).adaptation
    assert (rule.probe_every, rule.max_probe_every, rule.cycle_cost, rule.window) == (5, 20, 1.5, 8)


@pytest.mark.cuda
def test_mtp_equip_and_decoding_on_cuda_in_bfloat16(tiny_llama, tmp_path):
    """On the GPU with a bf16 policy: the frozen states, an equip training run (the module made, trained and
    returned on the GPU in bf16), greedy MTP decoding and speculative sampling with a CUDA generator."""
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained
    from models.mtp.config import MTPTraining
    from models.mtp.training import frozen_states, train_mtp_module

    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cuda", dtype="bfloat16"))
    sequences = _distilled_sequences(policy.tokenizer)
    hidden = frozen_states(policy, sequences, tmp_path)
    start = MTPModule(policy.model, MTPModuleConfig(2))
    module, _ = train_mtp_module(policy, sequences, hidden, 2, MTPTraining(epochs=1, batch_size=4))
    params = list(module.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params)
    assert any(not torch.equal(a, b) for a, b in zip(start.state_dict().values(), module.state_dict().values()))
    ids = torch.tensor([sequences[0][0][:6]], device="cuda")
    with torch.no_grad():
        first = int(policy.model(ids).logits[0, -1].argmax())
    stats = SpeculativeStats()
    tokens = mtp_generate(policy.model, *draft_parts(policy.model, module, torch.bfloat16), ids, 12, set(), 0.0,
                          stats=stats)
    # bf16 tree and sequential numerics may break ties differently after the first token: only it is asserted
    assert len(tokens) == 12 and tokens[0] == first and stats.drafted_tokens > 0
    generator = torch.Generator(device="cuda").manual_seed(0)
    sampled = mtp_generate(policy.model, policy.model, module, ids, 12, set(), 0.8, generator, SpeculativeStats())
    assert len(sampled) == 12


def test_data_curve_rows_are_nested_seeded_subsets():
    from tasks.mtp import data_curve_rows

    rows = torch.arange(100, 120)
    two, five = data_curve_rows(rows, 2, 0), data_curve_rows(rows, 5, 0)
    assert len(two) == 2 and len(five) == 5 and set(two.tolist()) <= set(five.tolist()) <= set(rows.tolist())
    assert torch.equal(five, five.sort().values) and torch.equal(data_curve_rows(rows, 5, 0), five)
    assert not torch.equal(data_curve_rows(rows, 5, 1), five)
    assert torch.equal(data_curve_rows(rows, 20, 0), rows)
    with pytest.raises(ValueError, match="21 training responses"):
        data_curve_rows(rows, 21, 0)


def test_equip_stage_data_curve_has_one_row_per_count_and_ends_with_the_main_module(tiny_llama, tmp_path):
    """``mtp.data_curve``: a module per count, trained on that many training responses, and the main module's
    point last — its held-out τ the stage's own ``held_out_expected_tau``; the table, plot and metrics."""
    import pandas as pd
    from prefect.logging import disable_run_logger

    from foresight.storage import write_table
    from tasks.mtp import train_mtp_task

    cfg = rl_stage(tmp_path, tiny_llama, {"What is 2 + 3?": "5"}, {"What is 1 + 1?": "2"},
                   mtp={"data": "correct", "epochs": 1, "batch_size": 2, "num_depths": 2, "data_curve": [2, 1]})
    table = scores_table({f"train{i}": [1.0, 1.0] for i in range(8)})
    table["prompt"] = [f"Question {row}: what is {row} + 1?" for row in table["prompt_id"]]
    table["response"] = ["The answer is one more.", "It is one more than that."] * 8
    write_table(table, cfg.path(cfg.paths.scores))
    with disable_run_logger():
        result = train_mtp_task.fn(cfg)
    curve = pd.read_csv(cfg.path(cfg.paths.mtp_dir) / "data_curve.csv")
    assert curve["train_responses"].tolist() == [1, 2, result.metrics["num_train_sequences"]]
    assert curve["all_expected_tau"].iloc[-1] == pytest.approx(result.metrics["held_out_expected_tau"])
    assert curve["all_top1_depth_1"].iloc[-1] == pytest.approx(result.metrics["held_out_top1_depth_1"])
    assert result.metrics["data_curve_1_all_expected_tau"] == pytest.approx(curve["all_expected_tau"].iloc[0])
    assert (cfg.path(cfg.paths.mtp_dir) / "data_curve.png").is_file()
