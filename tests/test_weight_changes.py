"""Updates below bfloat16 resolution (issue #31, item 8): every training stage reports the share of its trained
weights that changed in what it saved, warns when the update was rounded away, and a LoRA stage keeps its adapters
beside the merged weights, where the update survives. On the tiny Llama in bf16: LoRA at lr 1e-6 for 3 steps merges
into (almost) nothing; at 1e-3 it moves most weights."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models.common.lora import ADAPTER_DIR, Adapter, trained_weight_names
from models.common.training import ROUNDED_AWAY_SHARE, WeightChanges, train, weight_changes
from models.coral.config import CoralTraining
from models.coral.training import train_coral
from models.engine.config import PolicySpec
from models.engine.policy import load_pretrained
from models.sla.config import DPOTraining
from models.sla.dpo import train_dpo
from tests.helpers import distinct_sequences, make_pairs, rl_stage, run_rl_stage

# 6 pairs in batches of 2, one epoch: 3 optimizer steps
ROUNDED = DPOTraining(learning_rate=1e-6, epochs=1, batch_size=2, max_length=128, seed=0, lora_rank=4)
FITTING = ROUNDED.model_copy(update={"learning_rate": 1e-3})
LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def _count_from_files(saved: Path, initial: Path, names: list[str]) -> tuple[int, int]:
    """Changed and compared elements of ``names``, read straight from the two safetensors files (the initial one
    cast to the saved dtype: the weights as the stage loaded them)."""
    changed = total = 0
    with (safe_open(saved / "model.safetensors", "pt") as after,
          safe_open(initial / "model.safetensors", "pt") as before):
        for name in names:
            new = after.get_tensor(name)
            changed += int((new != before.get_tensor(name).to(new.dtype)).sum())
            total += new.numel()
    return changed, total


@pytest.mark.parametrize("training, rounded_away", [(ROUNDED, True), (FITTING, False)], ids=["lr1e-6", "lr1e-3"])
def test_dpo_lora_reports_the_share_of_weights_its_saved_merge_changed(tiny_llama, tmp_path, caplog, training,
                                                                       rounded_away):
    """``weights_changed`` is the share of the adapted layers' elements that differ between the saved folder and the
    initial checkpoint, counted from the real files; below ROUNDED_AWAY_SHARE a warning names the learning rate and
    the dtype. The adapter folder beside the merged weights holds the update whatever the merge kept."""
    from peft import PeftModel

    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="bfloat16"))
    out = tmp_path / "dpo"
    with caplog.at_level(logging.INFO):
        metrics = train_dpo(policy, make_pairs(policy.tokenizer, 6), training, out)
    assert metrics["steps"] == 3
    names = [f"model.layers.{layer}.{module}.weight" for layer in range(2) for module in LORA_TARGETS]
    changed, total = _count_from_files(out, tiny_llama, names)
    assert metrics["weights_changed"] == changed / total
    warnings = [r.getMessage() for r in caplog.records if "rounded away" in r.getMessage()]
    if rounded_away:
        assert metrics["weights_changed"] < ROUNDED_AWAY_SHARE  # measured: 0.76 % (only the tiniest weights move)
        assert len(warnings) == 1 and "learning rate 1e-06" in warnings[0] and "bfloat16" in warnings[0]
    else:
        assert metrics["weights_changed"] > 0.5 and not warnings
    # the adapters, in float32, merged into a float32 copy of the initial policy: every adapted weight moves
    adapter_config = (out / ADAPTER_DIR / "adapter_config.json")
    assert adapter_config.is_file() and (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    base = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="float32")).model
    initial = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    restored = PeftModel.from_pretrained(base, out / ADAPTER_DIR).merge_and_unload()
    moved = sum(int((restored.state_dict()[name] != initial[name]).sum()) for name in names)
    assert moved / total > 0.99


def test_coral_stage_two_lora_adapter_is_kept_where_the_merge_rounds_it_away(tiny_llama, tmp_path, caplog):
    """COrAL in bf16: stage 1 (the last layer, float32 masters, lr 1e-3) moves its weights; stage 2's LoRA at lr
    1e-6 merges into (almost) nothing, measured against the initial checkpoint files; the saved folder keeps stage
    2's adapter."""
    from tasks.coral import _write_coral_model

    policy = load_pretrained(tiny_llama, PolicySpec(device="cpu", dtype="bfloat16"))
    cfg = CoralTraining(stage1_epochs=1, stage2_epochs=3, batch_size=4, stage1_learning_rate=1e-3,
                        stage2_learning_rate=1e-6, lora_rank=2)
    names, adapters = {}, {}

    def on_trained(stage, model):
        names[stage], adapters[stage] = trained_weight_names(model), Adapter.of(model)

    history = train_coral(policy, distinct_sequences(4), cfg, on_trained=on_trained)
    assert history["stage"].count(2) == 3 and adapters[1] is None and adapters[2] is not None
    assert set(names[1]) == {name for name in policy.model.state_dict() if name.startswith("model.layers.1.")}
    assert set(names[2]) == {f"model.layers.0.{module}.weight" for module in LORA_TARGETS}
    out = tmp_path / "coral"
    _write_coral_model(policy, out, history, {}, adapters[2])
    assert (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    stage1, stage2 = (weight_changes(out, tiny_llama, names[stage]) for stage in (1, 2))
    assert (stage1.changed, stage1.total) == _count_from_files(out, tiny_llama, names[1])
    assert (stage2.changed, stage2.total) == _count_from_files(out, tiny_llama, names[2])
    assert stage1.share > 0.5 and stage2.share < ROUNDED_AWAY_SHARE


def test_weight_changes_reads_sharded_folders_and_skips_names_missing_on_one_side(tmp_path):
    """Tensor by tensor across shards; a name absent on either side (a tied output projection left out of a save)
    is not compared; nothing in common is NaN, not a division by zero."""
    from safetensors.torch import save_file

    (tmp_path / "a").mkdir()
    save_file({"x": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "a" / "model-00001-of-00002.safetensors")
    save_file({"y": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "a" / "model-00002-of-00002.safetensors")
    initial = {"x": torch.tensor([0.0, 1.0, 0.0, 1.0]), "y": torch.ones(2), "z": torch.zeros(3)}
    assert weight_changes(tmp_path / "a", initial) == WeightChanges(2, 6)
    assert weight_changes(tmp_path / "a", initial, ["x", "z"]) == WeightChanges(2, 4)
    assert weight_changes({"w": torch.zeros(1)}, initial).total == 0
    assert torch.isnan(torch.tensor(weight_changes({"w": torch.zeros(1)}, initial).share))


def test_the_shared_loop_reports_a_half_precision_module_whose_update_rounded_away(caplog):
    """``count_changes``: a bf16 module trained at lr 1e-7 (float32 masters, cast back) keeps its bf16 values; at
    lr 1e-2 they move. The history carries the share, and the rounded-away one is warned about."""
    from accelerate import Accelerator

    def step(model, batch):
        loss = ((model(batch.to(torch.bfloat16)).float() - 1.0) ** 2).mean()
        return loss, {"loss": loss.detach()}

    shares = []
    for lr in (1e-7, 1e-2):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8).to(torch.bfloat16)
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            _, history = train(model, torch.randn(8, 8), step, model.parameters(),
                               lambda params, lr=lr: torch.optim.Adam(params, lr=lr),
                               accelerator=Accelerator(cpu=True), epochs=3, batch_size=8, seed=0,
                               count_changes="a bf16 layer")
        shares.append(history["weights_changed"][0])
        assert any("rounded away" in r.getMessage() for r in caplog.records) == (lr == 1e-7)
    assert shares[0] < ROUNDED_AWAY_SHARE < 0.5 < shares[1]


def test_mtp_rl_stage_reports_the_policy_update_its_lora_merge_rounded_away(tiny_llama, tmp_path, caplog):
    """MTP-RL saves no policy: the merged policy it evaluates is compared with the policy's checkpoint files
    (``<variant>.weights_changed``); LoRA at the 8B recipe's old lr 2e-6 over 3 steps in bf16 is reported as rounded
    away."""

    train = {"What is 2 + 3?": "5", "What is 4 * 2?": "8", "What is 6 - 1?": "5"}
    cfg = rl_stage(tmp_path, tiny_llama, train, {"What is 9 - 7?": "2"}, policy={"dtype": "bfloat16"},
                   mtp_rl={"variants": ["vanilla"], "steps": 3, "prompts_per_step": 1, "curve_batch_sizes": [],
                           "lora_rank": 2, "learning_rate": 2e-6})
    stage_log = logging.getLogger("foresight.stage")  # the stage logger outside a Prefect run; it does not propagate
    stage_log.addHandler(caplog.handler)
    try:
        metrics = run_rl_stage(cfg).metrics
    finally:
        stage_log.removeHandler(caplog.handler)
    assert metrics["vanilla.weights_changed"] < ROUNDED_AWAY_SHARE
    # one record (set: it reaches caplog's handler twice where the logger propagates as well)
    warnings = [r.getMessage() for r in {r for r in caplog.records if "rounded away" in r.getMessage()}]
    assert len(warnings) == 1 and "MTP-RL vanilla" in warnings[0] and "learning rate 2e-06" in warnings[0]
