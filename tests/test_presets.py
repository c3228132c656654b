"""The papers'-scale presets (configs/llama3-8b.yaml, configs/llama3-8b-multi-gpu.yaml): each is a whole params
file (every key params.yaml writes out), parses, and ``foresight plan --params PRESET`` fits it — every stage on one
80 GB GPU (the single-GPU preset) or on each of eight (the multi-GPU one), and the run's disk total within 64 GiB
(the single-GPU preset: a lent GPU machine's disk) or 100 GiB (the multi-GPU one, with 8× the training prompts).

No weights are read and nothing is downloaded: a Hugging Face cache made here holds only the config.json of each hub
model, with Llama-3-8B-Instruct's published shape and ArmoRM-Llama3-8B-v0.1's (vocab 128257 with its [PAD] inside,
19 objectives, 3 gating layers of 1024), so the plan counts the hub copies exactly as on a machine that downloaded
them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.cli import main
from foresight.config import load_config
from foresight.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
SINGLE, MULTI = ROOT / "configs" / "llama3-8b.yaml", ROOT / "configs" / "llama3-8b-multi-gpu.yaml"
LLAMA3, ARMORM = "meta-llama/Meta-Llama-3-8B-Instruct", "RLHFlow/ArmoRM-Llama3-8B-v0.1"


def _keys(tree: dict, prefix: str = "") -> set[str]:
    return {key for name, value in tree.items()
            for key in ({prefix + name} | (_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else set()))}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face cache holding the two hub models' config.json files only (one snapshot each, ``main``)."""
    from transformers import LlamaConfig

    cache = tmp_path_factory.mktemp("hf-cache")
    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                 dtype="bfloat16")
    armorm = LlamaConfig(vocab_size=128257, pad_token_id=128256, **shape)
    armorm.num_objectives, armorm.gating_temperature, armorm.gating_hidden_dim, armorm.gating_n_hidden = 19, 10, 1024, 3
    armorm.architectures = ["LlamaForRewardModelWithGating"]
    for repo, config in ((LLAMA3, LlamaConfig(vocab_size=128256, **shape)), (ARMORM, armorm)):
        folder, commit = cache / f"models--{repo.replace('/', '--')}", "0" * 40
        config.save_pretrained(folder / "snapshots" / commit)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(commit)
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))  # read at each call
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("preset", [SINGLE, MULTI], ids=["single-gpu", "multi-gpu"])
def test_a_preset_is_a_whole_params_file(preset):
    """DVC reads the tracked sections from the params file itself (config.py's defaults never reach it): a preset
    copied over params.yaml must write out every key params.yaml does."""
    missing = _keys(yaml.safe_load((ROOT / "params.yaml").read_text())) - _keys(yaml.safe_load(preset.read_text()))
    assert not missing, f"{preset.name} lacks {sorted(missing)}"
    cfg = load_config(preset)
    assert (cfg.policy.model, cfg.label.labeler, cfg.label.model) == (LLAMA3, "armorm", ARMORM)
    assert cfg.prompts.max_prompt_tokens == 1024 and cfg.generate.max_new_tokens == 512
    assert cfg.validate_.max_pairs_per_prompt is not None
    # a 1024-token prompt, a 512-token response and its end token fit every training stage's sequences
    for section in ("reward", "dpo", "coral", "mtp"):
        assert getattr(cfg, section).max_length >= 1024 + 512 + 1, section
    for section in ("dpo", "coral", "mtp_rl"):
        assert getattr(cfg, section).lora_rank and getattr(cfg, section).gradient_checkpointing, section
    assert cfg.launch.num_processes == (8 if preset == MULTI else 1)


@pytest.mark.parametrize(("preset", "gpus", "budget"), [(SINGLE, 1, 64), (MULTI, 8, 100)],
                         ids=["single-gpu", "multi-gpu"])
def test_the_plan_fits_80_gb_gpus_and_the_disk(offline_hub, capsys, preset, gpus, budget):
    args = ["--params", str(preset), "plan", "--gpu-memory", "80", "--gpus", str(gpus), "--disk", str(budget)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "policy meta-llama/Meta-Llama-3-8B-Instruct: 8.03 B parameters" in out
    memory_table, disk_table = out.split("Disk (GiB)")
    names = {stage.name for stage in STAGES}

    def rows(table: str) -> dict[str, list[str]]:
        return {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] and
                line.split()[0] in names}

    memory, disk = rows(memory_table), rows(disk_table)
    assert set(memory) == set(disk) == names
    assert all(row[2] == "yes" for row in memory.values()), [row for row in memory.values() if row[2] != "yes"]
    assert "note: label.model" not in out  # ArmoRM counted from its config, not assumed the policy's size
    # the hub copies in bf16: Llama-3-8B-Instruct's 8.03 B parameters, ArmoRM's 7.51 B (no LM head)
    assert float(disk["prepare_policy"][1]) == 15.0 and "labeler 14.0" in " ".join(disk["label"])
    total = float(out.split("Run total: ")[1].split(" GiB")[0])
    assert 58 < total <= budget and f"against {budget:.1f} GiB (--disk): fits" in out
