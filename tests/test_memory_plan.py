"""``foresight plan`` (foresight/memory.py): parameters counted on the meta device from a config.json alone, each
stage's peak GPU memory, the knob that makes a stage fit, each stage's disk footprint against a budget, and the
CLI's tables and exit code.

References: Llama-3-8B-Instruct's published config and size (8.03 B parameters), SmolLM2-135M's (~135 M).
"""

from __future__ import annotations

import pytest
import yaml

from flows.cli import main
from foresight.config import parse_config
from foresight.memory import (GIB, PROMPT_TOKENS, Shapes, disk_plan, labeler_shape, model_shape, plan,
                              policy_config)
from foresight.stages import STAGES

LORA_EVERYWHERE = {section: {"lora_rank": 16} for section in ("dpo", "coral", "mtp_rl")}


def _config_folder(folder, **values):
    from transformers import LlamaConfig

    LlamaConfig(**values).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory):
    """Meta-Llama-3-8B-Instruct's config.json (no weights)."""
    return _config_folder(tmp_path_factory.mktemp("llama3-8b"), vocab_size=128256, hidden_size=4096,
                          intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def smollm_135m(tmp_path_factory):
    """SmolLM2-135M-Instruct's config.json (the default policy's shape)."""
    return _config_folder(tmp_path_factory.mktemp("smollm2-135m"), vocab_size=49152, hidden_size=576,
                          intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          max_position_embeddings=8192, tie_word_embeddings=True)


def _cfg(tmp_path, model, **sections):
    return parse_config({"policy": {"model": str(model), "dtype": "auto"}, **sections}, root=tmp_path)


@pytest.fixture(scope="module")
def llama3_shapes(llama3_8b, tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("root"), llama3_8b)
    return Shapes(model_shape(policy_config(cfg)), None)


def _by_stage(plans):
    return {p.estimate.stage: p for p in plans}


def test_llama3_8b_is_counted_from_its_config_alone(llama3_shapes):
    shape = llama3_shapes.policy
    assert shape.parameters == pytest.approx(8.03e9, rel=0.01)
    assert shape.embedding == shape.lm_head == 128256 * 4096  # untied
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.head_dim) == (32, 4096, 8, 128)
    # LoRA on every linear of a layer: q, o 4096→4096; k, v 4096→1024; gate, up 4096→14336; down 14336→4096
    assert shape.lora_in_out == 32 * (2 * 8192 + 2 * 5120 + 3 * 18432)


def test_full_fine_tuning_dpo_does_not_fit_one_80_gb_gpu_and_lora_is_named(tmp_path, llama3_8b, llama3_shapes):
    plans = _by_stage(plan(_cfg(tmp_path, llama3_8b), 80, 1, shapes=llama3_shapes))
    assert [p.estimate.stage for p in plans.values()] == [s.name for s in STAGES]
    dpo = plans["dpo"]
    assert not dpo.fits and dpo.fix == {"dpo.lora_rank": 16}
    assert dpo.estimate.parts["reference copy"] == dpo.estimate.parts["weights"] == 2 * llama3_shapes.policy.parameters
    assert not plans["train_coral"].fits and not plans["train_mtp_rl"].fits
    assert plans["generate"].fits and plans["benchmark_medusa"].fits


def test_lora_makes_every_stage_fit_one_80_gb_gpu(tmp_path, llama3_8b, llama3_shapes):
    plans = plan(_cfg(tmp_path, llama3_8b, **LORA_EVERYWHERE), 80, 1, shapes=llama3_shapes)
    assert all(p.fits for p in plans), [(p.estimate.stage, p.per_gpu / GIB) for p in plans if not p.fits]
    dpo = _by_stage(plans)["dpo"]
    assert "reference copy" not in dpo.estimate.parts  # the reference is the base with adapters disabled
    # two bf16 copies (the loaded policy and the one trained) + adapters' state + activations: 15 + 15 + 0.6 + 17 + 2
    assert dpo.estimate.parts["training copy"] == dpo.estimate.parts["weights"]
    assert 45 * GIB < dpo.per_gpu < 55 * GIB



def test_the_float32_recheck_of_medusa_divergences_is_counted_and_can_be_switched_off(tmp_path, llama3_8b,
                                                                                       llama3_shapes):
    """The Medusa benchmark loads a float32 copy of a bf16 policy to score divergences: 4 bytes a parameter on top
    of the bf16 weights (32 GB at 8B); on a 40 GB GPU switching the recheck off is the first fix."""
    medusa = _by_stage(plan(_cfg(tmp_path, llama3_8b), 40, 1, shapes=llama3_shapes))["benchmark_medusa"]
    assert medusa.estimate.parts["float32 recheck copy"] == 4 * llama3_shapes.policy.parameters
    assert not medusa.fits and medusa.fix == {"medusa_benchmark.float32_recheck": False}
    off = _cfg(tmp_path, llama3_8b, medusa_benchmark={"float32_recheck": False})
    medusa = _by_stage(plan(off, 40, 1, shapes=llama3_shapes))["benchmark_medusa"]
    assert "float32 recheck copy" not in medusa.estimate.parts and medusa.fits
    float32 = _cfg(tmp_path, llama3_8b, policy={"model": str(llama3_8b), "dtype": "float32"})
    assert "float32 recheck copy" not in _by_stage(plan(float32, 80, 1, shapes=llama3_shapes))[
        "benchmark_medusa"].estimate.parts  # a float32 policy is its own recheck

def test_long_sequences_need_checkpointing_too(tmp_path, llama3_8b, llama3_shapes):
    """2 × 8 sequences of 1024 tokens: ~68 GiB of activations alone, so LoRA is not enough."""
    cfg = _cfg(tmp_path, llama3_8b, dpo={"batch_size": 8, "max_length": 1024})
    dpo = _by_stage(plan(cfg, 80, 1, shapes=llama3_shapes))["dpo"]
    assert dpo.fix == {"dpo.lora_rank": 16, "dpo.gradient_checkpointing": True}


def test_more_processes_than_gpus_share_them(tmp_path, llama3_8b, llama3_shapes):
    cfg = _cfg(tmp_path, llama3_8b, launch={"num_processes": 3}, **LORA_EVERYWHERE)
    plans = _by_stage(plan(cfg, 80, 1, shapes=llama3_shapes))
    assert plans["dpo"].per_gpu == 3 * plans["dpo"].estimate.total and not plans["dpo"].fits
    assert plans["dpo"].fix == {"launch.num_processes": 1}
    assert plans["generate"].fits  # inference stages run in one process
    on_three = _by_stage(plan(cfg, 80, 3, shapes=llama3_shapes))
    assert on_three["dpo"].fits and on_three["dpo"].per_gpu == plans["dpo"].estimate.total


def test_a_local_labeler_is_counted_and_an_absent_one_assumed_the_policys_size(tmp_path, llama3_8b, smollm_135m,
                                                                                 llama3_shapes):
    local = _cfg(tmp_path, llama3_8b, label={"labeler": "hf-classifier", "model": str(smollm_135m)})
    labeler = labeler_shape(local, llama3_shapes.policy)
    assert labeler.parameters == pytest.approx(1.35e8, rel=0.02) and not labeler.note
    absent = _cfg(tmp_path, llama3_8b, label={"labeler": "armorm", "model": "nobody/not-downloaded-rm"})
    assumed = labeler_shape(absent, llama3_shapes.policy)
    assert assumed.parameters == llama3_shapes.policy.parameters and "assumed the policy's size" in assumed.note
    label = _by_stage(plan(absent, 80, 1, shapes=Shapes(llama3_shapes.policy, assumed)))["label"]
    assert label.fits and label.estimate.parts["labeler weights"] == 2 * llama3_shapes.policy.parameters


def test_a_reward_model_as_the_grpo_reward_is_counted_beside_the_policy(tmp_path, llama3_8b, smollm_135m,
                                                                        llama3_shapes):
    """train_mtp_rl with a model labeler holds its weights and one forward's working set, as the label stage
    counts them; with the verifiable labeler it holds no labeler."""
    label = {"labeler": "hf-classifier", "model": str(smollm_135m), "batch_size": 4, "max_length": 512}
    cfg = _cfg(tmp_path, llama3_8b, label=label, **LORA_EVERYWHERE)
    labeler = labeler_shape(cfg, llama3_shapes.policy)
    with_model = _by_stage(plan(cfg, 80, 1, shapes=Shapes(llama3_shapes.policy, labeler)))
    rl = with_model["train_mtp_rl"].estimate.parts
    # bf16 (label.dtype auto); one layer's transient tensors: 4 rows × 512 tokens × (2 · 576 + 2 · 1536) × 2 B
    assert rl["labeler weights"] == 2 * labeler.parameters
    assert rl["labeler forward"] == 4 * 512 * (2 * 576 + 2 * 1536) * 2
    assert {key: rl[key] for key in ("labeler weights", "labeler forward")} == with_model["label"].estimate.parts
    alone = _by_stage(plan(_cfg(tmp_path, llama3_8b, **LORA_EVERYWHERE), 80, 1, shapes=llama3_shapes))["train_mtp_rl"]
    assert not [key for key in alone.estimate.parts if key.startswith("labeler")]
    assert with_model["train_mtp_rl"].estimate.total == pytest.approx(
        alone.estimate.total + rl["labeler weights"] + rl["labeler forward"], rel=1e-12)


def _params(tmp_path, model, **sections) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"policy": {"model": str(model), "dtype": "auto"}, **sections}))
    return str(path)


def test_the_cli_prints_the_table_and_exits_1_when_a_stage_does_not_fit(tmp_path, llama3_8b, capsys):
    assert main(["--params", _params(tmp_path, llama3_8b), "plan", "--gpu-memory", "80", "--gpus", "1"]) == 1
    out = capsys.readouterr().out
    assert "8.03 B parameters" in out and "1 × 80.0 GiB" in out
    dpo_row = next(line for line in out.splitlines() if line.startswith("dpo "))
    assert " NO " in dpo_row and "reference copy 15.0" in dpo_row
    assert "-> dpo.lora_rank: 16" in out and "Korthikanti" in out
    assert all(any(line.startswith(stage.name + " ") for line in out.splitlines()) for stage in STAGES)


def test_the_cli_exits_0_when_every_stage_fits(tmp_path, smollm_135m, capsys):
    """The default params (full fine-tuning, fp32 weights) with a 135M policy fit a 24 GiB GPU."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"policy": {"model": str(smollm_135m)}}))
    assert main(["--params", str(path), "plan", "--gpu-memory", "24", "--gpus", "1", "--disk", "64"]) == 0
    out = capsys.readouterr().out
    assert "0.13 B parameters" in out and " NO " not in out


def test_a_stage_that_will_not_fit_fails_before_it_starts(tmp_path, llama3_8b):
    """``run_stage`` calls ``preflight`` with the visible GPUs: full-FT DPO at 8B on an 80 GB GPU fails naming the
    knob; with LoRA, or with no GPU visible (a CPU run), it goes ahead."""
    from foresight.memory import WillNotFitError, preflight

    dpo = next(stage for stage in STAGES if stage.name == "dpo")
    cfg = _cfg(tmp_path, llama3_8b)
    with pytest.raises(WillNotFitError, match=r"stage dpo needs an estimated \d+\.\d GiB.*dpo\.lora_rank: 16"):
        preflight(dpo, cfg, [80.0])
    preflight(dpo, cfg, [])
    preflight(dpo, _cfg(tmp_path, llama3_8b, **LORA_EVERYWHERE), [80.0])


def test_the_grpo_kv_cache_counts_the_largest_batch_decoded_and_its_junk(tmp_path, llama3_8b, llama3_shapes):
    """train_mtp_rl's KV cache by hand: the largest of a rollout batch, the held-out batch and the curves' biggest
    batch, each row prompt + new tokens + the junk the batched engine keeps before compacting + one K + 1 tree."""
    shape = llama3_shapes.policy
    per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2  # bf16 keys and values
    for mtp_rl, rows in (({"prompts_per_step": 8, "group_size": 32, "eval_batch_size": 40}, 256),
                         ({"prompts_per_step": 8, "group_size": 32, "rollout_batch_size": 16,
                           "eval_batch_size": 40}, 40),
                         ({"prompts_per_step": 1, "group_size": 4, "eval_batch_size": 8, "curve_batch_sizes": [1, 32]},
                          32)):
        sections = {**LORA_EVERYWHERE, "mtp_rl": {"lora_rank": 16, "max_new_tokens": 512, **mtp_rl}}
        cfg = _cfg(tmp_path, llama3_8b, **sections)
        parts = _by_stage(plan(cfg, 80, 1, shapes=llama3_shapes))["train_mtp_rl"].estimate.parts
        tokens = PROMPT_TOKENS + 512
        assert parts["KV cache"] == rows * (tokens + tokens // 2 + cfg.mtp.num_depths + 1) * per_token, mtp_rl
    # the knob: half the rows of a rollout batch (a step's prompts × G when unset), tried before a smaller G
    from foresight.memory import _smaller_rollout_batches

    cfg = _cfg(tmp_path, llama3_8b, mtp_rl={"prompts_per_step": 8, "group_size": 32})
    assert _smaller_rollout_batches(cfg) == {"mtp_rl.rollout_batch_size": 128}
    assert _smaller_rollout_batches(_cfg(tmp_path, llama3_8b, mtp_rl={"rollout_batch_size": 1})) is None
    knobs = _by_stage(plan(cfg, 80, 1, shapes=llama3_shapes))["train_mtp_rl"].estimate.knobs
    proposals = [knob(cfg) for knob in knobs]
    assert proposals.index({"mtp_rl.rollout_batch_size": 128}) < proposals.index({"mtp_rl.group_size": 16})
    # and the update's micro-batch before either: the update holds every row's activations and logits
    assert proposals.index({"mtp_rl.update_batch_size": 128}) < proposals.index({"mtp_rl.rollout_batch_size": 128})
    # 256 rollouts of 8B in one update do not fit 40 GB with LoRA and checkpointing; micro-batches make them fit
    cfg = _cfg(tmp_path, llama3_8b, **{**LORA_EVERYWHERE, "mtp_rl": {
        "lora_rank": 16, "gradient_checkpointing": True, "max_new_tokens": 512, "prompts_per_step": 8,
        "group_size": 32, "eval_batch_size": 8, "rollout_batch_size": 16}})
    rl = _by_stage(plan(cfg, 40, 1, shapes=llama3_shapes))["train_mtp_rl"]
    assert not rl.fits and rl.fix["mtp_rl.update_batch_size"] < 256 and "mtp_rl.group_size" not in rl.fix, rl.fix


def test_every_layers_hidden_states_only_where_the_reward_channel_reads_them(tmp_path, llama3_8b, llama3_shapes):
    """The SLA reward channel reads all L + 1 hidden states (training on pairs, SLA's prefill); the engine's, Medusa's
    and MTP's prefills keep the last layer's. By hand, bf16, hidden 4096, 33 tensors for 32 layers; prompts at
    prompts.max_prompt_tokens (1024 here)."""
    cfg = _cfg(tmp_path, llama3_8b, **{
        **LORA_EVERYWHERE, "prompts": {"max_prompt_tokens": 1024}, "reward": {"batch_size": 4, "max_length": 1600},
        "generate": {"max_batch_tokens": None},  # every row's KV cache: by hand below
        "sla_benchmark": {"batch_size": 8}, "medusa_benchmark": {"batch_size": 16},
        "mtp": {"batch_size": 8, "max_length": 1600},
        "mtp_rl": {"lora_rank": 16, "prompts_per_step": 4, "group_size": 8, "eval_batch_size": 8}})
    plans = _by_stage(plan(cfg, 80, 1, shapes=llama3_shapes))
    parts = {name: p.estimate.parts for name, p in plans.items()}
    all_layers = {name for name, p in parts.items() if "hidden states (all layers)" in p}
    assert all_layers == {"train_reward", "train_reward_dpo", "benchmark_sla"}
    assert parts["train_reward"]["hidden states (all layers)"] == 2 * 4 * 1600 * 4096 * 33 * 2  # both responses
    assert parts["benchmark_sla"]["hidden states (all layers)"] == 8 * 1024 * 4096 * 33 * 2  # the batch's prompts
    assert parts["benchmark_medusa"]["hidden states (last layer)"] == 16 * 1024 * 4096 * 2
    assert parts["train_mtp"]["hidden states (last layer)"] == 8 * 1600 * 4096 * 2
    assert parts["train_mtp_rl"]["hidden states (last layer)"] == 32 * 1024 * 4096 * 2  # a step's 4 × 8 rollouts
    # the KV caches count prompts.max_prompt_tokens, not the 256-token default
    per_token = 32 * 2 * 8 * 128 * 2
    g = cfg.generate
    assert parts["generate"]["KV cache"] == g.batch_size * g.num_samples * (1024 + g.max_new_tokens) * per_token


def test_the_generate_kv_cache_is_capped_by_the_token_budget(tmp_path, llama3_8b, llama3_shapes):
    """``generate.max_batch_tokens``: a batch's KV cache holds at most the budget's tokens, or one prompt's rows
    alone where they exceed it (such a prompt forms its own batch); without a budget, the full batch of the longest
    prompts. By hand, Llama-3-8B in bf16: 128 KiB per token."""
    per_token = 32 * 2 * 8 * 128 * 2

    def kv(**generate) -> float:
        cfg = _cfg(tmp_path, llama3_8b, prompts={"max_prompt_tokens": 1024},
                   generate={"batch_size": 16, "num_samples": 4, "max_new_tokens": 512, **generate})
        return _by_stage(plan(cfg, 80, 1, shapes=llama3_shapes))["generate"].estimate.parts["KV cache"]

    assert kv(max_batch_tokens=None) == 16 * 4 * (1024 + 512) * per_token
    assert kv() == 32768 * per_token  # the default budget
    assert kv(max_batch_tokens=65536) == 65536 * per_token
    assert kv(max_batch_tokens=1000) == 4 * (1024 + 512) * per_token  # one prompt's 4 rows, alone over the budget
    assert kv(max_batch_tokens=10**7) == kv(max_batch_tokens=None)


def test_armorm_is_counted_as_its_native_module(tmp_path, llama3_8b, llama3_shapes):
    """ArmoRM's config.json (vocab 128257 with [PAD] inside, 19 objectives, 3 gating layers of 1024): the backbone
    and its heads, no LM head — 7,511,320,957 parameters (the native module's count, the hub's 7.51 B); in the
    checkpoint's bf16."""
    import torch
    from transformers import LlamaConfig

    from models.labeling.armorm import ArmoRM

    config = LlamaConfig(vocab_size=128257, pad_token_id=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=8192, tie_word_embeddings=False, dtype="bfloat16")
    config.num_objectives, config.gating_temperature, config.gating_hidden_dim, config.gating_n_hidden = 19, 10, 1024, 3
    config.save_pretrained(tmp_path / "armorm")
    cfg = _cfg(tmp_path, llama3_8b, label={"labeler": "armorm", "model": str(tmp_path / "armorm")})
    shape = labeler_shape(cfg, llama3_shapes.policy)
    with torch.device("meta"):
        native = sum(p.numel() for p in ArmoRM(config).parameters())
    assert shape.parameters == native == 7_511_320_957 and shape.checkpoint_bytes == 2 and not shape.note


def test_disk_per_stage_by_hand_and_the_run_total(tmp_path, llama3_8b, llama3_shapes):
    """A local policy folder is read in place; DPO and COrAL save whole bf16 models; Medusa's distillation cache
    holds each response position's final state; train_mtp's states of whole sequences are scratch. Defaults: 96
    training prompts, Medusa on 384 task + 64 general prompts (64 new tokens), MTP at 256 tokens."""
    cfg = _cfg(tmp_path, llama3_8b, **LORA_EVERYWHERE)
    disk = _by_stage_disk(disk_plan(cfg, llama3_shapes, budget_gib=64))
    params = llama3_shapes.policy.parameters
    assert disk["prepare_policy"].writes == {} and "read in place" in disk["prepare_policy"].note
    assert disk["dpo"].writes == {"DPO policy": 2 * params}
    assert disk["train_coral"].writes == {"COrAL model": 2 * params}
    responses = 384 + 64
    assert disk["train_medusa"].writes["final hidden states (distillation cache)"] == responses * 64 * 4096 * 2
    assert disk["train_mtp"].scratch == {"final hidden states (in $TMPDIR)": responses * 256 * 4096 * 2}
    # the samples table: 96 prompts × 4 samples, each question + prompt (256 tokens each) + response (64), 4 B a token
    assert disk["generate"].writes == {"samples table": 96 * 4 * (2 * 256 + 64) * 4}
    # verifiable labels: pairs of right and wrong answers, at most C(4, 2) = 6 per prompt
    assert disk["validate"].writes == {"pairs table": 96 * 6 * (2 * 256 + 2 * 64) * 4}
    plan_ = disk_plan(cfg, llama3_shapes, budget_gib=64)
    assert plan_.total == sum(f.written for f in plan_.footprints) + responses * 256 * 4096 * 2
    capped = _cfg(tmp_path, llama3_8b, validate={"max_pairs_per_prompt": 2})
    assert _by_stage_disk(disk_plan(capped, llama3_shapes, 64))["validate"].writes["pairs table"] == 96 * 2 * 640 * 4


def _by_stage_disk(disk):
    return {f.stage: f for f in disk.footprints}


def test_the_disk_budget_defaults_to_the_free_space_of_the_checkout(tmp_path, llama3_8b, llama3_shapes):
    import shutil

    disk = disk_plan(_cfg(tmp_path, llama3_8b), llama3_shapes)
    assert disk.budget == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)
    assert str(tmp_path.resolve()) in disk.source


def test_the_cli_exits_1_and_names_the_biggest_stages_when_the_disk_does_not_fit(tmp_path, llama3_8b, capsys):
    """Every stage fits the GPU (LoRA); the run's ~32 GiB (two 15 GiB models: DPO and COrAL) fit a 64 GiB budget and
    not a 20 GiB one."""
    params = _params(tmp_path, llama3_8b, **LORA_EVERYWHERE)
    assert main(["--params", params, "plan", "--gpu-memory", "80", "--gpus", "1", "--disk", "64"]) == 0
    out = capsys.readouterr().out
    assert "each artifact counted once: DVC's cache linked" in out and "against 64.0 GiB (--disk): fits" in out
    assert next(line for line in out.splitlines() if line.startswith("dpo ") and "DPO policy 15.0" in line)
    assert main(["--params", params, "plan", "--gpu-memory", "80", "--gpus", "1", "--disk", "20"]) == 1
    out = capsys.readouterr().out
    total = float(out.split("Run total: ")[1].split(" GiB")[0])
    assert 30 < total < 40
    assert "against 20.0 GiB (--disk): DOES NOT FIT; the biggest stages: dpo 15.0, train_coral 15.0" in out
