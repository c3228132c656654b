"""Export of the trained Medusa heads in vLLM's Medusa draft format (models/medusa/export.py, ``foresight export``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from models.medusa.export import export_vllm_medusa, load_vllm_medusa, read_vllm_medusa_config
from models.medusa.heads import MedusaHeads, MedusaHeadsConfig

HIDDEN, VOCAB = 16, 40


def random_heads(untie: bool, num_heads: int = 3, num_layers: int = 2, seed: int = 0) -> tuple[MedusaHeads, nn.Linear]:
    """Heads with every parameter random (fresh heads are zero: an export that dropped the blocks would pass)."""
    torch.manual_seed(seed)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    heads = MedusaHeads(MedusaHeadsConfig(HIDDEN, VOCAB, num_heads, num_layers, untie), lm_head)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.normal_(0.0, 0.3)
    return heads, lm_head


def vllm_logits(folder: Path, hidden: torch.Tensor) -> torch.Tensor:
    """Each head's logits (K, N, V) computed from the exported files the way vLLM's ``Medusa`` computes them
    (vllm/model_executor/models/medusa.py): ``ResidualBlock`` = ``x = x + SiLU(layer(x))`` per layer, then the head's
    ``lm_heads[i]`` (or the one ``lm_head`` with ``original_lm_head``); the blocks' bias only with
    ``medusa_fc_bias``."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    logits = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            bias = weights[f"blocks.{i}.layers.{j}.bias"] if config.get("medusa_fc_bias", False) else None
            x = x + F.silu(F.linear(x, weights[f"blocks.{i}.layers.{j}.weight"], bias))
        head = weights["lm_head.weight"] if config.get("original_lm_head", False) else weights[f"lm_heads.{i}.weight"]
        logits.append(F.linear(x, head))
    return torch.stack(logits)


@pytest.mark.parametrize("untie", [False, True])
def test_export_loads_back_tensor_for_tensor_with_the_same_logits(tmp_path, untie):
    heads, lm_head = random_heads(untie)
    folder = export_vllm_medusa(heads, lm_head, tmp_path / "draft")
    reloaded, reloaded_lm_head = load_vllm_medusa(folder)

    original, back = heads.state_dict(), reloaded.state_dict()
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    if untie:
        assert reloaded_lm_head is None
    else:
        assert torch.equal(reloaded_lm_head.weight, lm_head.weight)

    hidden = torch.randn(5, HIDDEN)
    with torch.no_grad():
        expected = heads(hidden, lm_head)  # (N, K, V)
        assert torch.equal(reloaded(hidden, reloaded_lm_head), expected)
        # and vLLM's computation over the files gives them too: names and semantics agree
        torch.testing.assert_close(vllm_logits(folder, hidden).transpose(0, 1), expected, rtol=1e-5, atol=1e-5)


def test_config_holds_what_vllm_reads(tmp_path):
    heads, lm_head = random_heads(untie=False, num_heads=4, num_layers=2)
    config = json.loads((export_vllm_medusa(heads, lm_head, tmp_path / "draft") / "config.json").read_text())
    # how SpeculativeConfig recognises a Medusa draft, and the registry's architecture name
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    # MedusaConfig.__init__'s fields that the Medusa model reads (max_paths and topk it never reads), and the two it
    # reads with getattr
    assert {key: config[key] for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                                         "truncated_vocab_size", "medusa_fc_bias", "original_lm_head")} == {
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "num_heads": 4, "num_hidden_layers": 2,
        "truncated_vocab_size": VOCAB, "medusa_fc_bias": True, "original_lm_head": True}
    # MedusaConfig.from_pretrained renames every key holding "num" and "heads" / "layers": no other key may
    assert [key for key in config if "num" in key] == ["num_heads", "num_hidden_layers"]
    resolved = read_vllm_medusa_config(tmp_path / "draft")
    assert (resolved["num_heads"], resolved["num_hidden_layers"]) == (4, 2)


def test_loader_maps_names_as_vllm_does(tmp_path):
    """A FasterDecoding-style checkpoint: ``medusa_heads.`` prefix, ``medusa_num_heads`` / ``medusa_num_layers``, no
    block bias, one LM head given as ``lm_heads.0.weight`` under ``original_lm_head``, and a name vLLM ignores."""
    torch.manual_seed(1)
    weights = {f"medusa_heads.blocks.{i}.layers.0.weight": torch.randn(HIDDEN, HIDDEN) * 0.3 for i in range(2)}
    weights["lm_heads.0.weight"] = torch.randn(VOCAB, HIDDEN)
    weights["something.else"] = torch.zeros(1)
    folder = tmp_path / "faster_decoding"
    folder.mkdir()
    save_file(weights, folder / "medusa_lm_head.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "medusa_num_heads": 2, "medusa_num_layers": 1,
        "original_lm_head": True}))

    heads, lm_head = load_vllm_medusa(folder)
    assert heads.config == MedusaHeadsConfig(HIDDEN, VOCAB, num_heads=2, num_layers=1, untie=False)
    assert all(not block[0].linear.bias.any() for block in heads.blocks)  # vLLM's layers have no bias
    hidden = torch.randn(4, HIDDEN)
    blocks = [weights[f"medusa_heads.blocks.{i}.layers.0.weight"] for i in range(2)]
    expected = torch.stack([F.linear(hidden + F.silu(F.linear(hidden, block)), weights["lm_heads.0.weight"])
                            for block in blocks], dim=-2)
    with torch.no_grad():
        torch.testing.assert_close(heads(hidden, lm_head), expected)
    del weights["medusa_heads.blocks.1.layers.0.weight"]
    save_file(weights, folder / "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match=r"blocks\.1\.layers\.0\.weight"):
        load_vllm_medusa(folder)


def test_foresight_export_writes_every_trained_set_of_heads(tmp_path, tiny_llama, capsys):
    from transformers import AutoModelForCausalLM

    from flows.cli import main
    from models.engine.policy import prepare_policy
    from models.medusa.heads import heads_for
    from tests.helpers import tiny_params

    params = tiny_params(tmp_path, tiny_llama)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    from foresight.config import load_config

    cfg = load_config(tmp_path / "params.yaml")
    prepare_policy(cfg.policy, cfg.path(cfg.paths.policy_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    lm_head = model.get_output_embeddings()
    saved = {}
    for seed, name in enumerate(("supervised", "rl/base")):
        torch.manual_seed(seed)
        heads = heads_for(model, num_heads=2)
        with torch.no_grad():
            for parameter in heads.parameters():
                parameter.normal_(0.0, 0.3)
        heads.save(cfg.path(cfg.paths.medusa_dir) / name)
        saved[name] = heads

    out = tmp_path / "exported"
    assert main(["export", str(out), "--params", str(tmp_path / "params.yaml")]) == 0
    printed = capsys.readouterr().out
    assert '"method": "medusa"' in printed and "MTP module: not exported" in printed
    assert sorted(p.name for p in out.iterdir()) == ["medusa_rl_base", "medusa_supervised"]
    hidden = torch.randn(3, model.config.hidden_size)
    for name, folder in (("supervised", "medusa_supervised"), ("rl/base", "medusa_rl_base")):
        heads, exported_lm_head = load_vllm_medusa(out / folder)
        assert torch.equal(exported_lm_head.weight, lm_head.weight)
        with torch.no_grad():
            assert torch.equal(heads(hidden, exported_lm_head), saved[name](hidden, lm_head))
