"""The generate stage's engines and its resumable, sharded output (foresight/shards.py, models/engine/vllm_sampling.py).

The HF engine runs for real on the tiny model: a stage process killed (SIGKILL) after its second batch and run again
yields the uninterrupted run's samples row for row. vLLM cannot be installed here (no GPU): its request and response
mapping is tested against stand-ins that follow vLLM's documented types (``SamplingParams``, ``RequestOutput``,
``CompletionOutput``), injected as the ``vllm`` module, so the engine's own import and calls run unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pandas as pd
import pytest
import yaml

from foresight.config import ConfigError, load_config, parse_config
from foresight.shards import ShardStore, shard_folder
from foresight.storage import read_table
from models.engine.config import PolicySpec, Sampling
from models.engine.generation import Completion
from models.engine.vllm_sampling import VLLMSampler, import_vllm, vllm_completions, vllm_requests
from tests.conftest import tiny_params

ROOT = Path(__file__).resolve().parents[1]

# A generate stage in its own process whose shard writer kills the process (SIGKILL: no clean-up, no finally)
# right after the shard of the N-th batch is on disk.
KILLED_RUN = """
import os, signal, sys
from prefect.logging import disable_run_logger
from foresight.config import load_config
from foresight.shards import ShardStore
from tasks.data import generate_task

write, written = ShardStore.write, []
def write_then_die(self, unit, table):
    write(self, unit, table)
    written.append(unit)
    if len(written) == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
ShardStore.write = write_then_die
with disable_run_logger():
    generate_task.fn(load_config(sys.argv[1]))
"""


def _project(root: Path, tiny_llama: Path, **generate) -> Path:
    """A project under ``root`` with the tiny policy prepared and 7 training prompts split: 4 batches of 2."""
    from prefect.logging import disable_run_logger

    from tasks.data import prepare_policy_task, prepare_prompts_task

    params = tiny_params(root, tiny_llama, prompts={"num_train": 7, "num_eval": 2},
                         generate={"batch_size": 2, "num_samples": 2, "max_new_tokens": 10, **generate})
    root.mkdir(parents=True, exist_ok=True)
    params_path = root / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    cfg = load_config(params_path)
    with disable_run_logger():
        prepare_policy_task.fn(cfg)
        prepare_prompts_task.fn(cfg)
    return params_path


def _generate(params_path: Path):
    from prefect.logging import disable_run_logger

    from tasks.data import generate_task

    with disable_run_logger():
        return generate_task.fn(load_config(params_path))


def _kill_after(params_path: Path, batches: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILLED_RUN, str(params_path), str(batches)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def test_a_killed_generate_stage_resumes_to_the_uninterrupted_samples(tiny_llama, tmp_path):
    uninterrupted = _project(tmp_path / "once", tiny_llama)
    result = _generate(uninterrupted)
    once = load_config(uninterrupted)
    expected = read_table(once.path(once.paths.samples), "samples")
    assert result.metrics["resumed_batches"] == 0 and len(expected) == 14

    params_path = _project(tmp_path / "killed", tiny_llama)
    cfg = load_config(params_path)
    output = cfg.path(cfg.paths.samples)
    killed = _kill_after(params_path, batches=2)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not output.exists()  # nothing half-written: the table comes only at the end
    shards = sorted(p.name for p in shard_folder(output).glob("shard-*.parquet"))
    assert shards == ["shard-000000.parquet", "shard-000001.parquet"]

    resumed = _generate(params_path)
    assert resumed.metrics["resumed_batches"] == 2
    samples = read_table(output, "samples")
    pd.testing.assert_frame_equal(samples, expected)
    assert samples["sample_id"].is_unique
    assert not shard_folder(output).exists()  # the shards are gone once the table is written


def test_shards_of_other_settings_are_removed_not_mixed_in(tiny_llama, tmp_path):
    params_path = _project(tmp_path, tiny_llama)
    assert _kill_after(params_path, batches=3).returncode == -9
    params = yaml.safe_load(params_path.read_text())
    params["generate"]["seed"] = 1
    params_path.write_text(yaml.safe_dump(params))
    result = _generate(params_path)
    assert result.metrics["resumed_batches"] == 0  # seed 0's three shards were not reused

    fresh = _project(tmp_path / "fresh", tiny_llama, seed=1)
    _generate(fresh)
    cfg, fresh_cfg = load_config(params_path), load_config(fresh)
    pd.testing.assert_frame_equal(read_table(cfg.path(cfg.paths.samples), "samples"),
                                  read_table(fresh_cfg.path(fresh_cfg.paths.samples), "samples"))


def test_shard_store_keeps_its_spec_and_names_missing_shards(tmp_path):
    store = ShardStore(tmp_path / "s", {"seed": 0, "model": "m"})
    store.write(0, pd.DataFrame({"x": [1, 2]}))
    store.write(2, pd.DataFrame({"x": [5]}))
    assert store.done() == {0, 2}
    assert json.loads((tmp_path / "s" / "spec.json").read_text()) == {"model": "m", "seed": 0}
    assert ShardStore(tmp_path / "s", {"model": "m", "seed": 0}).done() == {0, 2}  # same settings: kept
    with pytest.raises(FileNotFoundError, match=r"1 shards missing .*units \[1\]"):
        store.read(range(3))
    other = ShardStore(tmp_path / "s", {"seed": 1, "model": "m"})
    assert other.discarded == 2 and other.done() == set()


def test_tensor_parallel_needs_the_vllm_engine(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 needs engine: vllm"):
        parse_config({"generate": {"tensor_parallel_size": 2}}, root=tmp_path)
    assert parse_config({"generate": {"engine": "vllm", "tensor_parallel_size": 2}}, root=tmp_path).generate.engine == "vllm"


# --- vLLM, through stand-ins of its documented types -------------------------------------------------------------


@dataclass
class SamplingParams:
    """vllm.SamplingParams' fields the engine sets (vLLM: top_k −1 = off)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    """vllm.LLM as far as the engine uses it: built once, ``generate(prompts, sampling_params, use_tqdm)`` returns
    one RequestOutput per prompt, in order. Each sample's text is derived from its request, so the mapping is
    checked value by value; the second sample of every request is listed first (vLLM gives no order promise)."""

    instances: ClassVar[list[LLM]] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.visible_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")  # what vLLM's engine would start on
        LLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = prompt["prompt_token_ids"]
            samples = [CompletionOutput(i, f" seed {params.seed} sample {i} ", [7] * (i + 2),
                                        "stop" if i == 0 else "length") for i in range(params.n)]
            outputs.append(RequestOutput(ids, samples[::-1]))
        return outputs


@pytest.fixture
def stand_in_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    LLM.instances.clear()
    return module


def test_vllm_requests_are_seeded_per_prompt_and_match_the_hf_settings(stand_in_vllm):
    cfg = Sampling(num_samples=3, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, seed=5)
    prompts, params = vllm_requests(stand_in_vllm, [[1, 2], [3]], first_index=10, cfg=cfg, eos_ids={9, 2})
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert params == [SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=-1, seed=5 + 10 + i, max_tokens=12,
                                     stop_token_ids=[2, 9]) for i in range(2)]
    _, params = vllm_requests(stand_in_vllm, [[1]], first_index=0, cfg=Sampling(top_k=40), eos_ids={2})
    assert params[0].top_k == 40


def test_vllm_outputs_become_the_samples_schema():
    outputs = [RequestOutput([1, 2, 3], [CompletionOutput(1, " b ", [4, 2], "stop"),
                                         CompletionOutput(0, "a", [5, 6, 7], "length")])]
    assert vllm_completions(outputs, first_index=4) == [
        Completion(prompt_index=4, sample_index=0, response="a", prompt_tokens=3, response_tokens=3,
                   finish_reason="length"),
        Completion(prompt_index=4, sample_index=1, response="b", prompt_tokens=3, response_tokens=2,
                   finish_reason="eos")]
    with pytest.raises(RuntimeError, match=r"sample 0 of prompt 7 with 'abort'"):
        vllm_completions([RequestOutput([1], [CompletionOutput(0, "", [], "abort")])], first_index=7)


def test_vllm_sampler_tokenises_like_hf_and_maps_a_batch(stand_in_vllm, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    cfg = Sampling(num_samples=2, seed=3, engine="vllm")
    sampler = VLLMSampler(tiny_llama, PolicySpec(model=str(tiny_llama)), cfg, tokenizer, {2},
                          tensor_parallel_size=2)
    llm = LLM.instances[-1]
    assert llm.kwargs == {"model": str(tiny_llama), "dtype": "bfloat16", "seed": 3, "tensor_parallel_size": 2,
                          "trust_remote_code": False}
    prompts = ["<s>hello there", "what is 2 + 2"]
    completions = sampler(prompts, batch_index=1, first_index=2)
    requests, _ = llm.calls[-1]
    # the chat template holds the special tokens: none added, as the HF engine tokenises
    assert [r["prompt_token_ids"] for r in requests] == [tokenizer(p, add_special_tokens=False).input_ids
                                                         for p in prompts]
    assert [(c.prompt_index, c.sample_index, c.response) for c in completions] == [
        (2, 0, "seed 5 sample 0"), (2, 1, "seed 5 sample 1"), (3, 0, "seed 6 sample 0"), (3, 1, "seed 6 sample 1")]


def test_a_missing_vllm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm\].*generate.engine: hf"):
        import_vllm()


def test_each_launched_process_gives_its_vllm_its_own_gpus(stand_in_vllm, tiny_llama, monkeypatch):
    """Data parallel generation (``launch.num_processes``): local rank r's vLLM sees the r-th group of
    ``tensor_parallel_size`` GPUs; without a launch, every visible GPU."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    policy = PolicySpec(model=str(tiny_llama))

    def start(local_rank: int | None, world: int, tensor_parallel_size: int) -> str | None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        VLLMSampler(tiny_llama, policy, Sampling(), tokenizer, {2}, tensor_parallel_size)
        return LLM.instances[-1].visible_gpus

    assert start(None, 1, 2) == "0,1,2,3"
    assert start(0, 4, 1) == "0" and start(3, 4, 1) == "3"
    assert start(1, 2, 2) == "2,3"
    with pytest.raises(RuntimeError, match="local rank 2 needs GPUs 4…5 of 4 visible"):
        start(2, 3, 2)


def test_generation_in_two_processes_writes_the_one_process_table(tiny_llama, tmp_path):
    """``accelerate launch`` of the generate task in 2 CPU processes (gloo): each samples every other batch, the
    main one writes the table, equal to one process's row for row."""
    once = _project(tmp_path / "once", tiny_llama)
    _generate(once)
    cfg = load_config(once)
    expected = read_table(cfg.path(cfg.paths.samples), "samples")

    twice = _project(tmp_path / "twice", tiny_llama)
    launch = ("import sys; from prefect.logging import disable_run_logger; from foresight.config import load_config; "
              "from tasks.data import generate_task\nwith disable_run_logger():\n"
              "    print('RESULT', generate_task.fn(load_config(sys.argv[1])).metrics)")
    script = tmp_path / "launch_generate.py"
    script.write_text(launch)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script),
                           str(twice)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'num_processes': 2" in proc.stdout, proc.stdout[-2000:]
    cfg = load_config(twice)
    pd.testing.assert_frame_equal(read_table(cfg.path(cfg.paths.samples), "samples"), expected)
    assert not shard_folder(cfg.path(cfg.paths.samples)).exists()
