"""The generate stage's engines and its resumable, sharded output (foresight/shards.py, models/engine/vllm_sampling.py,
models/engine/vllm_worker.py).

The HF engine runs for real on the tiny model: a stage process killed (SIGKILL) after its second batch and run again
yields the uninterrupted run's samples row for row. vLLM cannot be installed here (no GPU, and it conflicts with the
pipeline's pins): the real worker script runs as a subprocess of the interpreter ``generate.vllm_python`` (this
venv's python here), through the real generate stage, against a stand-in ``vllm`` package put on the worker's
``PYTHONPATH`` that follows vLLM 0.33's ``LLM(...)``, ``LLM.generate(prompts, sampling_params, *, use_tqdm)``,
``SamplingParams``, ``RequestOutput`` and ``CompletionOutput`` (vllm/entrypoints/llm.py, sampling_params.py,
outputs.py), and seeds a request's sample s with ``seed + s`` as vllm/v1/engine/parallel_sampling.py does.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from foresight.config import ConfigError, load_config, parse_config
from foresight.pairs import SAMPLE_COLUMNS
from foresight.shards import ShardStore, shard_folder
from foresight.storage import read_table
from models.engine.config import PolicySpec, Sampling
from models.engine.generation import Completion
from models.engine.vllm_sampling import WORKER, VLLMSampler, sampling_params, vllm_completions, worker_environment
from tests.helpers import tiny_params

ROOT = Path(__file__).resolve().parents[1]

# A generate stage in its own process whose shard writer kills the process (SIGKILL: no clean-up, no finally)
# right after the shard of the N-th batch is on disk.
KILLED_RUN = """
import os, signal, sys
from prefect.logging import disable_run_logger
from foresight.config import load_config
from foresight.shards import ShardStore
from tasks.generate import generate_task

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

    from tasks.policy import prepare_policy_task
    from tasks.prompts import prepare_prompts_task

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

    from tasks.generate import generate_task

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
    cfg = parse_config({"generate": {"engine": "vllm", "tensor_parallel_size": 2, "vllm_python": sys.executable}},
                       root=tmp_path)
    assert cfg.generate.engine == "vllm"


# --- vLLM: the real worker script in its own process, over a stand-in vllm package ----------------------------------

STAND_IN_VLLM = '''
"""A stand-in for vLLM 0.33 as the worker calls it: LLM(model, *, tensor_parallel_size, dtype, seed,
trust_remote_code), LLM.generate(prompts, sampling_params, *, use_tqdm) -> RequestOutputs in the prompts' order,
SamplingParams with vLLM's field names and defaults. It records what it was given (STAND_IN_VLLM_RECORD), logs to
stdout as vLLM does by default, and fails on demand (STAND_IN_VLLM_FAIL)."""
import atexit, dataclasses, json, os, sys, time

__version__ = "0.33.0"
print("INFO stand-in vllm imported, logging to stdout as vLLM does")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def _record(entry):
    with open(os.environ["STAND_IN_VLLM_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class LLM:
    def __init__(self, model, *, tensor_parallel_size=1, dtype="auto", seed=0, trust_remote_code=False):
        _record({"llm": {"model": model, "tensor_parallel_size": tensor_parallel_size, "dtype": dtype, "seed": seed,
                         "trust_remote_code": trust_remote_code},
                 "pid": os.getpid(),
                 "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "MASTER_PORT")},
                 "sys_modules": sorted(m for m in ("torch", "transformers", "models", "foresight")
                                       if m in sys.modules)})
        if os.environ.get("STAND_IN_VLLM_FAIL") == "exit":
            atexit.register(os._exit, 3)
        if os.environ.get("STAND_IN_VLLM_FAIL") == "hang":  # a shutdown that never ends
            atexit.register(time.sleep, 600)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        if os.environ.get("STAND_IN_VLLM_FAIL") == "generate":
            print("ERROR stand-in engine: CUDA error: an illegal memory access", file=sys.stderr)
            raise RuntimeError("stand-in engine died")
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = prompt["prompt_token_ids"]
            _record({"prompt_token_ids": ids, "params": dataclasses.asdict(params), "use_tqdm": use_tqdm})
            # sample s is drawn with seed + s (vllm/v1/engine/parallel_sampling.py); vLLM promises no order
            samples = [CompletionOutput(s, f" seed {params.seed + s} ", [7] * (s + 2), "stop" if s == 0 else "length")
                       for s in range(params.n)]
            outputs.append(RequestOutput(ids, samples[::-1]))
        print(f"INFO stand-in generate: {len(prompts)} requests", flush=True)
        return outputs
'''


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch) -> Path:
    """The stand-in vllm package on the worker's PYTHONPATH (this process never imports it); returns the file
    where it records what it was given."""
    package = tmp_path / "stand-in" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN_VLLM)
    record = tmp_path / "stand-in-record.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.setenv("STAND_IN_VLLM_RECORD", str(record))
    monkeypatch.delenv("STAND_IN_VLLM_FAIL", raising=False)
    return record


def _records(record: Path, key: str) -> list[dict]:
    return [entry for entry in map(json.loads, record.read_text().splitlines()) if key in entry]


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


VLLM = {"engine": "vllm", "vllm_python": sys.executable, "seed": 5}


def test_vllm_engine_samples_through_a_worker_in_its_own_environment(tiny_llama, tmp_path, stand_in_vllm):
    """The generate stage with ``engine: vllm``: one worker for the stage, prompts as token ids without added
    special tokens, vLLM's parameters, the samples schema, the worker stopped at the end, and vllm never imported
    here."""
    from transformers import AutoTokenizer

    from models.engine.policy import policy_path

    params_path = _project(tmp_path / "p", tiny_llama, **VLLM)
    _generate(params_path)
    cfg = load_config(params_path)
    samples = read_table(cfg.path(cfg.paths.samples), "samples")
    assert "vllm" not in sys.modules  # the pipeline's process never imports it

    (started,) = _records(stand_in_vllm, "llm")  # one worker, the model loaded once for the 4 batches
    model = policy_path(cfg.path(cfg.paths.policy_dir))  # the prepared policy's weights (here: the tiny model's)
    assert started["llm"] == {"model": str(model), "tensor_parallel_size": 1,
                              "dtype": "float32", "seed": 5, "trust_remote_code": False}
    assert started["sys_modules"] == []  # the worker imports neither torch, transformers nor the pipeline
    assert _gone(started["pid"])

    requests = _records(stand_in_vllm, "prompt_token_ids")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = samples.drop_duplicates("prompt_id")["prompt"].tolist()
    # the chat template holds the special tokens: none added, as the HF engine tokenises
    assert [r["prompt_token_ids"] for r in requests] == [tokenizer(p, add_special_tokens=False).input_ids
                                                         for p in prompts]
    assert {r["use_tqdm"] for r in requests} == {False}
    assert [r["params"] for r in requests] == [
        {"n": 2, "temperature": 0.8, "top_p": 1.0, "top_k": -1, "seed": 5 + 2 * i, "max_tokens": 10,
         "stop_token_ids": sorted({tokenizer.eos_token_id})} for i in range(7)]

    assert list(samples.columns) == SAMPLE_COLUMNS and len(samples) == 14
    assert samples["sample_index"].tolist() == [0, 1] * 7  # sorted back from vLLM's order
    assert samples["finish_reason"].tolist() == ["eos", "length"] * 7
    assert samples["response_tokens"].tolist() == [2, 3] * 7
    assert samples["prompt_tokens"].tolist() == [len(r["prompt_token_ids"]) for r in requests for _ in range(2)]


def test_vllm_seed_streams_are_distinct_across_prompts_and_a_resumed_batch(tiny_llama, tmp_path, stand_in_vllm):
    """vLLM seeds sample s of a request with seed + s: prompt i seeded with seed + i would share streams with prompt
    i + 1. Every (prompt, sample) stream of a run killed after two batches and resumed is its own, and the run
    equals an uninterrupted one row for row."""
    once = _project(tmp_path / "once", tiny_llama, **VLLM)
    _generate(once)
    cfg = load_config(once)
    expected = read_table(cfg.path(cfg.paths.samples), "samples")

    params_path = _project(tmp_path / "killed", tiny_llama, **VLLM)
    killed = _kill_after(params_path, batches=2)
    assert killed.returncode == -9, killed.stderr[-2000:]
    orphan = _records(stand_in_vllm, "llm")[-1]["pid"]
    deadline = time.monotonic() + 30
    while not _gone(orphan) and time.monotonic() < deadline:  # its stdin closed with the stage: it stops
        time.sleep(0.1)
    assert _gone(orphan)
    resumed = _generate(params_path)
    assert resumed.metrics["resumed_batches"] == 2
    cfg = load_config(params_path)
    samples = read_table(cfg.path(cfg.paths.samples), "samples")
    pd.testing.assert_frame_equal(samples, expected)
    seeds = [int(r.split()[1]) for r in samples["response"]]  # the stand-in writes each sample's seed
    assert sorted(seeds) == list(range(5, 5 + 14))  # 7 prompts × 2 samples: 14 distinct streams


def test_sampling_params_give_each_prompt_its_own_seed_streams():
    cfg = Sampling(num_samples=3, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, seed=5)
    assert sampling_params(cfg, 10, eos_ids={9, 2}) == {
        "n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 5 + 30, "max_tokens": 12,
        "stop_token_ids": [2, 9]}
    assert sampling_params(Sampling(top_k=40), 0, {2})["top_k"] == 40
    # a batch of 4 and the next one (a resumed run's first): vLLM's streams seed + s, s < n, never shared
    streams = [sampling_params(cfg, i, {2})["seed"] + s for i in range(8) for s in range(cfg.num_samples)]
    assert len(set(streams)) == len(streams)


def test_vllm_outputs_become_the_samples_schema():
    outputs = [[{"index": 1, "text": " b ", "token_ids": [4, 2], "finish_reason": "stop"},
                {"index": 0, "text": "a", "token_ids": [5, 6, 7], "finish_reason": "length"}]]
    assert vllm_completions(outputs, [[1, 2, 3]], first_index=4) == [
        Completion(prompt_index=4, sample_index=0, response="a", prompt_tokens=3, response_tokens=3,
                   finish_reason="length"),
        Completion(prompt_index=4, sample_index=1, response="b", prompt_tokens=3, response_tokens=2,
                   finish_reason="eos")]
    with pytest.raises(RuntimeError, match=r"sample 0 of prompt 7 with 'abort'"):
        vllm_completions([[{"index": 0, "text": "", "token_ids": [], "finish_reason": "abort"}]], [[1]], 7)
    with pytest.raises(RuntimeError, match="answered 1 requests for 2 prompts"):
        vllm_completions(outputs, [[1], [2]], 0)


def test_the_worker_imports_only_the_standard_library_and_vllm():
    imported = set()
    for node in ast.walk(ast.parse(WORKER.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"vllm"}


def _sampler(tiny_llama: Path) -> VLLMSampler:
    from transformers import AutoTokenizer

    return VLLMSampler(sys.executable, tiny_llama, PolicySpec(model=str(tiny_llama)),
                       Sampling(num_samples=2, seed=3, engine="vllm"), AutoTokenizer.from_pretrained(tiny_llama), {2},
                       tensor_parallel_size=2)


def test_each_launched_process_gives_its_vllm_worker_its_own_gpus(tiny_llama, stand_in_vllm, monkeypatch, caplog):
    """Data parallel generation (``launch.num_processes``): local rank r's worker sees the r-th group of
    ``tensor_parallel_size`` GPUs, and none of the launcher's variables; ours stay as they are. vLLM's log (on
    stdout by default) reaches our logger, never the answers' channel."""
    caplog.set_level(logging.INFO, logger="models.engine.vllm_sampling")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with _sampler(tiny_llama) as sampler:  # policy dtype auto: bf16, as on a GPU
        completions = sampler(["hello there"], batch_index=0, first_index=0)
    (started,) = _records(stand_in_vllm, "llm")
    assert started["env"] == {"CUDA_VISIBLE_DEVICES": "2,3", "LOCAL_RANK": None, "MASTER_PORT": None}
    assert started["llm"]["dtype"] == "bfloat16" and started["llm"]["tensor_parallel_size"] == 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert [c.response for c in completions] == ["seed 3", "seed 4"]
    assert "vllm: INFO stand-in generate: 1 requests" in caplog.text
    assert "vLLM 0.33.0 worker ready" in caplog.text and "GPUs 2,3" in caplog.text


def test_worker_environment_narrows_the_visible_gpus_by_local_rank():
    def visible(local_rank: int | None, world: int, tensor_parallel_size: int, env=None) -> str | None:
        env = dict(env or {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
        if local_rank is not None:
            env.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world), RANK=str(local_rank))
        return worker_environment(env, tensor_parallel_size, lambda: 4).get("CUDA_VISIBLE_DEVICES")

    assert visible(None, 1, 2) == "0,1,2,3"  # no launch: every visible GPU
    assert visible(0, 4, 1) == "0" and visible(3, 4, 1) == "3"
    assert visible(1, 2, 2) == "2,3"
    assert visible(1, 2, 2, env={"PATH": "/bin"}) == "2,3"  # none set: counted
    with pytest.raises(RuntimeError, match="local rank 2 needs GPUs 4…5 of 4 visible"):
        visible(2, 3, 2)


def test_a_crashing_worker_is_an_error_naming_its_interpreter_and_stderr(tiny_llama, stand_in_vllm, monkeypatch):
    monkeypatch.setenv("STAND_IN_VLLM_FAIL", "generate")
    sampler = _sampler(tiny_llama)
    with pytest.raises(RuntimeError) as err, sampler:
        sampler(["hello"], batch_index=4, first_index=8)
    message = str(err.value)
    assert f"({sys.executable} {WORKER}) exited with code 1 while sampling batch 4" in message
    assert "CUDA error: an illegal memory access" in message and "RuntimeError: stand-in engine died" in message
    assert sampler.process is None and _gone(_records(stand_in_vllm, "llm")[0]["pid"])


def test_a_worker_that_exits_non_zero_at_the_end_is_an_error(tiny_llama, stand_in_vllm, monkeypatch):
    monkeypatch.setenv("STAND_IN_VLLM_FAIL", "exit")
    with pytest.raises(RuntimeError, match=r"exited with code 3 when asked to stop"), _sampler(tiny_llama) as sampler:
        sampler(["hello"], batch_index=0, first_index=0)


def test_a_worker_that_does_not_stop_is_terminated(tiny_llama, stand_in_vllm, monkeypatch, caplog):
    """A worker stuck in its shutdown is sent SIGTERM, which it turns into an interpreter exit (vLLM's finalizers
    run); no SIGKILL needed."""
    monkeypatch.setenv("STAND_IN_VLLM_FAIL", "hang")
    monkeypatch.setattr("models.engine.vllm_sampling.STOP_SECONDS", 1.0)
    caplog.set_level(logging.INFO, logger="models.engine.vllm_sampling")
    started = time.monotonic()
    with _sampler(tiny_llama) as sampler:
        sampler(["hello"], batch_index=0, first_index=0)
    assert time.monotonic() - started < 20
    assert "did not stop within 1 s: terminated" in caplog.text and "killed" not in caplog.text
    assert _gone(_records(stand_in_vllm, "llm")[0]["pid"])


def test_vllm_python_is_checked_when_the_config_is_parsed(tmp_path, monkeypatch):
    def parse(**generate):
        return parse_config({"generate": {"engine": "vllm", **generate}}, root=tmp_path).generate

    with pytest.raises(ConfigError, match=r"generate.engine: vllm needs generate.vllm_python.*pip install "
                                          r"vllm==0\.33\.0"):
        parse()
    with pytest.raises(ConfigError, match=r"generate.vllm_python '/nowhere/bin/python' is not an executable file"):
        parse(vllm_python="/nowhere/bin/python")
    with pytest.raises(ConfigError, match=r"generate.vllm_python 'vllm-env/bin/python' must be an absolute path"):
        parse(vllm_python="vllm-env/bin/python")
    python = tmp_path / "vllm-env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o644)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"generate.vllm_python '~/vllm-env/bin/python' is not an executable"):
        parse(vllm_python="~/vllm-env/bin/python")
    python.chmod(0o755)
    assert parse(vllm_python="~/vllm-env/bin/python").vllm_python == str(python)  # ~ expanded
    # the hf engine never runs it: a path that is only right on the GPU machine does not stop a CPU run
    assert parse_config({"generate": {"vllm_python": "~/vllm-env/bin/python"}}, root=tmp_path).generate.engine == "hf"


def test_generation_in_two_processes_writes_the_one_process_table(tiny_llama, tmp_path):
    """``accelerate launch`` of the generate task in 2 CPU processes (gloo): each samples every other batch, the
    main one writes the table, equal to one process's row for row."""
    once = _project(tmp_path / "once", tiny_llama)
    _generate(once)
    cfg = load_config(once)
    expected = read_table(cfg.path(cfg.paths.samples), "samples")

    twice = _project(tmp_path / "twice", tiny_llama)
    launch = ("import sys; from prefect.logging import disable_run_logger; from foresight.config import load_config; "
              "from tasks.generate import generate_task\nwith disable_run_logger():\n"
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


def _budget_project(root: Path, tiny_llama: Path) -> Path:
    """A project on a prompt file of short and long questions (8 training prompts) sampled in batches of up to 3
    prompts under a token budget that fits three short prompts but not a long one beside them."""
    from prefect.logging import disable_run_logger

    from tasks.policy import prepare_policy_task
    from tasks.prompts import prepare_prompts_task

    short = [f"{name} has {n} apples. How many apples does {name} have?" for name, n in
             (("Ben", 2), ("Ivy", 3), ("Ava", 4), ("Omar", 5), ("Emma", 6), ("Hugo", 7))]
    long = [" ".join(f"{name} gives {name} {n} more pencils." for n in range(1, 9)) + " How many pencils?"
            for name in ("Dan", "Lena", "Finn", "Jack")]
    root.mkdir(parents=True, exist_ok=True)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in short + long))
    params = tiny_params(root, tiny_llama, prompts={"source": "file", "num_train": 8, "num_eval": 2,
                                                     "file": {"path": "prompts.jsonl", "text_column": "prompt"}},
                         generate={"batch_size": 3, "num_samples": 2, "max_new_tokens": 6, "max_batch_tokens": 300})
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    cfg = load_config(root / "params.yaml")
    with disable_run_logger():
        prepare_policy_task.fn(cfg)
        prepare_prompts_task.fn(cfg)
    return root / "params.yaml"


def test_a_token_budget_forms_the_same_batches_in_a_resumed_run(tiny_llama, tmp_path, monkeypatch, caplog):
    """``generate.max_batch_tokens``: the stage's batches follow the prompts' token lengths in their chat template
    (more batches than ``batch_size`` alone gives, none over the budget unless a lone prompt, with a warning), and a
    run that fails after two shards and is run again forms the same batches: its table equals an uninterrupted run's
    row for row."""
    from transformers import AutoTokenizer

    from foresight.prompt_limits import prompt_token_counts
    from models.engine.generation import batch_plan, batch_tokens
    from tasks.common import read_prompts

    uninterrupted = _budget_project(tmp_path / "once", tiny_llama)
    with caplog.at_level(logging.WARNING):
        result = _generate(uninterrupted)
    cfg = load_config(uninterrupted)
    expected = read_table(cfg.path(cfg.paths.samples), "samples")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    lengths = prompt_token_counts(tokenizer, read_prompts(cfg, "train")["question"].tolist(), None)
    # three short prompts fit the budget, a long one does not even alone
    assert 3 * 2 * (max(n for n in lengths if n < 100) + 6) <= 300 < 2 * (min(n for n in lengths if n >= 100) + 6)
    plan = batch_plan(lengths, 3, 2, 6, 300)
    assert result.metrics["num_batches"] == len(plan) > -(-len(lengths) // 3)
    lone = [b for b in plan if batch_tokens(lengths[b.start : b.stop], 2, 6) > 300]
    assert lone and all(len(b) == 1 for b in lone)
    assert f"{len(lone)} prompt(s) alone exceed generate.max_batch_tokens = 300" in caplog.text
    # each batch is one sampler call: its rows are its prompts × num_samples, every prompt's samples in one batch
    assert expected["prompt_tokens"].tolist() == [n for n in lengths for _ in range(2)]

    params_path = _budget_project(tmp_path / "failed", tiny_llama)
    write, written = ShardStore.write, []

    def write_then_fail(self, unit, table):
        write(self, unit, table)
        written.append(unit)
        if len(written) == 2:
            raise RuntimeError("the machine went away")

    monkeypatch.setattr(ShardStore, "write", write_then_fail)
    with pytest.raises(RuntimeError, match="went away"):
        _generate(params_path)
    monkeypatch.setattr(ShardStore, "write", write)
    resumed = _generate(params_path)
    assert resumed.metrics["resumed_batches"] == 2 and resumed.metrics["num_batches"] == len(plan)
    failed = load_config(params_path)
    pd.testing.assert_frame_equal(read_table(failed.path(failed.paths.samples), "samples"), expected)
