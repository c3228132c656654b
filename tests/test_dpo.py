"""DPO on the tiny model: the loss checked by hand, end tokens, saved weights, and the Prefect task."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from foresight.config import parse_config
from foresight.storage import write_table
from models.common.curves import curve_sink
from models.engine.config import PolicySpec
from models.engine.policy import load_pretrained, prepare_policy
from models.sla.config import DPOTraining
from models.sla.dpo import build_trainer, pair_logps, preference_accuracy, tokenize_pair, train_dpo, with_eos
from tests.helpers import DPO_FAST, long_response, make_pairs, tiny_params


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture()
def policy(tiny_llama):
    return load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32"))


def test_train_dpo_first_loss_is_log2_and_only_the_copy_changes(policy, tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
    initial_digest = folder_digest(tiny_llama)
    out_dir = tmp_path / "dpo"

    steps = []  # what reaches the live curve sink (the stage's MLflow run in the pipeline), step by step
    with curve_sink(lambda values, step: steps.append((step, dict(values)))):
        metrics = train_dpo(policy, make_pairs(policy.tokenizer, 6), DPO_FAST, out_dir)

    # Hand-worked: at step 1 the policy is the reference, so every log-ratio and the margin are 0 and
    # the loss is −log σ(β·0) = log 2, whatever β.
    assert metrics["loss_first"] == pytest.approx(math.log(2), abs=1e-3)
    # one point per optimizer step (the end-of-training summary is none), under TRL's names
    assert [step for step, _ in steps] == list(range(1, metrics["steps"] + 1)) and metrics["steps"] == 6
    assert steps[0][1]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert steps[-1][1]["loss"] == pytest.approx(metrics["loss_last"])
    assert {"learning_rate", "grad_norm", "rewards/accuracies", "rewards/margins"} <= steps[0][1].keys()
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


def test_bf16_autocast_does_not_outlive_the_dpo_run(policy, tmp_path, monkeypatch):
    """Where bf16 is native (here forced), TRL trains under bf16 autocast, a setting accelerate keeps process-wide:
    an Accelerator made after ``train_dpo`` (the reward heads' one, say) must not inherit it."""
    from accelerate import Accelerator

    from models.sla import dpo

    monkeypatch.setattr(dpo, "cpu_has_bf16_units", lambda: True)
    trainer = build_trainer(policy, make_pairs(policy.tokenizer, 2), DPO_FAST, tmp_path / "unused")
    assert trainer.args.bf16 and trainer.accelerator.mixed_precision == "bf16"
    train_dpo(policy, make_pairs(policy.tokenizer, 2), DPO_FAST.model_copy(update={"epochs": 1}), tmp_path / "dpo")
    assert Accelerator(cpu=True).mixed_precision == "no"


def test_responses_end_with_exactly_one_eos(policy, tmp_path):
    tok = policy.tokenizer
    pairs = make_pairs(tok, 3)
    pairs.loc[0, "chosen"] += tok.eos_token  # a response that already carries its end token keeps just one
    assert with_eos("x" + tok.eos_token, tok.eos_token) == "x" + tok.eos_token

    dataset = build_trainer(policy, pairs, DPO_FAST, tmp_path / "unused").train_dataset
    for example, pair in zip(dataset, pairs.itertuples()):
        for ids in (example["chosen_ids"], example["rejected_ids"]):
            assert ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id
        assert tok.decode(example["prompt_ids"]) == pair.prompt
        # evaluation scores exactly the tokens TRL trains on
        ours = tokenize_pair(tok, pair.prompt, pair.chosen, pair.rejected)
        assert ours == {k: example[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}


def test_dpo_trains_on_the_ids_generation_decoded_from_with_one_bos(tiny_llama3_bos, tmp_path):
    """A Llama-3-style tokenizer adds <|begin_of_text|> itself and its chat template writes it too: the ids TRL trains
    on (each pair's chosen and rejected rows as its collator builds them) are the generate stage's prompt ids + the
    response ids + the end token, with exactly one BOS; evaluation (tokenize_pair) scores the same ids."""
    from models.engine.generation import encode_prompt

    policy = load_pretrained(tiny_llama3_bos, PolicySpec(device="cpu", dtype="float32"))
    tok = policy.tokenizer
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # the fixture adds a BOS, as Llama-3's tokenizer does
    pairs = make_pairs(tok, 2)
    trainer = build_trainer(policy, pairs, DPO_FAST, tmp_path / "unused")
    for example, pair in zip(trainer.train_dataset, pairs.itertuples(), strict=True):
        prompt_ids = encode_prompt(policy, pair.prompt)[0].tolist()  # what the policy decoded from
        assert prompt_ids[0] == tok.bos_token_id
        batch = trainer.data_collator([example])  # the chosen row, then the rejected row, right-padded
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
        for row, response in zip(rows, (pair.chosen, pair.rejected), strict=True):
            assert row == prompt_ids + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert row.count(tok.bos_token_id) == 1
        ours = tokenize_pair(tok, pair.prompt, pair.chosen, pair.rejected)
        assert ours == {k: example[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}


def test_a_pair_too_long_for_max_length_is_dropped_and_counted_never_cut(policy, tmp_path):
    """A 512-token response keeps its end token at a max_length that fits it; one token less and the pair is left
    out and counted, where TRL would have cut the end token off one side only."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = policy.tokenizer
    pairs = make_pairs(tok, 3)
    pairs.loc[0, "chosen"] = long_response(tok, 512)
    prompt_ids = tok(pairs["prompt"][0], add_special_tokens=False)["input_ids"]
    fitting = len(prompt_ids) + 512 + 1  # the prompt, the response and its end token
    trainer = build_trainer(policy, pairs, DPO_FAST.model_copy(update={"max_length": fitting}), tmp_path / "unused")
    example = trainer.train_dataset[0]
    collate = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=fitting)  # TRL's own
    chosen = collate([example])["input_ids"][0].tolist()
    assert len(chosen) == fitting and chosen[-1] == tok.eos_token_id

    metrics = train_dpo(policy, pairs, DPO_FAST.model_copy(update={"max_length": fitting - 1, "epochs": 1}),
                        tmp_path / "dpo")
    assert (metrics["num_pairs"], metrics["num_pairs_dropped_too_long"]) == (2, 1)
    with pytest.raises(ValueError, match="longer than max_length"):  # evaluation never cuts either
        pair_logps(policy.model, tok, pairs, max_length=fitting - 1)


def test_preference_accuracy_of_the_untrained_policy_is_a_tie(policy):
    logps = pair_logps(policy.model, policy.tokenizer, make_pairs(policy.tokenizer, 3))
    result = preference_accuracy(logps, logps, beta=0.1)
    assert result == {"accuracy": 0.5, "margin": 0.0, "num_pairs": 3, "pair_outcomes": [0.5, 0.5, 0.5]}


def test_preference_accuracy_against_hand_worked_margins():
    """Margins β·((π_w − ref_w) − (π_l − ref_l)) = 0.1·(3 − 1), 0.1·(−1 − 0), 0.1·(0 − 0): a win, a loss, a tie."""
    policy_logps = (torch.tensor([-1.0, -5.0, -2.0]), torch.tensor([-4.0, -3.0, -2.0]))
    reference_logps = (torch.tensor([-4.0, -4.0, -2.0]), torch.tensor([-5.0, -3.0, -2.0]))
    result = preference_accuracy(policy_logps, reference_logps, beta=0.1)
    assert result["pair_outcomes"] == [1.0, 0.0, 0.5] and result["accuracy"] == 0.5
    assert result["margin"] == pytest.approx((0.2 - 0.1 + 0.0) / 3)


def _stage_config(root: Path, tiny_llama: Path, num_pairs: int):
    cfg = parse_config(tiny_params(root, tiny_llama, dpo=DPO_FAST.model_dump(), reward={"eval_fraction": 0.25}),
                       root=root)
    spec = cfg.policy
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
    assert m["num_pairs_dropped_too_long"] == 0 and m["num_heldout_dropped_too_long"] == 0
    assert m["heldout_accuracy_before"] == 0.5 and m["heldout_margin_before"] == 0.0
    # every margin is 0 before training: a zero-width interval at 0.5, not significant
    assert (m["heldout_accuracy_before_low"], m["heldout_accuracy_before_high"]) == (0.5, 0.5)
    assert m["heldout_accuracy_before_significant"] is False
    assert 0.0 <= m["heldout_accuracy_after"] <= 1.0 and m["heldout_margin_after"] != 0.0
    assert m["heldout_accuracy_after_low"] <= m["heldout_accuracy_after"] <= m["heldout_accuracy_after_high"]
    assert m["num_heldout_prompts"] == 2
    assert m["loss_first"] == pytest.approx(math.log(2), abs=1e-3)
    # the trainer's step logs are the stage's curves (logged live to its MLflow run inside the pipeline)
    assert len(result.curves["loss"]) == m["steps"] and result.curves["loss"][-1] == pytest.approx(m["loss_last"])
    assert "rewards/accuracies" in result.curves and "epoch" not in result.curves


def test_dpo_trains_on_best_worst_pairs_unless_all_are_asked_for(tiny_llama, tmp_path, monkeypatch):
    """Two pairs per prompt, one flagged ``best_worst``: DPO trains on the flagged ones (``dpo.pairs:
    best_worst``) or on all; both evaluate every held-out pair. Pairs written before the flag existed fail
    clearly under ``best_worst``."""
    from prefect.logging import disable_run_logger

    import tasks.sla
    from tasks.sla import dpo_task

    cfg, _ = _stage_config(tmp_path, tiny_llama, num_pairs=8)
    pairs = make_pairs(load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32")).tokenizer, 8)
    second = pairs.assign(rejected="I do not know.", best_worst=False)
    write_table(pd.concat([pairs, second], ignore_index=True), cfg.path(cfg.paths.pairs))
    trained_on, trainings = [], []

    def fake_train_dpo(policy, train_pairs, training, out_dir):  # records the pairs; saves the policy untouched
        trained_on.append(train_pairs)
        trainings.append(training)
        policy.model.save_pretrained(out_dir)
        policy.tokenizer.save_pretrained(out_dir)
        return {"num_pairs": len(train_pairs), "num_pairs_dropped_too_long": 0}

    monkeypatch.setattr(tasks.sla, "train_dpo", fake_train_dpo)
    with disable_run_logger():
        best_worst = dpo_task.fn(cfg).metrics
        everything = dpo_task.fn(cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"pairs": "all"})})).metrics
    assert len(trained_on[0]) == 6 and trained_on[0]["best_worst"].all()  # 6 training prompts, one pair each
    # the dpo section is the DPOTraining handed to train_dpo: its keys (DPO_FAST's, not the defaults) reach it
    assert isinstance(trainings[0], DPOTraining) and trainings[0].model_dump() == cfg.dpo.model_dump()
    assert trainings[0].learning_rate == DPO_FAST.learning_rate != DPOTraining().learning_rate
    assert len(trained_on[1]) == 12 and trained_on[1]["prompt_id"].nunique() == 6
    assert best_worst["num_heldout"] == everything["num_heldout"] == 4  # the 2 held-out prompts' pairs, all
    assert best_worst["num_heldout_prompts"] == 2
    write_table(pairs.drop(columns="best_worst"), cfg.path(cfg.paths.pairs))
    with disable_run_logger(), pytest.raises(ValueError, match="no best_worst column"):
        dpo_task.fn(cfg)


def test_dpo_task_with_too_few_pairs_fails_clearly_and_keeps_the_previous_output(tiny_llama, tmp_path):
    from prefect.logging import disable_run_logger

    from tasks.sla import dpo_task

    cfg, stale = _stage_config(tmp_path, tiny_llama, num_pairs=2)  # 1 for training, 1 held out
    with disable_run_logger(), pytest.raises(ValueError, match="at least 2 training pairs, got 1"):
        dpo_task.fn(cfg)
    assert stale.read_text() == "previous run"


# ---------------------------------------------------------------------------------------------------
# precision and memory knobs


def _saved_policy_checks(out_dir: Path, initial: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """``out_dir`` is a plain Hugging Face model (no adapters) in ``dtype``, with its KV cache on, whose weights
    moved away from ``initial``."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((out_dir / "config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.") and config["use_cache"] is True
    assert not (out_dir / "adapter_config.json").exists()
    weights = load_file(out_dir / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {dtype}
    assert not [name for name in weights if "lora" in name]
    tuned = AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto")
    assert tuned.dtype == dtype
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, initial[k])]
    assert changed, "training did not change any saved weight"


@pytest.mark.parametrize(("lora_rank", "gradient_checkpointing"), [(0, False), (4, True)], ids=["full", "lora"])
def test_bf16_policy_trains_and_saves_a_plain_bf16_model(tiny_llama, tmp_path, lora_rank, gradient_checkpointing):
    """A bf16 policy (what ``dtype: auto`` gives on CUDA): full fine-tuning trains a float32 copy, LoRA trains
    float32 adapters on the bf16 weights; either way the saved folder is a plain bf16 model (full fine-tuning
    used to save its float32 copy: twice the size, and loaded back in float32), adapters merged, and the KV
    cache the Trainer switches off is on again in the saved config."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="bfloat16"))
    initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
    cfg = DPO_FAST.model_copy(update={"epochs": 1, "lora_rank": lora_rank,
                                  "gradient_checkpointing": gradient_checkpointing})
    metrics = train_dpo(policy, make_pairs(policy.tokenizer, 4), cfg, tmp_path / "dpo")
    assert metrics["loss_first"] == pytest.approx(math.log(2), abs=1e-3)  # step 1: policy = reference
    assert metrics["steps"] == 2 and math.isfinite(metrics["loss_last"])
    _saved_policy_checks(tmp_path / "dpo", initial, torch.bfloat16)
    assert all(torch.equal(v, initial[k]) for k, v in policy.model.state_dict().items())  # caller's object
    assert policy.model.config.use_cache is True


def test_lora_trains_adapters_only_and_the_reference_is_the_model_with_adapters_off(policy, tmp_path):
    """With ``lora_rank`` > 0 no reference copy of the policy is held: TRL's reference log-probs come from the
    trained model itself, through a frozen copy of the freshly initialised adapters (``ref``: B = 0, so it adds
    exactly nothing), and switching the adapters off gives back the initial policy's log-probs exactly."""
    from models.common.lora import adapters_disabled, is_lora

    pairs = make_pairs(policy.tokenizer, 4)
    trainer = build_trainer(policy, pairs, DPO_FAST.model_copy(update={"epochs": 1, "lora_rank": 4}),
                            tmp_path / "unused")
    assert trainer.ref_model is None and is_lora(trainer.model)
    initial = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trained_names = {k for k, v in trainer.model.named_parameters() if v.requires_grad}
    assert trained_names and all(".lora_A.default." in k or ".lora_B.default." in k for k in trained_names)
    assert all(torch.all(v == 0) for k, v in initial.items() if ".lora_B.ref." in k)
    trainer.train()

    # bf16 autocast (CUDA, or a CPU with bf16 units) leaves accelerate's autocast wrapper on the forward: taken off
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()
    after = dict(model.named_parameters())
    assert all(not torch.equal(after[k], initial[k]) for k in trained_names if ".lora_B." in k)  # adapters trained
    assert all(torch.equal(after[k], v) for k, v in initial.items() if k not in trained_names)  # base and ref frozen
    initial_logps = pair_logps(policy.model, policy.tokenizer, pairs)
    with adapters_disabled(model):
        reference_logps = pair_logps(model, policy.tokenizer, pairs)
    trained_logps = pair_logps(model, policy.tokenizer, pairs)
    assert all(torch.equal(r, i) for r, i in zip(reference_logps, initial_logps, strict=True))
    assert not torch.equal(trained_logps[0], initial_logps[0])


@pytest.mark.cuda
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_dpo_step_on_the_gpu_in_bf16(tiny_llama, tmp_path, lora_rank):
    """One DPO step on CUDA with the policy in bf16 (autocast, float32 master weights or adapters), saved bf16."""
    policy = load_pretrained(tiny_llama, PolicySpec(device="cuda", dtype="bfloat16"))
    initial = {k: v.cpu().clone() for k, v in policy.model.state_dict().items()}
    cfg = DPO_FAST.model_copy(update={"epochs": 1, "lora_rank": lora_rank, "gradient_checkpointing": lora_rank > 0})
    metrics = train_dpo(policy, make_pairs(policy.tokenizer, 2), cfg, tmp_path / "dpo")
    assert metrics["steps"] == 1 and metrics["loss_first"] == pytest.approx(math.log(2), abs=1e-2)
    _saved_policy_checks(tmp_path / "dpo", initial, torch.bfloat16)
    assert next(policy.model.parameters()).device.type == "cuda"
