"""COrAL: target-aware RoPE against ordinary forwards, corruption statistics, losses by hand, two-stage
training, and sliding blockwise decoding (eq. 5–8 by hand, termination, determinism); bf16, LoRA, two
processes and the GPU."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from foresight.config import load_config
from models.common.sequences import right_pad, sft_sequences
from models.coral.config import CoralDecoding, CoralTraining
from models.coral.decoding import (
    CoralStats,
    _Forward,
    _path_scores,
    _Prediction,
    candidate_choices,
    coral_generate,
    ensemble,
)
from models.coral.target_aware import (
    BACKWARD_OFFSETS,
    FORWARD_OFFSETS,
    backward_reconstruction_loss,
    corrupt,
    offset_cross_entropy,
    offset_targets,
    row_cross_entropy,
    target_aware,
    target_aware_logits,
    weighted_offset_loss,
)
from models.coral.training import (
    HELD_OUT_KEY,
    coral_step_loss,
    corrupt_batch,
    evaluated_offsets,
    offset_hits,
    stage_parameters,
    train_coral,
    trunk_cache,
)
from models.engine.config import PolicySpec
from models.engine.kv_cache import cache_kwargs
from models.engine.policy import load_pretrained
from models.engine.speculative import build_tree
from tests.helpers import distinct_sequences, tiny_params

VOCAB = 64
ROOT = Path(__file__).resolve().parent.parent


def _model(attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_offset_plus_one_is_the_next_token_logits(attn):
    model = _model(attn)
    ids = torch.randint(0, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        ours = target_aware_logits(model, ids, (1, 3, -2), attention_mask=mask)[:, 0]
    real = mask.bool()
    torch.testing.assert_close(ours[real], reference[real], rtol=0, atol=1e-5)


def test_multi_offset_logits_equal_single_offset_passes():
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 9))
    offsets = FORWARD_OFFSETS + BACKWARD_OFFSETS
    with torch.no_grad():
        together = target_aware_logits(model, ids, offsets)  # (B, O, T, V)
        for i, offset in enumerate(offsets):
            alone = target_aware_logits(model, ids, (offset,))[:, 0]
            torch.testing.assert_close(together[:, i], alone, rtol=0, atol=1e-5)


def test_offsets_change_the_prediction_and_the_model_is_restored():
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 8))
    last = model.model.layers[-1]
    with torch.no_grad():
        logits = target_aware_logits(model, ids, (1, 2))
    assert (logits[:, 0] - logits[:, 1]).abs().max() > 1e-3  # a different target position, a different query
    assert model.model.layers[-1] is last  # the swap lasts one call
    with pytest.raises(RuntimeError), target_aware(model, (1, 2)):
        assert model.model.layers[-1] is not last
        raise RuntimeError("inside")
    assert model.model.layers[-1] is last


def test_target_aware_forward_with_a_cache_equals_one_without():
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        full = target_aware_logits(model, ids, (1, 2, 0))
        cache = DynamicCache(config=model.config)
        model(ids[:, :7], **cache_kwargs(model, cache), use_cache=True)
        tail = target_aware_logits(model, ids[:, 7:], (1, 2, 0), cache=cache)
    torch.testing.assert_close(tail, full[:, :, 7:], rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 12  # the last layer cached ordinary keys/values once, not per offset


def test_corruption_statistics_match_the_configuration():
    generator = torch.Generator().manual_seed(0)
    length, start = 60, 10
    ids = torch.arange(length)  # distinct tokens: every changed position is visible
    sizes, corrupted_patches, total_patches, modes, changed = [], 0, 0, {"replace": 0, "repeat": 0}, 0
    for _ in range(2000):
        result = corrupt(ids, start, length, max_patch_size=4, ratio=0.25, replace_probability=0.5, generator=generator)
        assert torch.equal(result.input_ids[:start], ids[:start])  # the prompt is never touched
        assert result.num_patches == math.ceil((length - start) / result.patch_size)
        sizes.append(result.patch_size)
        corrupted_patches += len(result.patches)
        total_patches += result.num_patches
        for patch_start, size, mode in result.patches:
            modes[mode] += 1
            span = result.input_ids[patch_start : patch_start + size]
            if mode == "repeat":
                assert (span == ids[patch_start]).all()
            else:  # a same-length span from elsewhere in the response
                source = int(span[0])
                assert source != patch_start and start <= source <= length - size
                assert torch.equal(span, ids[source : source + size])
        changed += int(result.corrupted.sum())
        assert torch.equal(result.corrupted, result.input_ids != ids)
    assert set(sizes) == {1, 2, 3, 4} and all(abs(sizes.count(s) / len(sizes) - 0.25) < 0.04 for s in range(1, 5))
    assert abs(corrupted_patches / total_patches - 0.25) < 0.01
    assert abs(modes["replace"] / corrupted_patches - 0.5) < 0.02
    assert changed > 0


def test_corruption_edge_cases():
    ids = torch.tensor([1, 2, 3, 4])
    none = corrupt(ids, 2, 4, 4, ratio=0.0, replace_probability=0.5, generator=torch.Generator().manual_seed(0))
    assert not none.corrupted.any() and none.patches == ()
    for seed in range(6):  # every patch corrupted, always by replacement when another span exists
        result = corrupt(ids, 2, 4, max_patch_size=2, ratio=1.0, replace_probability=1.0,
                         generator=torch.Generator().manual_seed(seed))
        if result.patch_size == 2:  # the whole response is one patch: no other span, the first token repeats
            assert result.patches == ((2, 2, "repeat"),) and result.input_ids.tolist() == [1, 2, 3, 3]
        else:  # two 1-token patches, each copied from the other position
            assert result.input_ids.tolist() == [1, 2, 4, 3]


def test_offset_targets_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    response = torch.tensor([[0, 0, 1, 1, 1]])
    targets, valid = offset_targets(ids, response, (2, -1))
    assert targets[0, 0].tolist() == [12, 13, 14, 14, 14]  # clamped beyond the end, masked below
    assert valid[0, 0].tolist() == [True, True, True, False, False]  # m + 2 must be a response token
    assert targets[0, 1].tolist() == [10, 10, 11, 12, 13]
    assert valid[0, 1].tolist() == [False, False, False, True, True]  # m − 1 must be a response token


def test_offset_cross_entropy_by_hand():
    lm_head = torch.nn.Linear(2, 3, bias=False)
    lm_head.weight.data = torch.eye(3, 2)  # logits = (h0, h1, 0)
    hidden = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]], [[0.0, 2.0], [5.0, 5.0]]]])  # (B=1, O=2, T=2, H=2)
    targets = torch.tensor([[[0, 2], [1, 0]]])
    valid = torch.tensor([[[True, False], [True, False]]])
    per_offset, counts = offset_cross_entropy(hidden, lm_head, targets, valid)
    ce_a = -math.log(math.e / (math.e + 2))  # logits (1, 0, 0), target 0
    ce_b = -math.log(math.e**2 / (math.e**2 + 2))  # logits (0, 2, 0), target 1
    assert per_offset.tolist() == pytest.approx([ce_a, ce_b], abs=1e-6)
    assert counts.tolist() == [1, 1]
    weighted = weighted_offset_loss(per_offset, counts, torch.tensor([3.0, 1.0]))
    assert weighted.item() == pytest.approx((3 * ce_a + ce_b) / 4, abs=1e-6)
    # an offset without targets weighs nothing
    assert weighted_offset_loss(per_offset, torch.tensor([0.0, 1.0]), torch.tensor([3.0, 1.0])).item() == pytest.approx(ce_b)


def test_backward_loss_counts_only_corrupted_tokens_and_trains_only_the_last_layer():
    model = _model().train()
    clean = torch.randint(0, VOCAB, (1, 10))
    corrupted = clean.clone()
    corrupted[0, 6] = (clean[0, 6] + 1) % VOCAB
    changed = corrupted != clean
    per_offset, counts = backward_reconstruction_loss(model, corrupted, clean, torch.ones_like(clean), changed,
                                                      (-2, -1, 0))
    assert counts.tolist() == [1, 1, 1]  # position 6 from m = 8, 7, 6
    per_offset.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.layers[-1].parameters())
    assert all(p.grad is None for p in model.model.layers[0].parameters())  # detached below the last layer


def test_stage_parameters_split_the_model():
    model = _model()
    first, second = stage_parameters(model, 1), stage_parameters(model, 2)
    assert {id(p) for p in first} == {id(p) for p in model.model.layers[-1].parameters()}
    assert {id(p) for p in first} | {id(p) for p in second} == {id(p) for p in model.parameters()}
    assert not {id(p) for p in first} & {id(p) for p in second}


def test_two_stage_training_changes_the_right_parameters(tiny_llama):
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
    model = policy.model
    responses = pd.DataFrame({"prompt": ["<|im_start|>user\nBen has 4 apples<|im_end|>\n<|im_start|>assistant\n"] * 4,
                              "response": ["The answer is 6. Ivy has 3 cookies and gives 1 of them"] * 4})
    sequences = sft_sequences(policy.tokenizer, responses)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    last_names = {f"model.layers.{len(model.model.layers) - 1}.{n}" for n, _ in model.model.layers[-1].named_parameters()}

    only_stage1 = CoralTraining(stage1_epochs=2, stage2_epochs=0, batch_size=2, stage1_learning_rate=1e-2)
    history = train_coral(policy, sequences, only_stage1)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == last_names
    assert history["stage"] == [1] * 4 and history["loss"][-1] < history["loss"][0]
    assert set(history) >= {"ce_forward_1", "ce_forward_4", "ce_reconstruct_0", "ce_reconstruct_8"}
    assert any(not math.isnan(v) for v in history["ce_reconstruct_0"])  # corrupted tokens were reconstructed (not all NaN)

    after_stage1 = {name: p.detach().clone() for name, p in model.named_parameters()}
    only_stage2 = only_stage1.model_copy(update={"stage1_epochs": 0, "stage2_epochs": 1, "stage2_learning_rate": 1e-3})
    train_coral(policy, sequences, only_stage2)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, after_stage1[n])}
    assert changed and not changed & last_names


# ---------------------------------------------------------------------------------------------------------
# decoding


def test_ensemble_is_eq5_by_hand():
    settings = CoralDecoding(decay=0.5)
    a = torch.log_softmax(torch.tensor([2.0, 0.0, 0.0]), -1)
    b = torch.log_softmax(torch.tensor([0.0, 3.0, 0.0]), -1)
    # next-token (δ = 1): λ = 1; backward δ = −1: λ = 0.5² = 0.25; contexts' confidences 1 and 0.4
    pi = ensemble([_Prediction(1, a, 1.0), _Prediction(-1, b, 0.4)], settings)
    w = torch.tensor([1.0, 0.1])
    expected = torch.log_softmax((w[0] * a + w[1] * b) / w.sum(), -1)
    torch.testing.assert_close(pi, expected, rtol=0, atol=1e-6)
    # contexts all rejected (c = 0): the distance weights alone
    pi0 = ensemble([_Prediction(1, a, 0.0), _Prediction(-1, b, 0.0)], settings)
    torch.testing.assert_close(pi0, torch.log_softmax((a + 0.25 * b) / 1.25, -1), rtol=0, atol=1e-6)


def _synthetic_forward(tree, tokens, offsets, table: dict[tuple[int, int], list[float]]) -> _Forward:
    """A forward whose (node, offset) rows hold the given probabilities (vocabulary of 3)."""
    row_of = torch.full((tree.size, len(offsets)), -1, dtype=torch.long)
    rows = []
    for (node, offset), probs in table.items():
        row_of[node, offsets.index(offset)] = len(rows)
        rows.append(torch.tensor(probs).log())
    log_probs = torch.stack(rows)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return _Forward(tokens, offsets, row_of, log_probs, log_probs[:, tokens], entropy)


def test_verification_scores_are_eq6_eq7_eq8_by_hand():
    settings = CoralDecoding(forward_window=2, backward_window=1, decay=0.5, epsilon=0.2)
    offsets = settings.offsets()  # (−1, 0, 1, 2)
    tree = build_tree([(0, 0)])  # root → node 1 (position +1) → node 2 (position +2)
    tokens = torch.tensor([0, 1, 2])
    table = {
        (0, 1): [0.1, 0.8, 0.1],  # p(y1 | ≤ root)       next-token of node 1
        (0, 2): [0.2, 0.2, 0.6],  # p(y2 | ≤ root)       forward δ = 2 for node 2
        (1, 0): [0.3, 0.6, 0.1],  # p(y1 | ≤ 1)          backward δ = 0 for node 1
        (1, 1): [0.1, 0.2, 0.7],  # p(y2 | ≤ 1)          next-token of node 2
        (2, -1): [0.2, 0.5, 0.3],  # p(y1 | ≤ 2)         backward δ = −1 for node 1
        (2, 0): [0.1, 0.1, 0.8],  # p(y2 | ≤ 2)          backward δ = 0 for node 2
    }
    forward = _synthetic_forward(tree, tokens, offsets, table)
    score, confidences, next_token = _path_scores(forward, [0, 1, 2], settings)
    assert next_token == pytest.approx([0.8, 0.7])
    lam = {1: 1.0, 0: 0.5, -1: 0.25, 2: 0.5}
    v1 = (lam[1] * math.log(0.8) + lam[0] * math.log(0.6) + lam[-1] * math.log(0.5)) / (1 + 0.5 + 0.25)
    v2 = (lam[1] * math.log(0.7) + lam[0] * math.log(0.8)) / 1.5
    v_cd2 = max(0.0, math.log(0.7) - math.log(0.6))  # one forward dependency (δ = 2): its weight cancels
    assert score == pytest.approx((v1 + (v2 + v_cd2)) / 2, abs=1e-6)

    def passes(probs, token):
        p = torch.tensor(probs)
        entropy = float(-(p * p.log()).sum())
        return probs[token] > min(0.2, math.sqrt(0.2) * math.exp(-entropy))

    c1 = sum(passes(table[k], 1) for k in ((0, 1), (1, 0), (2, -1))) / 3  # k_b + 2 = 3 dependencies
    c2 = sum(passes(table[k], 2) for k in ((1, 1), (2, 0))) / 3
    assert confidences == pytest.approx([c1, c2])
    # over the dependencies the path supplies: node 2, the block's last, has 2 (next-token, itself), not k_b + 2
    _, available, _ = _path_scores(forward, [0, 1, 2], settings.model_copy(update={"confidence_over": "available"}))
    assert available == pytest.approx([c1, c2 * 3 / 2])


def test_next_token_probability_accepts_what_eq8_alone_rejects():
    """Every backward prediction against the block (eq. 8 scores 1/3 of the votes at most) while the next-token
    predictions are sure: eq. 8 alone (the paper's Algorithm 1) accepts the first token in about a third of the
    draws and both in about a ninth; with ``accept_next_token`` (COrAL's code) both are always accepted."""
    from models.coral.decoding import BlockDraft, CoralVerifier

    tree = build_tree([(0, 0)])
    tokens = torch.tensor([0, 1, 2])
    table = {(0, 1): [0.0001, 0.9998, 0.0001], (1, 1): [0.0001, 0.0001, 0.9998], (0, 2): [0.4, 0.3, 0.3],
             (1, 0): [0.9, 0.05, 0.05], (2, -1): [0.9, 0.05, 0.05], (2, 0): [0.9, 0.05, 0.05]}
    settings = CoralDecoding(forward_window=2, backward_window=1, seed=0)
    forward = _synthetic_forward(tree, tokens, settings.offsets(), table)
    draft = BlockDraft(tree, tokens)
    for accept_next_token, expected in ((False, (0.33, 0.11)), (True, (1.0, 1.0))):
        verifier = CoralVerifier(settings.model_copy(update={"accept_next_token": accept_next_token}))
        accepted = [len(verifier(draft, forward).tokens) for _ in range(600)]
        assert [sum(a >= k for a in accepted) / 600 for k in (1, 2)] == pytest.approx(expected, abs=0.08)


def test_candidate_tree_contains_the_top1_chain_and_follows_confidence():
    settings = CoralDecoding(tree_size=3)
    log_pi = torch.log_softmax(torch.tensor([[5.0, 4.9, 0.0], [0.0, 3.0, 2.9], [9.0, 0.0, 0.0]]), -1)
    choices = candidate_choices(log_pi, num_new_from=1, settings=settings)
    assert (0, 0, 0) in choices and (1,) in choices  # the near-tie at the first position is explored
    assert candidate_choices(log_pi, 1, settings.model_copy(update={"verify": False})) == [(0, 0, 0)]


@pytest.mark.parametrize("settings", [CoralDecoding(block_size=6), CoralDecoding(block_size=6, verify=False),
                                      CoralDecoding(block_size=3, forward_window=1),
                                      CoralDecoding(block_size=1, forward_window=1, backward_window=0)])
def test_decoding_terminates_and_is_deterministic(settings):
    model = _model(seed=3)
    prompt = torch.randint(0, VOCAB, (1, 5))
    runs = []
    for _ in range(2):
        stats = CoralStats()
        runs.append((coral_generate(model, prompt, 20, set(), settings, stats), stats))
    (tokens, stats), (again, _) = runs
    assert tokens == again and len(tokens) == 20 == stats.generated_tokens
    assert len(stats.accepted_lengths) == stats.forwards - 1  # one step per forward after the prefill
    assert stats.forwards <= 20 * 3 + 2  # progress every few steps (the stall guard bounds the rest)
    assert sum(stats.accepted_lengths) == 20
    different_seed = coral_generate(model, prompt, 20, set(), settings.model_copy(update={"seed": settings.seed + 1}))
    assert len(different_seed) == 20


def test_decoding_stops_at_an_end_token():
    model = _model(seed=3)
    prompt = torch.randint(0, VOCAB, (1, 5))
    tokens = coral_generate(model, prompt, 20, set(), CoralDecoding(block_size=4))
    end = tokens[3]
    stopped = coral_generate(model, prompt, 20, {end}, CoralDecoding(block_size=4))
    assert stopped[-1] == end and end not in stopped[:-1] and len(stopped) <= 20


def test_single_token_blocks_without_backward_dependencies_are_greedy():
    """b = 1, k_f = 1, k_b = 0, no verifier: one candidate per step, the next-token argmax; with a negligible ε
    every dependency votes for it (c = 1), so every step accepts it: that is greedy decoding. (With the
    verifier, eq. 6 would also weigh each candidate's reconstruction of itself at offset 0.)"""
    model = _model(seed=5)
    prompt = torch.randint(0, VOCAB, (1, 4))
    greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:]
    settings = CoralDecoding(block_size=1, forward_window=1, backward_window=0, epsilon=1e-12, verify=False)
    stats = CoralStats()
    ours = coral_generate(model, prompt, 12, set(), settings, stats)
    assert ours == greedy.tolist() and stats.forced == 0


def test_sliding_window_model_decodes_like_greedy_and_runs_every_decoder():
    """Mistral with a 3-token window (COrAL's paper model is Mistral): the tree forward gets the shared engine's
    sliding-window masks and cache, so the greedy-equivalent setting still equals HF greedy past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    model = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, sliding_window=3)).eval()
    prompt = torch.randint(0, VOCAB, (1, 5))
    greedy = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 5:]
    settings = CoralDecoding(block_size=1, forward_window=1, backward_window=0, epsilon=1e-12, verify=False)
    assert coral_generate(model, prompt, 10, set(), settings) == greedy.tolist()
    _decode_with_every_decoder(model, prompt, 10)


def test_config_rejects_decoding_offsets_the_model_never_learned(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("coral:\n  forward_window: 2\ncoral_benchmark:\n  forward_window: 4\n")
    with pytest.raises(Exception, match="forward_window"):
        load_config(path)


class _Handed(Exception):
    """Raised by a stand-in for model code: the task got as far as handing it its config."""


def test_coral_sections_are_their_components_and_their_keys_reach_the_model_code(tiny_llama, monkeypatch):
    """No silent fall-through: ``coral`` is-a :class:`CoralTraining` and ``coral_benchmark`` a
    :class:`CoralDecoding`, and the stages hand the model code the sections themselves, so a params.yaml key naming
    a component's field reaches it: ``coral.stage1_epochs`` and ``coral.forward_window`` the held-out evaluation
    (``offset_hits``) and the training (``train_coral``), ``coral_benchmark.epsilon`` every decoder the benchmark
    runs (full COrAL and its ablations)."""
    import tasks.coral as task
    from models.coral.config import CoralBenchmarkConfig, CoralConfig

    assert issubclass(CoralConfig, CoralTraining) and issubclass(CoralBenchmarkConfig, CoralDecoding)
    cfg = load_config(ROOT / "params.yaml", {
        "coral.stage1_epochs": 7, "coral.forward_window": 3, "coral.data": "correct", "coral.mixed_precision": "no",
        "coral_benchmark.forward_window": 3, "coral_benchmark.epsilon": 0.3,
        "coral_benchmark.ablations": ["no_verifier", "no_multi_forward"], "coral_benchmark.ablation_block_sizes": [3]})

    # train_coral: the SFT responses of four prompts on the tiny policy; the model code gets the section itself
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
    responses = pd.DataFrame({"prompt_id": [f"p{i}" for i in range(4)], "prompt": [f"Question {i}?" for i in range(4)],
                              "response": [f"The answer is {i}." for i in range(4)]})
    monkeypatch.setattr(task, "load_stage_policy", lambda *args, **kwargs: policy)
    monkeypatch.setattr(task, "sft_responses", lambda *args: responses)
    handed = {}
    offset_hits = task.offset_hits

    def evaluate(policy, sequences, settings):
        handed["offset_hits"] = settings
        return offset_hits(policy, sequences, settings)

    def train(policy, sequences, settings, *args, **kwargs):
        handed["train_coral"] = settings
        raise _Handed

    monkeypatch.setattr(task, "offset_hits", evaluate)
    monkeypatch.setattr(task, "train_coral", train)
    with pytest.raises(_Handed):
        task.train_coral_task.fn(cfg)
    assert set(handed) == {"offset_hits", "train_coral"} and handed["train_coral"] is cfg.coral
    for settings in handed.values():
        assert isinstance(settings, CoralTraining) and (settings.stage1_epochs, settings.forward_window) == (7, 3)

    # benchmark_coral: every decoder is the section, ablations changing only their own knobs
    decoders = task.coral_decoders(cfg)
    assert list(decoders) == ["coral", "coral_no_verifier", "coral_no_multi_forward", "coral_no_verifier_b3"]
    assert all(isinstance(d, CoralDecoding) and d.epsilon == 0.3 for d in decoders.values())
    assert decoders["coral"] is cfg.coral_benchmark
    assert [(d.verify, d.block_size, d.forward_window) for d in decoders.values()] == [
        (True, 8, 3), (False, 8, 3), (True, 8, 1), (False, 3, 3)]


# ---------------------------------------------------------------------------------------------------------
# precision, memory knobs, several processes, the GPU

DECODERS = (CoralDecoding(block_size=4), CoralDecoding(block_size=4, verify=False),
            CoralDecoding(block_size=4, forward_window=1))
"""The benchmark's decoders: full COrAL, w/o verifier, w/o multi-forward (its ablations only change numbers)."""


def _decode_with_every_decoder(model, prompt: torch.Tensor, max_new_tokens: int) -> None:
    for settings in DECODERS:
        stats = CoralStats()
        tokens = coral_generate(model, prompt, max_new_tokens, set(), settings, stats)
        assert len(tokens) == max_new_tokens == stats.generated_tokens, settings
        assert tokens == coral_generate(model, prompt, max_new_tokens, set(), settings), settings  # seeded draws


def test_corruption_is_drawn_per_sequence_and_epoch():
    """A sequence is corrupted alike wherever it sits in a batch (so on whichever process it lands) and afresh
    each epoch; the same text at two indices is corrupted differently."""
    cfg = CoralTraining(corruption_ratio=0.5)
    sequence = distinct_sequences(1)[0]
    batch = right_pad([sequence, sequence, distinct_sequences(1, seed=1)[0]], 0)
    corrupted, changed = corrupt_batch({**batch, "index": torch.tensor([0, 1, 2])}, cfg, epoch=0)
    assert changed.any() and not torch.equal(corrupted[0], corrupted[1])
    reordered = {key: value[[2, 0]] for key, value in batch.items()}
    alone, alone_changed = corrupt_batch({**reordered, "index": torch.tensor([2, 0])}, cfg, epoch=0)
    assert torch.equal(alone, corrupted[[2, 0]]) and torch.equal(alone_changed, changed[[2, 0]])
    later, _ = corrupt_batch({**batch, "index": torch.tensor([0, 1, 2])}, cfg, epoch=1)
    assert not torch.equal(later, corrupted)


def test_cross_entropy_in_chunks_equals_one_pass_and_keeps_no_vocabulary_logits(monkeypatch):
    """Rows in chunks of 3: the same losses and gradients as one pass, and nothing of the vocabulary's size is
    saved for the backward pass (the chunks' logits are recomputed there)."""
    monkeypatch.setattr("models.coral.target_aware.LOGIT_ROWS_PER_CHUNK", 3)
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, VOCAB, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, VOCAB, (10,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        chunked = row_cross_entropy(hidden, lm_head, targets)
    assert saved and not any(VOCAB in shape for shape in saved)
    chunked.sum().backward()
    chunked_grads = hidden.grad.clone(), lm_head.weight.grad.clone()
    hidden.grad = lm_head.weight.grad = None
    whole = F.cross_entropy(lm_head(hidden), targets, reduction="none")
    whole.sum().backward()
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked_grads, (hidden.grad, lm_head.weight.grad), rtol=0, atol=1e-6)
    assert row_cross_entropy(hidden[:0], lm_head, targets[:0]).shape == (0,)


def test_bf16_policy_trains_float32_master_weights_and_decodes(tiny_llama, tmp_path):
    """A bfloat16 policy: while a stage runs its trained weights are float32 (the shared loop's master weights;
    COrAL once updated bf16 weights directly, where stage 2's 1e-6 steps round away), and bfloat16 again
    afterwards and in the saved folder; both stages moved their weights; every decoder runs on the result."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="bfloat16"))
    model = policy.model
    last, trunk = model.model.layers[-1].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    seen = []
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = CoralTraining(batch_size=2, stage1_epochs=1, stage2_epochs=1, stage1_learning_rate=1e-3,
                        stage2_learning_rate=1e-3)
    history = train_coral(policy, distinct_sequences(4), cfg,
                          on_step=lambda stage, *_: seen.append((stage, last.dtype, trunk.dtype)))
    assert seen == [("stage 1", torch.float32, torch.bfloat16)] * 2 + [("stage 2", torch.bfloat16, torch.float32)] * 2
    assert all(math.isfinite(loss) for loss in history["loss"])
    assert not torch.equal(last, before["model.layers.1.self_attn.q_proj.weight"])
    assert not torch.equal(trunk, before["model.layers.0.self_attn.q_proj.weight"])
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    policy.model.save_pretrained(tmp_path)
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    hits, counts = offset_hits(policy, distinct_sequences(2, seed=1), cfg)
    assert (hits <= counts).all() and counts[:, :4].tolist() == [[10] * 4] * 2
    _decode_with_every_decoder(policy.model, torch.tensor([distinct_sequences(1, seed=2)[0][0][:6]]), 8)


def test_lora_stage_two_trains_adapters_outside_the_last_layer_and_merges(tiny_llama):
    """``lora_rank`` > 0: stage 2 trains adapters alone, on every linear layer but the last decoder layer's, under
    gradient checkpointing (layer 0's MLP runs twice a step: forward and recomputation, beside the target-aware
    last layer); the result is a plain bfloat16 HF model whose trunk moved and whose last layer and embeddings did not."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="bfloat16"))
    model = policy.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trained, mlp_calls = [], []
    # a pre-hook: the recomputation stops once it has every saved tensor, before the MLP returns
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    cfg = CoralTraining(stage1_epochs=0, stage2_epochs=1, batch_size=2, stage2_learning_rate=1e-2, lora_rank=2,
                        gradient_checkpointing=True)
    train_coral(policy, distinct_sequences(4), cfg,
                on_step=lambda *_: trained.append({n for n, p in model.named_parameters() if p.requires_grad}))
    assert len(trained) == 2 and trained[0] == trained[1]
    names = trained[0]
    assert names and all(".lora_" in n for n in names) and not any(n.startswith("model.layers.1.") for n in names)
    assert {n.split(".")[4] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"}
    assert len(mlp_calls) == 2 * 2
    assert type(policy.model) is LlamaForCausalLM and not policy.model.is_gradient_checkpointing
    assert not any("lora" in name for name in policy.model.state_dict())
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"model.layers.0.{module}.weight" for module in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}


TWO_PROCESS_RUNS = {
    "two_stages": CoralTraining(stage1_epochs=2, stage2_epochs=1, batch_size=2, corruption_ratio=1.0,
                                max_patch_size=1, replace_probability=1.0, stage1_learning_rate=1e-3,
                                stage2_learning_rate=1e-3, warmup_ratio=0.5),
    "lora_checkpointed": CoralTraining(stage1_epochs=0, stage2_epochs=1, batch_size=2, stage2_learning_rate=1e-3,
                                       warmup_ratio=0.5, lora_rank=2, gradient_checkpointing=True),
}
"""Per-process batch 2 (the one-process run takes 4). Corruption ratio 1 with 1-token patches on
:func:`distinct_sequences`: every sequence has as many targets, so the mean of two half-batch losses is the
global batch's loss. Warm-up 0.5: a whole number of steps in both runs (the shared loop rounds it per process)."""


def _train_coral_on_two_ranks(folder: str, out: str) -> None:
    """Run by each of 2 processes: every run of TWO_PROCESS_RUNS; ranks must agree; rank 0 saves the results."""
    AcceleratorState._reset_state(True)  # the forked process inherits the parent's single-process state
    torch.set_num_threads(1)  # as in the one-process run it is compared with
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    results = {}
    for name, cfg in TWO_PROCESS_RUNS.items():
        policy = load_pretrained(Path(folder), PolicySpec(device="cpu", dtype="float32"))
        history = train_coral(policy, distinct_sequences(8), cfg, accelerator)
        weights = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
        gathered = accelerator.gather(weights[None])  # (2, P)
        assert torch.equal(gathered[0], gathered[1]), name
        results[name] = (policy.model.state_dict(), history)
    if accelerator.is_main_process:
        torch.save(results, out)
    accelerator.wait_for_everyone()


def test_offset_hits_per_sequence_by_hand(tiny_llama):
    """Held-out hits and targets per sequence and offset, batched with padding, equal each sequence's own
    target-aware logits argmax-ed at its valid (position, offset) cells; a 1-token prompt leaves offset o
    n − o + 1 targets in an n-token response; a response that is the model's own greedy continuation is hit at
    every +1 target (offset +1 is the next-token prediction)."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
    prompt = torch.tensor([distinct_sequences(1, seed=4)[0][0][:4]])
    greedy = policy.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                   min_new_tokens=10, do_sample=False, pad_token_id=0)[0]
    long = (greedy.tolist(), [0] * 4 + [1] * 10)
    short = distinct_sequences(1, seed=5)[0]
    short = (short[0][3:9], [0] + [1] * 5)  # 1 prompt + 5 response tokens
    sequences = [long, short, long]
    cfg = CoralTraining(batch_size=2, backward_window=2, corruption_ratio=1.0)
    columns = evaluated_offsets(cfg)
    assert columns == (("forward", 1), ("forward", 2), ("forward", 3), ("forward", 4), ("confirm", -2), ("confirm", -1),
                       ("confirm", 0), ("reconstruct", -2), ("reconstruct", -1), ("reconstruct", 0))
    hits, counts = offset_hits(policy, sequences, cfg)
    assert counts[:, :4].tolist() == [[10] * 4, [5, 4, 3, 2], [10] * 4]
    for row, (ids, mask) in enumerate(sequences):
        ids = torch.tensor([ids])
        corrupted, changed = corrupt_batch({**right_pad([sequences[row]], 0), "index": torch.tensor([row])}, cfg,
                                           HELD_OUT_KEY)  # the sequence's own held-out corruption, wherever it sits
        for kind, inputs, target_mask in (("forward", ids, torch.tensor([mask])), ("confirm", ids, torch.tensor([mask])),
                                          ("reconstruct", corrupted, changed)):
            which = [i for i, (k, _) in enumerate(columns) if k == kind]
            offsets = [columns[i][1] for i in which]
            with torch.no_grad():
                predicted = target_aware_logits(policy.model, inputs, offsets).argmax(-1)  # (1, O, T)
            targets, valid = offset_targets(ids, target_mask, offsets)
            assert hits[row, which].tolist() == ((predicted == targets) & valid).sum(dim=-1)[0].float().tolist()
            assert counts[row, which].tolist() == valid.sum(dim=-1)[0].float().tolist()
    assert counts[:, -3:].sum() > 0  # corrupted tokens were reconstructed
    assert hits[0, 0] == 10 and hits[0].tolist()[:7] == hits[2].tolist()[:7]


def test_held_out_offset_accuracy_has_an_interval_over_sequences():
    """Σ hits / Σ targets per offset; resampling the two sequences (per-sequence accuracies ½ and 1) can only
    give ½, ¾ or 1, each at least ¼ likely, so the 95 % interval is [½, 1]; an offset without targets is NaN."""
    from tasks.coral import _offset_accuracy

    accuracy = _offset_accuracy(torch.tensor([[1.0, 0.0], [2.0, 0.0]]), torch.tensor([[2.0, 0.0], [2.0, 0.0]]),
                                (("forward", 1), ("forward", 2)))
    assert (accuracy["top1_forward_1"], accuracy["top1_forward_1_low"], accuracy["top1_forward_1_high"]) == (
        0.75, 0.5, 1.0)
    assert all(math.isnan(accuracy[f"top1_forward_2{end}"]) for end in ("", "_low", "_high"))


def test_benchmark_times_every_decoder_on_the_speed_prompts_and_judges_coral_on_all(tiny_llama, tmp_path,
                                                                                    monkeypatch):
    """The benchmark stage on a tiny "COrAL model" (the tiny policy): next-token and full COrAL on all 3 held-out
    prompts, every decoder on the first (the speed prompt), timed there only. Accuracy, its interval and its paired
    difference to next-token come from the outputs (the tiny model's answers are judged by a fixed list of verdicts,
    in the order the stage judges them, so they differ between decoders), tokens per forward is Σ tokens / Σ
    forwards, next-token's speedup over itself is 1; table, report, artifact and metrics carry the intervals."""
    from prefect.logging import disable_run_logger

    from foresight.config import parse_config
    from foresight.prompts import PROMPT_COLUMNS
    from foresight.storage import write_table
    import tasks.coral
    from tasks import common
    from tasks.coral import benchmark_coral_task

    cfg = parse_config(tiny_params(tmp_path, tiny_llama, policy={"dtype": "float32"},
                                   coral_benchmark={"num_prompts": 3, "speed_prompts": 1}), root=tmp_path)
    policy = load_pretrained(tiny_llama, cfg.policy)
    policy.model.save_pretrained(cfg.path(cfg.paths.coral_dir))
    policy.tokenizer.save_pretrained(cfg.path(cfg.paths.coral_dir))
    questions = ["What is 1 + 2?", "What is 3 * 3?", "What is 7 - 5?", "What is 2 + 2?"]
    table = pd.DataFrame({"prompt_id": [f"eval{i}" for i in range(4)], "question": questions,
                          "answer": ["3", "9", "2", "4"], "source": "file"})
    write_table(table[PROMPT_COLUMNS], cfg.path(cfg.paths.prompts_dir) / "eval.jsonl")
    # prompt 0 by every decoder, then prompts 1 and 2 by next-token, then by COrAL
    verdicts = [True, False, True, False, False, True, True, False, False, True]
    judged = iter(verdicts)
    monkeypatch.setattr(tasks.coral, "is_correct", lambda response, answer, truncated=False: next(judged))
    common.PENDING_ARTIFACTS.clear()
    with disable_run_logger():
        result = benchmark_coral_task.fn(cfg)
    out = cfg.path(cfg.paths.benchmarks_dir) / "coral"
    outputs = pd.read_parquet(out / "outputs.parquet")
    rows = pd.read_csv(out / "table.csv").set_index("decoder")
    decoders = ["next_token", "coral", "coral_no_verifier", "coral_no_multi_forward", "coral_no_verifier_b3",
                "coral_no_verifier_kf2"]
    assert rows.index.tolist() == decoders and rows["prompts"].tolist() == [3, 3, 1, 1, 1, 1]
    assert sorted(outputs.loc[outputs["timed"], "decoder"]) == sorted(decoders)  # prompt 0, every decoder
    assert outputs.loc[~outputs["timed"], "prompt_index"].tolist() == [1, 2, 1, 2]
    assert outputs["correct"].tolist() == verdicts
    correct = outputs.pivot(index="prompt_index", columns="decoder", values="correct").astype(float)
    for decoder in ("next_token", "coral"):
        row = rows.loc[decoder]
        assert row["accuracy"] == pytest.approx(correct[decoder].mean())
        assert row["accuracy_low"] <= row["accuracy"] <= row["accuracy_high"]
        assert row["accuracy_vs_next_token"] == pytest.approx((correct[decoder] - correct["next_token"]).mean())
        mine = outputs[outputs["decoder"] == decoder]
        assert row["tokens_per_forward"] == pytest.approx(mine["new_tokens"].sum() / mine["forwards"].sum())
    for decoder in decoders[2:]:  # the speed prompt alone: one unit, no interval
        assert rows.loc[decoder, "accuracy"] == correct.loc[0, decoder]
        assert math.isnan(rows.loc[decoder, "accuracy_low"])
    assert rows.loc["next_token", "tokens_per_forward"] == 1.0 == rows.loc["next_token", "tokens_per_forward_low"]
    assert rows.loc["next_token", "speedup_vs_reference"] == pytest.approx(1.0)
    assert not rows["accuracy_significant"].fillna(False).any()  # three prompts cannot make a difference significant
    metrics = result.metrics
    assert metrics["coral.accuracy_low"] == rows.loc["coral", "accuracy_low"]
    assert "coral.tokens_per_forward_high" in metrics and "coral.speedup_vs_reference" in metrics
    report = (out / "report.md").read_text()
    assert f"| coral | True | 6 | 4 | {rows.loc['coral', 'accuracy']:.3g} [" in report
    (table_artifact,) = [a for a in common.PENDING_ARTIFACTS if a["key"] == "coral-benchmark"]
    assert table_artifact["table"][1]["accuracy"].startswith(f"{rows.loc['coral', 'accuracy']:.3g} [")


def test_two_processes_train_like_one_on_the_same_global_batch(tiny_llama, tmp_path):
    """Two processes with batch 2 each end with identical weights (the step runs DDP's forward: COrAL once
    bypassed it), equal to one process with batch 4: losses, learning rates, weights — which needs each
    sequence corrupted alike whichever process draws it (one generator per process once corrupted each rank's
    rows alike). LoRA with gradient checkpointing too."""
    out = tmp_path / "two_ranks.pt"
    launch = ("from functools import partial; from accelerate import debug_launcher; "
              "from tests.test_coral import _train_coral_on_two_ranks; "
              f"debug_launcher(partial(_train_coral_on_two_ranks, {str(tiny_llama)!r}, {str(out)!r}), "
              "num_processes=2)")
    result = subprocess.run([sys.executable, "-c", launch], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    two_processes = torch.load(out)
    for name, cfg in TWO_PROCESS_RUNS.items():
        policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
        history = train_coral(policy, distinct_sequences(8), cfg.model_copy(update={"batch_size": 2 * cfg.batch_size}),
                              Accelerator(cpu=True))
        state, two_history = two_processes[name]
        assert two_history["stage"] == history["stage"] and two_history["learning_rate"] == history["learning_rate"]
        assert two_history["loss"] == pytest.approx(history["loss"], abs=1e-6), name
        for key, value in policy.model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.cuda
def test_cuda_bf16_one_step_of_each_stage_and_every_decoder(tiny_llama):
    """On the GPU in bfloat16 — the only place the device defects show (CPU tensors meeting CUDA ones in the
    decoders' scoring, CPU generators in the corruption): one step of each stage, in full and with LoRA +
    gradient checkpointing, the held-out accuracy, then every decoder (the prompt given on the CPU)."""
    for lora_rank in (0, 2):
        policy = load_pretrained(tiny_llama, PolicySpec(device="cuda", dtype="bfloat16"))
        before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
        cfg = CoralTraining(batch_size=2, stage1_epochs=1, stage2_epochs=1, stage1_learning_rate=1e-2,
                            stage2_learning_rate=1e-2,
                            lora_rank=lora_rank,
                            gradient_checkpointing=lora_rank > 0)
        history = train_coral(policy, distinct_sequences(2), cfg)
        assert history["stage"] == [1, 2] and all(math.isfinite(loss) for loss in history["loss"])
        assert {(p.device.type, p.dtype) for p in policy.model.parameters()} == {("cuda", torch.bfloat16)}
        changed = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
        assert "model.layers.1.self_attn.q_proj.weight" in changed and "model.layers.0.mlp.up_proj.weight" in changed
        hits, counts = offset_hits(policy, distinct_sequences(2, seed=1), cfg)
        assert (hits <= counts).all() and counts[:, :4].tolist() == [[10] * 4] * 2
    _decode_with_every_decoder(policy.model, torch.tensor([distinct_sequences(1, seed=2)[0][0][:6]]), 8)


# ---------------------------------------------------------------------------------------------------------
# stage 1 on the trunk's cached outputs, early stopping


def _padded_batch(sequences, indices) -> dict[str, torch.Tensor]:
    return {**right_pad([sequences[i] for i in indices], 0), "index": torch.tensor(indices)}


def test_cached_trunk_outputs_give_the_uncached_stage1_loss_and_gradients(tiny_llama):
    """fp32: the step's loss, every offset's cross-entropy and the last layer's gradients are those of the full
    forward, on a right-padded batch of unequal lengths, for each epoch's corruption draw (draw e = key e while
    e < stage1_corruption_draws, as without the cache); the trunk gets no gradient."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
    model = policy.model
    sequences = distinct_sequences(3)
    sequences[1] = (sequences[1][0][:9], sequences[1][1][:9])  # padded in the batch
    cfg = CoralTraining(batch_size=2, corruption_ratio=0.5, stage1_corruption_draws=2)
    cache = trunk_cache(model, sequences, cfg, range(cfg.stage1_corruption_draws), 0, Accelerator(cpu=True))
    last = stage_parameters(model, 1)
    model.requires_grad_(False)
    for p in last:
        p.requires_grad_(True)
    for epoch in (0, 1):
        results = []
        for cached in (cache, None):
            loss, stats = coral_step_loss(model, _padded_batch(sequences, [2, 1, 0]), cfg, epoch, cache=cached)
            grads = torch.autograd.grad(loss, last)
            results.append((loss, stats, grads))
        (loss, stats, grads), (reference, reference_stats, reference_grads) = results
        torch.testing.assert_close(loss, reference, rtol=0, atol=1e-6)
        assert stats == pytest.approx(reference_stats, abs=1e-6, nan_ok=True)
        assert not math.isnan(stats["backward_loss"])  # corrupted tokens were reconstructed
        for grad, reference_grad in zip(grads, reference_grads, strict=True):
            torch.testing.assert_close(grad, reference_grad, rtol=0, atol=1e-6)
    assert all(p.grad is None for p in stage_parameters(model, 2))


def test_cached_corruption_draws_cycle_over_epochs(tiny_llama):
    """Epoch e trains on draw e mod D; the held-out cache's one draw is the held-out key's, for every epoch."""
    model = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32")).model
    sequences = distinct_sequences(2)
    cfg = CoralTraining(corruption_ratio=0.5)
    cache = trunk_cache(model, sequences, cfg, range(2), 0, Accelerator(cpu=True))
    batch = _padded_batch(sequences, [0, 1])
    for epoch in range(4):
        expected, _ = corrupt_batch(batch, cfg, epoch % 2)
        assert torch.equal(cache.batch([0, 1], epoch, 14, torch.device("cpu")).corrupted_ids, expected)
    held_out = trunk_cache(model, sequences, cfg, (HELD_OUT_KEY,), 0, Accelerator(cpu=True))
    expected, _ = corrupt_batch(batch, cfg, HELD_OUT_KEY)
    assert all(torch.equal(held_out.batch([0, 1], epoch, 14, torch.device("cpu")).corrupted_ids, expected)
               for epoch in range(3))


def test_stage1_stops_early_on_the_held_out_loss_and_keeps_its_best_epoch(tiny_llama):
    """With validation sequences, stage 1 records their objective after every epoch run, stops after
    ``stage1_patience`` epochs without a new best (a learning rate this high overshoots) and ends with the best
    epoch's last layer: its held-out loss is the lowest recorded."""
    from models.coral.training import held_out_loss

    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
    train, held_out = distinct_sequences(4), distinct_sequences(4, seed=3)
    cfg = CoralTraining(stage1_epochs=8, stage1_patience=1, stage2_epochs=0, batch_size=2, stage1_learning_rate=0.3,
                        warmup_ratio=0.0)
    history = train_coral(policy, train, cfg, validation=held_out)
    losses = history["stage1_held_out_loss"]
    assert 1 <= len(losses) < 8 and len(history["loss"]) == 2 * len(losses)
    best = min(losses)
    assert history["stage1_best_epoch"] == [losses.index(best) + 1] and losses[-1] > best
    cache = trunk_cache(policy.model, held_out, cfg, (HELD_OUT_KEY,), 0, Accelerator(cpu=True))
    assert held_out_loss(held_out, cfg, cache, 0)(policy.model) == pytest.approx(best, abs=1e-5)
