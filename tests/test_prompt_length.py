"""Prompt length: ``prompts.max_prompt_tokens`` in ``prepare_prompts`` (counted in the policy's chat template, as
generation tokenises it), the same limit on the prompt sets other stages read (the Medusa distillation's further
task prompts and general instructions, the Medusa benchmark's sets: ``tasks.common.drop_long_prompt_sets``), and reward
models that cut the response, never the prompt (ArmoRM gates on the prompt's end,
``models/labeling/conversations.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from foresight.config import load_config
from foresight.prompt_limits import (
    PromptSourceError,
    drop_long_prompts,
    policy_context_length,
    prompt_token_counts,
    resolve_max_prompt_tokens,
)
from models.engine.generation import chat_prompts
from models.labeling.armorm import ArmoRMError, encode_conversations, gating_pattern, load_armorm
from models.labeling.config import LabelerSpec
from models.labeling.conversations import conversation_ids
from models.labeling.labelers import LabelerError, build_labeler
from tests.helpers import reference_armorm_forward, tiny_params
from tests.tiny import build_llama3_tokenizer

SHORT = ["Ben has 4 apples. How many apples does Ben have now?", "Ivy has 3 cookies. How many are left?",
         "Ava has 2 bags with 3 marbles in each bag. How many marbles does Ava have in total?",
         "Omar has 5 coins and gives 1 of them to Lena. How many coins does Omar have left?",
         "Emma has 6 shells. Finn gives Emma 2 more shells. How many shells does Emma have now?",
         "Hugo has 7 books and gives 3 of them to Jack. How many books does Hugo have left?",
         "Grace has 2 pencils. Dan gives Grace 8 more pencils. How many pencils does Grace have now?",
         "Chloe has 9 stickers and gives 4 of them to Ben. How many stickers does Chloe have left?"]
LONG = "Ben has 4 apples. Ava gives Ben 2 more apples. " * 60 + "How many apples does Ben have now?"
LONG_RESPONSE = ("Ben has 4 apples and Ava gives Ben 2 more apples, so Ben has 4 + 2 = 6 apples. " * 12
                 + "The answer is 6.")


def _prepare(root: Path, tiny_llama: Path, questions: list[str], **prompts) -> tuple[dict, dict]:
    """prepare_policy then prepare_prompts on a prompt file holding ``questions`` (every row used: the splits hold
    them all); returns prepare_prompts' metrics and the written splits."""
    from prefect.logging import disable_run_logger

    from tasks.common import read_prompts
    from tasks.policy import prepare_policy_task
    from tasks.prompts import prepare_prompts_task

    root.mkdir(parents=True, exist_ok=True)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    params = tiny_params(root, tiny_llama, prompts={
        "source": "file", "file": {"path": "prompts.jsonl", "text_column": "prompt"}, "num_train": len(questions) - 2,
        "num_eval": 2, **prompts})
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    cfg = load_config(root / "params.yaml")
    with disable_run_logger():
        prepare_policy_task.fn(cfg)
        metrics = prepare_prompts_task.fn(cfg).metrics
    return metrics, {split: read_prompts(cfg, split) for split in ("train", "eval")}


def test_prepare_prompts_drops_exactly_the_over_long_prompt(tiny_llama, tmp_path):
    """The tiny policy's context is 512 tokens and 12 new tokens are generated: a prompt over 500 tokens in its chat
    template goes, from whichever split it fell in, and is counted."""
    from transformers import AutoTokenizer

    counts = prompt_token_counts(AutoTokenizer.from_pretrained(tiny_llama), [LONG, *SHORT], None)
    assert counts[0] > 512 - 12 >= max(counts[1:])
    metrics, splits = _prepare(tmp_path, tiny_llama, [*SHORT[:4], LONG, *SHORT[4:]])
    kept = pd.concat(splits.values())["question"].tolist()
    assert LONG not in kept and sorted(kept) == sorted(SHORT)
    assert metrics["max_prompt_tokens"] == 500
    assert metrics["dropped_long_prompts"] == 1 == metrics["dropped_long_train"] + metrics["dropped_long_eval"]
    assert metrics["num_train"] + metrics["num_eval"] == len(SHORT)
    assert metrics["longest_prompt_tokens"] == max(counts[1:])


def test_the_count_is_the_chat_template_s_as_generation_tokenises_it(tiny_llama, tmp_path):
    """A prompt whose raw text fits the limit but whose templated form (role markers, system prompt) does not is
    dropped; the count equals the prompt tokens the generate stage's sampler reports."""
    from transformers import AutoTokenizer

    from models.engine.config import PolicySpec, Sampling
    from models.engine.generation import HFSampler
    from models.engine.policy import load_pretrained

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    system = "You are a careful tutor."
    medium = " ".join(SHORT[2:5])
    raw = len(tokenizer(medium, add_special_tokens=False).input_ids)
    templated = prompt_token_counts(tokenizer, [medium, *SHORT], system)
    assert templated[0] > raw + 10  # the template's markers and the system prompt
    limit = raw + 1  # the raw text fits, the templated prompt does not
    assert max(templated[1:]) <= limit
    metrics, splits = _prepare(tmp_path, tiny_llama, [*SHORT, medium], max_prompt_tokens=limit, system_prompt=system)
    assert sorted(pd.concat(splits.values())["question"]) == sorted(SHORT)
    assert metrics["dropped_long_prompts"] == 1 and metrics["max_prompt_tokens"] == limit

    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))
    sampler = HFSampler(policy, Sampling(num_samples=1, max_new_tokens=2, batch_size=2))
    completions = sampler(chat_prompts(policy.tokenizer, SHORT[:2], system), 0, 0)
    assert [c.prompt_tokens for c in completions] == templated[1:3]


def test_a_bos_adding_template_counts_its_bos_once(tmp_path):
    """Llama-3's template writes <|begin_of_text|> itself: counted once, as generation tokenises the prompt."""
    tokenizer = build_llama3_tokenizer(tmp_path)
    [count] = prompt_token_counts(tokenizer, [SHORT[0]], None)
    [text] = chat_prompts(tokenizer, [SHORT[0]])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert count == len(ids) and ids.count(tokenizer.bos_token_id) == 1


def test_the_automatic_limit_and_a_limit_the_policy_cannot_generate_from(tmp_path):
    from transformers import LlamaConfig

    # Llama-3-8B-Instruct's context, read from a config.json alone (no weights in the folder)
    LlamaConfig(max_position_embeddings=8192, hidden_size=4096, num_hidden_layers=32).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    context = policy_context_length(tmp_path)
    assert context == 8192
    assert resolve_max_prompt_tokens(None, context, 512, None) == 7680
    assert resolve_max_prompt_tokens(None, context, 512, 4096) == 3584  # ArmoRM at label.max_length 4096
    assert resolve_max_prompt_tokens(2000, context, 512, 4096) == 2000
    with pytest.raises(PromptSourceError, match=r"prompts\.max_prompt_tokens = 7800 exceeds .* = 7680"):
        resolve_max_prompt_tokens(7800, context, 512, None)


def test_dropping_every_prompt_names_the_key(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    splits = {"train": pd.DataFrame({"question": SHORT}), "eval": pd.DataFrame({"question": SHORT[:0]})}
    kept, counts = drop_long_prompts(splits, tokenizer, None, 1000)
    assert len(kept["train"]) == len(SHORT) and counts["eval"] == []
    with pytest.raises(PromptSourceError, match=r"every one of the 8 train prompts .* prompts\.max_prompt_tokens = 5"):
        drop_long_prompts(splits, tokenizer, None, 5)


def test_armorm_cuts_the_response_and_keeps_the_prompt_and_the_end_of_turn(tiny_armorm):
    """A conversation over label.max_length keeps its templated prompt (the gating pattern) and its <|eot_id|>,
    loses the response's tail, and is scored as the published forward scores those tokens."""
    model, tokenizer = load_armorm(tiny_armorm)
    pattern = gating_pattern(tokenizer)
    questions, responses, max_length = [SHORT[0], SHORT[1]], [LONG_RESPONSE, "6"], 64
    full = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant",
                                                     "content": r}], tokenize=False), add_special_tokens=False)
            .input_ids for q, r in zip(questions, responses)]
    prompt = tokenizer(chat_prompts(tokenizer, questions[:1])[0], add_special_tokens=False).input_ids
    assert len(full[0]) > 2 * max_length > max_length > len(prompt) + 5 and len(full[1]) < max_length

    enc, truncated = encode_conversations(tokenizer, questions, responses, max_length, pattern)
    assert truncated == [True, False]
    row = enc["input_ids"][0].tolist()
    assert len(row) == max_length == int(enc["attention_mask"][0].sum())
    assert row[: len(prompt)] == prompt  # the whole templated prompt, BOS to assistant header
    assert row[-1] == tokenizer.convert_tokens_to_ids("<|eot_id|>")  # the end of turn the reward is read at
    assert row[len(prompt) : -1] == full[0][len(prompt) : max_length - 1]  # the response's first tokens
    assert enc["input_ids"][1, : len(full[1])].tolist() == full[1]  # a conversation that fits is untouched
    assert enc["gating_positions"][0].item() == len(prompt) - len(pattern)  # the prompt's end, as untruncated
    with torch.no_grad():
        out = model(**enc)
    ref = reference_armorm_forward(tiny_armorm, enc["input_ids"], enc["attention_mask"], tokenizer.pad_token_id)
    assert torch.isfinite(out.score).all() and (out.score - ref["score"]).abs().max() < 1e-5


def test_armorm_labeler_counts_cut_responses_and_refuses_a_prompt_without_room(tiny_armorm):
    labeler = build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_armorm), max_length=96, batch_size=2,
                                        device="cpu", dtype="float32"))
    scores = labeler.score([SHORT[0], SHORT[1], SHORT[2]], [LONG_RESPONSE, "6", LONG_RESPONSE], [None] * 3)
    assert labeler.truncated_responses == 2 and all(map(torch.isfinite, torch.tensor(scores)))
    with pytest.raises(LabelerError, match=r"failed on rows .*a prompt of \d+ tokens.*prompts\.max_prompt_tokens"):
        labeler.score([LONG], ["6"], [None])
    with pytest.raises(ArmoRMError, match="prompts.max_prompt_tokens"):
        encode_conversations(labeler.tokenizer, [LONG], ["6"], 96, labeler.pattern)


def test_a_classifier_keeps_the_prompt_and_the_end_of_turn_too(tiny_classifier):
    labeler = build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), max_length=48,
                                        device="cpu", dtype="float32"))
    tokenizer = labeler.tokenizer
    rows, truncated = conversation_ids(tokenizer, [SHORT[0]], [LONG_RESPONSE], 48)
    end = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    prompt = tokenizer(chat_prompts(tokenizer, SHORT[:1])[0], add_special_tokens=False).input_ids
    assert truncated == [True] and len(rows[0]) == 48
    assert rows[0][: len(prompt)] == prompt and rows[0][-len(end):] == end
    labeler.score([SHORT[0]], [LONG_RESPONSE], [None])
    assert labeler.truncated_responses == 1


def test_the_label_stage_reports_cut_responses(tiny_llama, tiny_armorm, tmp_path):
    from prefect.logging import disable_run_logger

    from foresight.pairs import SAMPLE_COLUMNS
    from foresight.storage import write_table
    from tasks.label import label_task

    params = tiny_params(tmp_path, tiny_llama, label={"labeler": "armorm", "model": str(tiny_armorm),
                                                      "max_length": 96, "device": "cpu"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    cfg = load_config(tmp_path / "params.yaml")
    samples = pd.DataFrame([{"sample_id": f"p{i}/0", "prompt_id": f"p{i}", "sample_index": 0, "question": q,
                             "prompt": q, "response": r, "answer": None, "prompt_tokens": 1, "response_tokens": 1,
                             "finish_reason": "eos", "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                             "max_new_tokens": 12, "seed": 0, "model": "tiny"}
                            for i, (q, r) in enumerate([(SHORT[0], LONG_RESPONSE), (SHORT[1], "6")])],
                           columns=SAMPLE_COLUMNS)
    write_table(samples, cfg.path(cfg.paths.samples))
    with disable_run_logger():
        metrics = label_task.fn(cfg).metrics
    assert metrics["truncated_responses"] == 1 and metrics["num_scored"] == 2


LONG_INSTRUCTION = "Summarise this story in one line. " + "Ben has 4 apples and Ava gives Ben 2 more apples. " * 60


def _general_with_a_long_instruction(split, count=None, path=None):
    """The general instruction set's schema, one short and one over-long instruction (a set edited by hand)."""
    return pd.DataFrame({"prompt_id": ["general-short", "general-long"], "answer": None, "source": "general",
                         "question": ["Write a haiku.", LONG_INSTRUCTION], "category": "writing"})


def _medusa_cfg(root: Path, **sections):
    params = yaml.safe_load((root / "params.yaml").read_text())
    for name, values in sections.items():
        params.setdefault(name, {}).update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return load_config(root / "params.yaml")


def test_medusa_distillation_drops_over_long_further_prompts_and_general_instructions(tiny_llama, tmp_path,
                                                                                     monkeypatch, caplog):
    """Further task prompts (rows of the source the splits left unused: the over-long one among them, since
    prepare_prompts dropped it from the splits) and general instructions never passed prepare_prompts: the
    distillation drops those over the same limit, counts them per set and says so."""
    import logging

    import tasks.distill
    from tasks.common import load_stage_policy, read_prompts
    from tasks.distill import _distillation_data

    _prepare(tmp_path, tiny_llama, [*SHORT, LONG], num_train=4)
    cfg = _medusa_cfg(tmp_path, distill={"task_prompts": 20, "max_new_tokens": 2})
    monkeypatch.setattr(tasks.distill, "general_instructions", _general_with_a_long_instruction)
    with caplog.at_level(logging.WARNING):
        responses, dropped = _distillation_data(cfg, load_stage_policy(cfg, "base"))
    assert dropped == {"dropped_long_prompts.further": 1, "dropped_long_prompts.general": 1,
                       "dropped_long_prompts.self_instruct": 0}
    assert not any(LONG in p or LONG_INSTRUCTION in p for p in responses["prompt"])
    taken = len(read_prompts(cfg, "train")) + len(read_prompts(cfg, "eval"))
    assert int(responses["further_prompt"].sum()) == len(SHORT) - taken  # every short prompt the splits left
    assert (responses["prompt_set"] == "general").sum() == 1
    assert "prompt set 'further': dropped 1 of" in caplog.text and "prompt set 'general': dropped 1 of" in caplog.text


def test_benchmark_prompt_sets_drop_over_long_prompts_per_set(tiny_llama, tmp_path, monkeypatch):
    """The Medusa benchmark's general set and prompt files never passed prepare_prompts: the prompts over the limit
    leave every set, counted as ``dropped_long_prompts.<set>``; the held-out split passed already."""
    from transformers import AutoTokenizer

    import tasks.speculative_benchmark
    from tasks.speculative_benchmark import benchmark_prompt_sets

    _prepare(tmp_path, tiny_llama, SHORT)
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in [*SHORT[:3], LONG]))
    cfg = _medusa_cfg(tmp_path, medusa_benchmark={
        "num_prompts": 10, "general_prompts": 2, "prompt_files": [{"path": "mixed.jsonl", "text_column": "prompt"}]})
    monkeypatch.setattr(tasks.speculative_benchmark, "general_instructions", _general_with_a_long_instruction)
    sets, dropped = benchmark_prompt_sets(cfg, AutoTokenizer.from_pretrained(tiny_llama))
    assert dropped == {"dropped_long_prompts.held_out": 0, "dropped_long_prompts.general": 1,
                       "dropped_long_prompts.mixed": 1}
    assert sorted(sets["mixed"]) == sorted(SHORT[:3]) and sets["general"] == ["Write a haiku."]
    assert len(sets["held_out"]) == 2


def test_benchmark_prompt_files_are_sampled_across_the_file_with_the_seed(tmp_path):
    """A prompt file sorted by category: ``num_prompts`` rows drawn across the whole file (not its first rows, all
    of one category), the same draw every time, another with another ``medusa_benchmark.seed``."""
    from foresight.config import parse_config
    from tasks.speculative_benchmark import _prompt_sets

    (tmp_path / "data/prompts").mkdir(parents=True)
    pd.DataFrame({"question": ["q1", "q2"]}).to_json(tmp_path / "data/prompts/eval.jsonl", orient="records",
                                                     lines=True)
    rows = [f"{category} question {i}" for category in ("coding", "math", "writing") for i in range(10)]
    (tmp_path / "sorted.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in rows))

    def drawn(**benchmark) -> list[str]:
        cfg = parse_config({"medusa_benchmark": {"num_prompts": 6, "general_prompts": 0, "prompt_files": [
            {"path": "sorted.jsonl", "text_column": "prompt"}], **benchmark}}, root=tmp_path)
        return _prompt_sets(cfg)["sorted"]

    first = drawn()
    assert len(set(first)) == 6 and set(first) <= set(rows)
    assert len({q.split()[0] for q in first}) > 1  # not the first rows' one category
    assert drawn() == first and drawn(seed=0) == first
    assert drawn(seed=1) != first


def test_a_stage_decoding_longer_than_generate_keeps_only_prompts_that_leave_it_room(tiny_llama, tmp_path):
    """The prompt limit subtracts ``generate.max_new_tokens``; a stage decoding up to more tokens (Medusa's
    distillation or benchmark) keeps only prompts leaving its own budget room in the context, and a smaller budget
    leaves the shared limit as it is."""
    from models.engine.policy import policy_path
    from tasks.common import prompt_token_limit

    _prepare(tmp_path, tiny_llama, SHORT)
    cfg = load_config(tmp_path / "params.yaml")
    context = policy_context_length(policy_path(cfg.path(cfg.paths.policy_dir)))
    shared = context - cfg.generate.max_new_tokens
    assert prompt_token_limit(cfg) == shared
    assert prompt_token_limit(cfg, cfg.generate.max_new_tokens - 4) == shared
    assert prompt_token_limit(cfg, context - 10) == 10
