"""Shared benchmark machinery (win/tie/loss, speed ratios, tables) and the classical decoders."""

import math

import pytest
import torch

from foresight.benchmark import (
    DecodeTimer,
    batch_speed_curve,
    cell,
    display_rows,
    interleaved_decoding,
    markdown_table,
    speed_row,
    win_tie_loss,
)
from models.engine.config import ClassicalDecoding, PolicySpec
from models.engine.decoding import generate_kwargs, hf_decode
from models.engine.generation import chat_prompts, end_token_ids
from models.engine.policy import load_pretrained


def test_win_tie_loss_hand_worked():
    result = win_tie_loss([1.0, 0.0, 0.5, 0.2], [0.0, 0.0, 0.7, 0.2])
    assert {k: result[k] for k in ("win", "tie", "loss", "win_rate")} == {"win": 0.25, "tie": 0.5, "loss": 0.25,
                                                                          "win_rate": 0.5}
    # per prompt 1, ½, 0, ½: resample means range over [0, 1]; the interval holds 0.5, so not significant
    assert 0.0 <= result["win_rate_low"] < 0.5 < result["win_rate_high"] <= 1.0
    assert result["win_rate_significant"] is False
    wins = win_tie_loss([1, 1], [0, 0])
    assert (wins["win_rate"], wins["win_rate_low"], wins["win_rate_high"], wins["win_rate_significant"]) == (
        1.0, 1.0, 1.0, True)
    with pytest.raises(ValueError, match="equally long"):
        win_tie_loss([1.0], [1.0, 2.0])


def timed(tokens: list[int], seconds: list[float]) -> DecodeTimer:
    """A timer as if its calls had taken ``seconds`` and generated ``tokens``."""
    return DecodeTimer(seconds=sum(seconds), tokens=sum(tokens), calls=len(tokens), call_seconds=list(seconds),
                       call_tokens=list(tokens))


def test_speed_ratios_hand_worked():
    fast, slow = timed([50, 50], [1.0, 1.0]), timed([50, 50], [2.0, 4.0])
    row = speed_row(slow, fast)
    assert row["tokens_per_s"] == pytest.approx(100 / 6) and row["ms_per_token"] == pytest.approx(60.0)
    assert row["latency_vs_reference"] == pytest.approx(3.0) and row["speedup_vs_reference"] == pytest.approx(1 / 3)
    # per call the decoder is 2× and 4× slower: resamples give 1/2, 1/3 or 1/4 as the speedup (¼, ½, ¼)
    assert (row["speedup_vs_reference_low"], row["speedup_vs_reference_high"]) == (pytest.approx(1 / 4),
                                                                                   pytest.approx(1 / 2))
    assert (row["latency_vs_reference_low"], row["latency_vs_reference_high"]) == (pytest.approx(2.0),
                                                                                   pytest.approx(4.0))
    assert row["speedup_vs_reference_significant"] and row["latency_vs_reference_significant"]
    with pytest.raises(ValueError, match="pair calls"):
        speed_row(timed([50], [1.0]), fast)

    timer = DecodeTimer()
    with timer:
        pass
    timer.add_tokens(3)
    with timer:
        pass
    timer.add_tokens(2)
    timer.add_tokens(1)  # tokens counted after a call belong to that call
    assert timer.calls == 2 and timer.tokens == 6 and timer.call_tokens == [3, 3]
    assert len(timer.call_seconds) == 2 and timer.seconds == pytest.approx(sum(timer.call_seconds))
    assert math.isnan(DecodeTimer().tokens_per_s)


def test_interleaved_decoding_times_every_decoder_prompt_by_prompt():
    """Warm-up calls first, then prompt-major order: each decoder's i-th timed call is prompt i."""
    calls = []

    def decode(decoder, prompt, max_new_tokens):
        calls.append((decoder, prompt, max_new_tokens))
        return [0] * (prompt + 1), None

    timers, records = interleaved_decoding(["a", "b"], [1, 2, 3], decode, max_new_tokens=9, desc="test",
                                           warm_up_tokens=4)
    assert calls == [("a", 1, 4), ("b", 1, 4)] + [(d, p, 9) for p in (1, 2, 3) for d in ("a", "b")]
    assert timers["a"].call_tokens == timers["b"].call_tokens == [2, 3, 4]
    assert [(r["prompt_index"], r["decoder"]) for r in records] == [(i, d) for i in range(3) for d in ("a", "b")]


def test_the_speed_curve_counts_tokens_per_forward_of_all_rows_and_of_each_batchs_slowest_row():
    """Two batches of two rows. Batch 0: rows of 10 tokens in 4 forwards and 3 in 2; batch 1: 6 in 5 and 8 in 5 (a
    tie on forwards: the row with fewer tokens is the slowest). All rows: (13 + 14) / (6 + 10) = 27 / 16 tokens per
    forward; slowest rows: (10 + 6) / (4 + 5) = 16 / 9, between batch 1's alone (1.2) and batch 0's (2.5). Plain
    forwards 1 of 16; the reference (no counters) has its speed alone."""
    from models.engine.speculative import SpeculativeStats

    counters = {0: [(10, 4, 1), (3, 2, 0)], 1: [(6, 5, 0), (8, 5, 0)]}  # (tokens, forwards, plain) per row

    def decode(decoder, batch, max_new_tokens):
        if max_new_tokens < 10:  # the warm-up call
            return [[0]] * len(batch), None
        rows = counters[batch[0]]
        if decoder == "reference":
            return [[0] * tokens for tokens, _, _ in rows], None
        return ([[0] * tokens for tokens, _, _ in rows],
                [SpeculativeStats(forwards=f, generated_tokens=n, plain_forwards=p) for n, f, p in rows])

    rows = batch_speed_curve(["reference", "drafter"], [0, 0, 1, 1], decode, "reference", [2], 2, 10, "test",
                             compare_outputs=False)
    reference, drafter = rows
    assert set(reference) == {"batch", "decoder", "batches", "tokens_per_s", "ms_per_token"}
    assert drafter["tokens_per_forward"] == pytest.approx(27 / 16) and drafter["plain_share"] == pytest.approx(1 / 16)
    assert drafter["slowest_row_tokens_per_forward"] == pytest.approx(16 / 9)
    assert 1.2 - 1e-9 <= drafter["slowest_row_tokens_per_forward_low"] <= 16 / 9
    assert 16 / 9 <= drafter["slowest_row_tokens_per_forward_high"] <= 2.5 + 1e-9


def test_markdown_table():
    table = markdown_table([{"a": 1, "b": 0.123456, "c": float("nan")}, {"a": "x", "b": 12345.6}])
    assert table.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.123 | – |", "| x | 12346 |  |"]


def test_cells_show_intervals_and_significance():
    row = {"decoder": "sla", "win_rate": 0.625, "win_rate_low": 0.4, "win_rate_high": 0.85,
           "win_rate_significant": False, "accuracy": 0.5, "accuracy_low": 0.35, "accuracy_high": 0.65,
           "accuracy_significant": True, "ms_per_token": 51.234,
           "tokens_per_s": 20.0, "tokens_per_s_low": float("nan"), "tokens_per_s_high": float("nan")}
    columns = ["decoder", "win_rate", "accuracy", "ms_per_token", "tokens_per_s"]
    assert markdown_table([row], columns).splitlines()[2] == "| sla | 0.625 [0.4, 0.85] | 0.5 [0.35, 0.65] * | 51.2 | 20 |"
    assert display_rows([row], ["win_rate", "accuracy"]) == [{"win_rate": "0.625 [0.4, 0.85]",
                                                               "accuracy": "0.5 [0.35, 0.65] *"}]
    assert cell({"x": 1.0, "x_significant": True}, "x") == "1 *"


def test_unused_sampling_knobs_are_neutralised():
    cfg = ClassicalDecoding()
    assert generate_kwargs("temperature", cfg) == {"do_sample": True, "temperature": 0.8, "top_p": 1.0, "top_k": 0}
    assert generate_kwargs("top_k", cfg)["top_k"] == 50 and generate_kwargs("top_k", cfg)["temperature"] == 1.0
    assert generate_kwargs("beam", cfg)["num_beams"] == 4


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))


def test_hf_decode_greedy_matches_generate_and_cuts_at_eos(tiny):
    cfg, max_new_tokens = ClassicalDecoding(), 10
    prompts = [tiny.tokenizer(p, add_special_tokens=False).input_ids
               for p in chat_prompts(tiny.tokenizer, ["Ben has 4 apples.", "What is 2 + 3 and then more?"])]
    eos = end_token_ids(tiny)
    batched = hf_decode(tiny, prompts, generate_kwargs("greedy", cfg), max_new_tokens, eos, batch_size=2)
    for ids, out in zip(prompts, batched):
        alone = tiny.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                    pad_token_id=tiny.tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert out == alone[: len(out)] and 1 <= len(out) <= 10
        assert all(t not in eos for t in out[:-1])


def test_hf_decode_sampling_is_seeded(tiny):
    cfg, max_new_tokens = ClassicalDecoding(), 8
    prompts = [tiny.tokenizer(p, add_special_tokens=False).input_ids for p in chat_prompts(tiny.tokenizer, ["a", "b"])]
    eos = end_token_ids(tiny)
    first = hf_decode(tiny, prompts, generate_kwargs("temperature", cfg), max_new_tokens, eos, batch_size=2, seed=3)
    assert first == hf_decode(tiny, prompts, generate_kwargs("temperature", cfg), max_new_tokens, eos, batch_size=2, seed=3)
    assert first != hf_decode(tiny, prompts, generate_kwargs("temperature", cfg), max_new_tokens, eos, batch_size=2, seed=4)
    beams = hf_decode(tiny, prompts, generate_kwargs("beam", cfg), max_new_tokens, eos, batch_size=2)
    assert len(beams) == 2 and all(1 <= len(b) <= 8 for b in beams)


def test_hf_decode_holds_at_most_batch_size_prompts_per_generate_call(tiny, monkeypatch):
    """Decoding every benchmark prompt in one batch ran out of memory at 8B: ``batch_size`` rows per call."""
    rows = []
    generate = tiny.model.generate

    def recording_generate(**kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return generate(**kwargs)

    monkeypatch.setattr(tiny.model, "generate", recording_generate)
    prompts = [tiny.tokenizer(p, add_special_tokens=False).input_ids
               for p in chat_prompts(tiny.tokenizer, ["a", "b", "c", "d", "e"])]
    outputs = hf_decode(tiny, prompts, generate_kwargs("greedy", ClassicalDecoding()), 3, end_token_ids(tiny),
                        batch_size=2)
    assert rows == [2, 2, 1] and len(outputs) == 5


@pytest.mark.cuda
def test_classical_decoders_on_the_gpu_in_bfloat16(tiny_llama):
    """Every classical decoder on a bf16 policy loaded onto the GPU (inputs made on its device), in batches of 2;
    the sampling decoders repeat with their seed."""
    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cuda", dtype="auto"))
    assert policy.model.dtype == torch.bfloat16 and policy.device.type == "cuda"
    cfg, eos = ClassicalDecoding(), end_token_ids(policy)
    prompts = [policy.tokenizer(p, add_special_tokens=False).input_ids
               for p in chat_prompts(policy.tokenizer, ["Ben has 4 apples.", "What is 2 + 3 and then more?", "a"])]
    for decoder in ("greedy", "temperature", "top_p", "top_k", "beam"):
        outputs = hf_decode(policy, prompts, generate_kwargs(decoder, cfg), 8, eos, batch_size=2, seed=5)
        assert len(outputs) == 3 and all(1 <= len(o) <= 8 for o in outputs), decoder
        assert all(0 <= t < policy.model.config.vocab_size for o in outputs for t in o), decoder
        if decoder != "greedy":
            again = hf_decode(policy, prompts, generate_kwargs(decoder, cfg), 8, eos, batch_size=2, seed=5)
            assert again == outputs, decoder
