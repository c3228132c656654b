"""DPO on the tiny model: the loss checked by hand, end tokens, saved weights, and the Prefect task."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
import torch

from foresight.config import component, parse_config
from foresight.pairs import PAIR_COLUMNS
from foresight.storage import write_table
from models.engine.config import PolicySpec
from models.engine.generation import chat_prompts
from models.engine.policy import load_pretrained, prepare_policy
from models.sla.config import DPOTraining
from models.sla.dpo import build_trainer, preference_accuracy, tokenize_pair, train_dpo, with_eos
from tests.conftest import tiny_params

# A learning rate far above the real one, so a handful of steps visibly moves the tiny model.
FAST = DPOTraining(learning_rate=1e-3, epochs=2, batch_size=2, max_length=128, seed=0)


def make_pairs(tokenizer, n: int) -> pd.DataFrame:
    """``n`` hand-made pairs in the pipeline's format: templated prompt, right vs wrong answer."""
    questions = [f"Ben has {i} apples. Ava gives Ben 2 more apples. How many apples does Ben have now?"
                 for i in range(1, n + 1)]
    rows = [{
        "prompt_id": f"p{i}", "question": q, "prompt": prompt, "answer": str(i + 2),
        "chosen": f"Ben has {i} + 2 = {i + 2} apples. The answer is {i + 2}.", "rejected": f"The answer is {i}.",
        "chosen_score": 1.0, "rejected_score": 0.0, "score_gap": 1.0,
        "chosen_sample_id": f"p{i}/0", "rejected_sample_id": f"p{i}/1",
    } for i, (q, prompt) in enumerate(zip(questions, chat_prompts(tokenizer, questions)), start=1)]
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture()
def policy(tiny_llama):
    return load_pretrained(tiny_llama, PolicySpec(device="cpu"))


def test_train_dpo_first_loss_is_log2_and_only_the_copy_changes(policy, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
    initial_digest = folder_digest(tiny_llama)
    out_dir = tmp_path / "dpo"

    metrics = train_dpo(policy, make_pairs(policy.tokenizer, 6), FAST, out_dir)

    # Hand-worked: at step 1 the policy is the reference, so every log-ratio and the margin are 0 and
    # the loss is −log σ(β·0) = log 2, whatever β.
    assert metrics["loss_first"] == pytest.approx(math.log(2), abs=1e-3)
    assert metrics["reward_margin_first"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["num_pairs"] == 6 and metrics["steps"] == 6  # 3 batches × 2 epochs
    assert {"loss_last", "reward_accuracy_first", "reward_accuracy_last", "reward_margin_last",
            "train_seconds"} <= metrics.keys()

    tuned = AutoModelForCausalLM.from_pretrained(out_dir)
    assert (out_dir / "tokenizer.json").is_file()
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, initial[k])]
    assert changed, "training did not change any parameter"
    assert all(torch.equal(v, initial[k]) for k, v in policy.model.state_dict().items())  # caller's object
    assert folder_digest(tiny_llama) == initial_digest  # and the initial folder
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_responses_end_with_exactly_one_eos(policy, tmp_path):
    tok = policy.tokenizer
    pairs = make_pairs(tok, 3)
    pairs.loc[0, "chosen"] += tok.eos_token  # a response that already carries its end token keeps just one
    assert with_eos("x" + tok.eos_token, tok.eos_token) == "x" + tok.eos_token

    dataset = build_trainer(policy, pairs, FAST, tmp_path / "unused").train_dataset
    for example, pair in zip(dataset, pairs.itertuples()):
        for ids in (example["chosen_ids"], example["rejected_ids"]):
            assert ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id
        assert tok.decode(example["prompt_ids"]) == pair.prompt
        # evaluation scores exactly the tokens TRL trains on
        ours = tokenize_pair(tok, pair.prompt, pair.chosen, pair.rejected)
        assert ours == {k: example[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}


def test_preference_accuracy_of_the_untrained_policy_is_a_tie(policy):
    pairs = make_pairs(policy.tokenizer, 3)
    result = preference_accuracy(policy.model, policy.model, policy.tokenizer, pairs, beta=0.1)
    assert result == {"accuracy": 0.5, "margin": 0.0, "num_pairs": 3}


def _stage_config(root: Path, tiny_llama: Path, num_pairs: int):
    cfg = parse_config(tiny_params(root, tiny_llama, dpo=asdict(FAST), reward={"eval_fraction": 0.25}), root=root)
    spec = component(PolicySpec, cfg.policy)
    prepare_policy(spec, cfg.path(cfg.paths.policy_dir))
    tokenizer = load_pretrained(tiny_llama, spec).tokenizer
    write_table(make_pairs(tokenizer, num_pairs), cfg.path(cfg.paths.pairs))
    stale = cfg.path(cfg.paths.dpo_dir) / "stale.txt"  # a previous output that must be replaced whole
    stale.parent.mkdir(parents=True)
    stale.write_text("previous run")
    return cfg, stale


def test_dpo_task_writes_the_folder_atomically_and_reports(tiny_llama, tmp_path):
    from prefect.logging import disable_run_logger

    from tasks.sla import dpo_task

    cfg, stale = _stage_config(tmp_path, tiny_llama, num_pairs=8)
    with disable_run_logger():
        result = dpo_task.fn(cfg)

    dpo_dir = cfg.path(cfg.paths.dpo_dir)
    assert (dpo_dir / "config.json").is_file() and not stale.exists()
    assert not [p for p in dpo_dir.parent.iterdir() if p.name.startswith(".")]
    m = result.metrics
    assert m["num_pairs"] == 6 and m["num_heldout"] == 2  # the shared split: round(8 × 0.25) held out
    assert m["heldout_accuracy_before"] == 0.5 and m["heldout_margin_before"] == 0.0
    assert 0.0 <= m["heldout_accuracy_after"] <= 1.0 and m["heldout_margin_after"] != 0.0
    assert m["loss_first"] == pytest.approx(math.log(2), abs=1e-3)


def test_dpo_task_with_too_few_pairs_fails_clearly_and_keeps_the_previous_output(tiny_llama, tmp_path):
    from prefect.logging import disable_run_logger

    from tasks.sla import dpo_task

    cfg, stale = _stage_config(tmp_path, tiny_llama, num_pairs=2)  # 1 for training, 1 held out
    with disable_run_logger(), pytest.raises(ValueError, match="at least 2 training pairs, got 1"):
        dpo_task.fn(cfg)
    assert stale.read_text() == "previous run"
