"""The ``distill`` stage (tasks/distill.py): the policy's responses that Medusa's heads, RLMedusa, COrAL and the MTP
module learn from, one DVC output of its own params section, so that no method's knobs change another method's data
(issue #33)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import tiny_params

TRAIN = ["Ben has 4 apples.", "Ivy has 3 cookies.", "What is 7 * 8?", "0 1 2 3", "Tom has 5 pens."]
EVAL = ["Ava has 2 marbles.", "What is 3 + 5?"]
DRAFTERS = ("train_medusa", "train_rlmedusa", "train_coral", "train_mtp")


def _stage(name: str):
    from foresight.stages import STAGES

    return next(stage for stage in STAGES if stage.name == name)


def _distill_cfg(root: Path, tiny_llama: Path, **sections):
    """The distill stage's own config (its declared keys alone, as its process loads them) over a params.yaml of the
    tiny pipeline plus ``sections``, with the prepared policy and the prompt splits in place."""
    from foresight.params import load_params
    from foresight.prompts import PROMPT_COLUMNS
    from foresight.storage import write_table
    from models.engine.policy import prepare_policy

    root.mkdir(parents=True, exist_ok=True)
    merged = {"distill": {"task_prompts": 7, "general_prompts": 3, "max_new_tokens": 6, "eval_fraction": 0.4}}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    params = tiny_params(root, tiny_llama, **merged)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    cfg = load_params(root / "params.yaml", keys=_stage("distill").config_keys)
    prepare_policy(cfg.policy, cfg.path(cfg.paths.policy_dir))
    for split, questions in (("train", TRAIN), ("eval", EVAL)):
        table = pd.DataFrame({"prompt_id": [f"{split}{i}" for i in range(len(questions))], "question": questions,
                              "answer": None, "source": "arithmetic"})
        write_table(table[PROMPT_COLUMNS], cfg.path(cfg.paths.prompts_dir) / f"{split}.jsonl")
    return cfg


def test_distill_writes_the_responses_their_split_and_the_dropped_prompts(tiny_llama, tmp_path):
    """The policy's greedy responses to the training prompts, further prompts and general instructions, in that
    order; one split by prompt in which the further prompts' responses all train; the over-long prompts counted."""
    from foresight.prompts import general_instructions
    from models.engine.decoding import greedy_responses
    from tasks.common import load_stage_policy
    from tasks.distill import distill_task

    cfg = _distill_cfg(tmp_path, tiny_llama)
    result = distill_task.fn(cfg)
    out = tmp_path / "data/distill"
    assert sorted(path.name for path in out.iterdir()) == ["dropped_long_prompts.json", "responses.parquet",
                                                           "split.safetensors"]
    responses = pd.read_parquet(out / "responses.parquet")
    assert responses["prompt_set"].tolist() == ["task"] * 7 + ["general"] * 3
    assert responses["further_prompt"].tolist() == [False] * 5 + [True] * 2 + [False] * 3
    assert all(q in p for q, p in zip(TRAIN, responses["prompt"], strict=False))
    general = general_instructions("train", 3)
    expected = greedy_responses(load_stage_policy(cfg, "base"), general, 6, 40, cfg.prompts.system_prompt)
    assert responses["response"][7:].tolist() == expected["response"].tolist()  # batch composition plays no part

    split = load_file(out / "split.safetensors")
    train, held_out = split["train_samples"].tolist(), split["eval_samples"].tolist()
    assert sorted(train + held_out) == list(range(10)) and held_out
    assert set(responses.index[responses["further_prompt"]]) <= set(train)  # Medusa's heads' alone: all train
    assert not set(responses["prompt_id"][train]) & set(responses["prompt_id"][held_out])  # split by prompt
    assert json.loads((out / "dropped_long_prompts.json").read_text()) == {
        "dropped_long_prompts.further": 0, "dropped_long_prompts.general": 0, "dropped_long_prompts.self_instruct": 0}
    assert {key: result.metrics[key] for key in ("num_responses", "num_task_responses", "num_general_responses",
                                                 "num_further_responses", "num_train_responses",
                                                 "num_eval_responses", "dropped_long_prompts.general")} == {
        "num_responses": 10, "num_task_responses": 7, "num_general_responses": 3, "num_further_responses": 2,
        "num_train_responses": len(train), "num_eval_responses": len(held_out), "dropped_long_prompts.general": 0}


def test_no_drafters_knobs_reach_the_distill_stage_and_every_drafter_reads_its_output(tiny_llama, tmp_path):
    """The distill stage declares no medusa / rlmedusa / coral / mtp key (dvc.yaml tracks none for it): changing
    them leaves its config, and so its outputs, exactly as they were; its own seed changes its split. Each drafter
    stage reads ``${paths.distill_dir}``, and train_medusa no longer declares what the distillation read."""
    from foresight.config import parse_config
    from foresight.params import UndeclaredKeyError
    from foresight.stages import render_dvc_yaml
    from tasks.distill import distill_task

    stage = _stage("distill")
    methods = ("medusa", "rlmedusa", "medusa_benchmark", "coral", "mtp")
    assert not [key for key in stage.config_keys if key.split(".")[0] in methods]
    entry = yaml.safe_load(render_dvc_yaml(parse_config({}, root=tmp_path), [stage]))["stages"]["distill"]
    assert not [key for key in entry["params"] if key.split(".")[0] in methods]
    assert entry["outs"] == ["${paths.distill_dir}"] and "models/medusa" not in " ".join(entry["deps"])
    for name in DRAFTERS:
        assert "${paths.distill_dir}" in _stage(name).inputs, name
    assert _stage("train_medusa").params == ("policy", "medusa")

    knobs = {"medusa": {"seed": 7, "distill_batch_size": 2, "max_length": 64, "num_heads": 3},
             "rlmedusa": {"seed": 9, "trajectory_tokens": 2, "top_pool": 5}}
    base, changed = _distill_cfg(tmp_path / "a", tiny_llama), _distill_cfg(tmp_path / "b", tiny_llama, **knobs)
    with pytest.raises(UndeclaredKeyError):
        changed.medusa  # noqa: B018  (an undeclared section fails where it is read)
    dump = lambda cfg: {k: v for k, v in cfg.model_dump(mode="json").items() if k != "tracking"}  # noqa: E731
    assert dump(base) == dump(changed)
    distill_task.fn(base)
    distill_task.fn(changed)
    for name in ("responses.parquet", "split.safetensors", "dropped_long_prompts.json"):
        assert (tmp_path / "a/data/distill" / name).read_bytes() == (tmp_path / "b/data/distill" / name).read_bytes()

    reseeded = _distill_cfg(tmp_path / "c", tiny_llama, distill={"seed": 1})
    distill_task.fn(reseeded)
    splits = [load_file(tmp_path / run / "data/distill/split.safetensors")["eval_samples"] for run in ("a", "c")]
    assert not torch.equal(*splits)


def test_self_instruct_responses_all_train_and_the_benchmark_instructions_stay_out(tiny_llama, tmp_path):
    """With ``distill.self_instruct_prompts``: the instructions the policy wrote join as ``general`` responses marked
    ``self_instruct``, after the hand-written ones; they all train, so the held-out responses are exactly those of
    the run without them; and nothing distilled is an instruction of the benchmarks' held-out general set."""
    from foresight.prompts import general_instructions
    from foresight.self_instruct import SOURCE
    from tasks.distill import distill_task

    written = {"self_instruct_prompts": 2, "self_instruct": {"min_tokens": 1, "max_tokens": 24, "batch_size": 4}}
    base = _distill_cfg(tmp_path / "a", tiny_llama)
    with_written = _distill_cfg(tmp_path / "b", tiny_llama, distill=written)
    distill_task.fn(base)
    result = distill_task.fn(with_written)
    before, after = (pd.read_parquet(tmp_path / run / "data/distill/responses.parquet") for run in ("a", "b"))
    assert after["prompt_set"].tolist() == ["task"] * 7 + ["general"] * 5
    assert after["self_instruct"].tolist() == [False] * 10 + [True] * 2 and not before["self_instruct"].any()
    assert after["prompt_id"][10:].str.startswith(f"{SOURCE}-").all()
    pd.testing.assert_frame_equal(after.iloc[:10].drop(columns="self_instruct"), before.drop(columns="self_instruct"))
    splits = [load_file(tmp_path / run / "data/distill/split.safetensors") for run in ("a", "b")]
    assert torch.equal(splits[0]["eval_samples"], splits[1]["eval_samples"])
    assert {10, 11} <= set(splits[1]["train_samples"].tolist())
    assert (result.metrics["num_self_instruct_responses"], result.metrics["num_general_responses"]) == (2, 5)
    assert result.metrics["dropped_long_prompts.self_instruct"] == 0

    benchmark = general_instructions("eval")
    assert not set(benchmark["prompt_id"]) & set(after["prompt_id"])
    assert not [q for q in benchmark["question"] for prompt in after["prompt"] if q in prompt]


def test_sampled_responses_join_the_mtp_data_and_no_held_out_prompt_is_learnt_from(tiny_llama, tmp_path):
    """``mtp.samples_per_prompt``: the first n scored samples of each training prompt join the MTP module's
    distilled responses as rows that always train; the samples of the prompts the distilled split holds out stay
    out, so the held-out sequences (and so every drafter's measured acceptance) are those of the run without them;
    with ``mtp.data: correct`` the setting is an error."""
    from foresight.config import parse_config
    from foresight.params import load_params
    from foresight.storage import write_table
    from tasks.distill import distill_task
    from tasks.distilled import drafter_split, sampled_responses, sft_responses

    cfg = _distill_cfg(tmp_path, tiny_llama)
    distill_task.fn(cfg)
    responses = pd.read_parquet(tmp_path / "data/distill/responses.parquet")
    held_out = set(responses["prompt_id"][load_file(tmp_path / "data/distill/split.safetensors")["eval_samples"]
                                          .tolist()])
    task_prompts = responses[~responses["further_prompt"] & (responses["prompt_set"] == "task")]
    assert held_out & set(task_prompts["prompt_id"]) and set(task_prompts["prompt_id"]) - held_out
    samples = pd.DataFrame([{"sample_id": f"{row.prompt_id}-{i}", "prompt_id": row.prompt_id, "sample_index": i,
                             "prompt": row.prompt, "response": f"sample {i}", "finish_reason": "stop", "score": 0.0}
                            for row in task_prompts.itertuples() for i in range(3)])
    mtp_cfg = load_params(tmp_path / "params.yaml", keys=_stage("train_mtp").config_keys)
    write_table(samples, mtp_cfg.path(mtp_cfg.paths.scores))

    sampled = sampled_responses(mtp_cfg, 2, "mtp.samples_per_prompt")
    kept = sorted(set(task_prompts["prompt_id"]) - held_out)
    assert sorted(sampled["prompt_id"].unique()) == kept and len(sampled) == 2 * len(kept)
    assert set(sampled["response"]) == {"sample 0", "sample 1"} and sampled["prompt_set"].eq("task").all()
    distilled = sft_responses(mtp_cfg, "distilled", "mtp.data", further=True)
    joined = pd.concat([distilled, sampled], ignore_index=True)
    train, evaluation = drafter_split(mtp_cfg, joined, 0.2, 0)
    assert evaluation.tolist() == drafter_split(mtp_cfg, distilled, 0.2, 0)[1].tolist()  # the same held-out rows
    assert set(range(len(distilled), len(joined))) <= set(train.tolist())  # every sample trains
    with pytest.raises(ValueError, match="samples_per_prompt"):
        parse_config({"mtp": {"data": "correct", "samples_per_prompt": 2}}, root=tmp_path)
