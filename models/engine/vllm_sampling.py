"""vLLM as the generate stage's engine (``generate.engine: vllm``): the engine the SLA and SimPO authors sampled their
preference data with, for the paper-scale job (~60k prompts × 5 samples from an 8B policy) that HF ``generate``
would take 11–22 h for on one H100 (docs/pipeline.md#generation-engines).

vLLM cannot be installed beside the pipeline: every release caps a package below one of the pipeline's pins
(0.33: transformers < 5.21, fastapi < 0.137; ../shared/NOTES.md). So it runs as its own process in its own venv:
:class:`VLLMSampler` starts :mod:`models.engine.vllm_worker` (a plain script: standard library and vllm only) with
the interpreter ``generate.vllm_python``, once per stage, has it load the model, sends it each batch as JSON lines
and stops it at the end. This process never imports vllm. What is mapped here, in plain functions:

* requests: each prompt as token ids, tokenised as the HF engine does, without adding special tokens (the chat
  template holds them; vLLM's text path would add a second BOS to a Llama-3 prompt), with its own
  ``SamplingParams(n=N, temperature, top_p, top_k, seed, max_tokens, stop_token_ids)`` (vLLM 0.33
  ``vllm/sampling_params.py``). ``top_k`` 0 (off) is sent as −1, which every vLLM release reads as off. Seeds: vLLM
  seeds sample s of a request with ``seed + s`` (``vllm/v1/engine/parallel_sampling.py``,
  ``ParentRequest._get_child_sampling_params``), so prompt i (its index among all prompts) gets ``seed + i·N``: its
  N streams ``seed + i·N … seed + i·N + N − 1`` are its own, never a neighbour's, and do not depend on what else
  is in the batch, so a resumed job draws what an uninterrupted one does.
* responses: ``RequestOutput.outputs`` (``CompletionOutput``: ``index``, ``text``, ``token_ids``,
  ``finish_reason``) → :class:`models.engine.generation.Completion`, the same schema as the HF engine's:
  ``finish_reason`` ``"stop"`` (an end token) is ``"eos"``, ``"length"`` stays; ``response_tokens`` counts the end
  token, as the HF engine does.
* GPUs: under ``accelerate launch`` each process's worker sees only its own group of ``tensor_parallel_size`` GPUs,
  through ``CUDA_VISIBLE_DEVICES`` in the worker's environment.

The two engines draw from the same distribution but not the same random numbers: their samples differ row by row.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from models.engine.config import PolicySpec, Sampling
from models.engine.generation import Completion

WORKER = Path(__file__).with_name("vllm_worker.py")
"""The worker script, run as a plain file by ``generate.vllm_python``."""

TESTED_VLLM = "0.33.0"
"""The vLLM release whose API the worker and these mappings were written against (docs/pipeline.md)."""

FINISH_REASONS = {"stop": "eos", "length": "length"}
"""vLLM's ``CompletionOutput.finish_reason`` → the samples table's."""

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
"""``accelerate launch`` (torchrun) variables kept from the worker: each worker is a standalone vLLM on its own GPUs
whose tensor-parallel processes set up their own process group, not a rank of the launcher's."""

STDERR_TAIL = 40
"""Lines of the worker's stderr quoted when it fails."""

STOP_SECONDS = 120.0
"""How long a worker asked to stop may take (vLLM shuts its engine processes down) before it is terminated."""


def sampling_params(cfg: Sampling, prompt_index: int, eos_ids: set[int]) -> dict:
    """``vllm.SamplingParams`` keyword arguments of prompt ``prompt_index`` (its index among all prompts)."""
    return {"n": cfg.num_samples, "temperature": cfg.temperature, "top_p": cfg.top_p,
            "top_k": cfg.top_k if cfg.top_k > 0 else -1, "seed": cfg.seed + prompt_index * cfg.num_samples,
            "max_tokens": cfg.max_new_tokens, "stop_token_ids": sorted(eos_ids)}


def vllm_completions(outputs: Sequence[Sequence[Mapping]], prompt_ids: Sequence[Sequence[int]],
                     first_index: int) -> list[Completion]:
    """The worker's outputs (per prompt, in request order, its samples' ``CompletionOutput`` fields) as completions,
    prompt by prompt, sample by sample. An unknown finish reason (an abort) is an error naming the prompt, never a
    silent row."""
    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"the vLLM worker answered {len(outputs)} requests for {len(prompt_ids)} prompts")
    completions = []
    for i, (samples, ids) in enumerate(zip(outputs, prompt_ids, strict=True)):
        for out in sorted(samples, key=lambda o: o["index"]):
            if out["finish_reason"] not in FINISH_REASONS:
                raise RuntimeError(f"vLLM finished sample {out['index']} of prompt {first_index + i} with "
                                   f"{out['finish_reason']!r}; expected one of {sorted(FINISH_REASONS)}")
            completions.append(Completion(prompt_index=first_index + i, sample_index=out["index"],
                                          response=out["text"].strip(), prompt_tokens=len(ids),
                                          response_tokens=len(out["token_ids"]),
                                          finish_reason=FINISH_REASONS[out["finish_reason"]]))
    return completions


def worker_environment(env: Mapping[str, str], tensor_parallel_size: int, device_count=None) -> dict[str, str]:
    """The worker's environment: ours without the launcher's variables, with ``CUDA_VISIBLE_DEVICES`` narrowed under
    ``accelerate launch`` (data parallel: ``launch.num_processes`` processes on a host, each sampling its share of
    the batches): local rank r gets the r-th group of ``tensor_parallel_size`` visible GPUs. vLLM's engine starts on
    the first GPU it sees, so without this every process would pile onto GPU 0. A single process (no launch) keeps
    every visible GPU. ``device_count``: a callable counting the GPUs when ``CUDA_VISIBLE_DEVICES`` is unset."""
    worker = {k: v for k, v in env.items() if k not in LAUNCHER_VARIABLES}
    if int(env.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return worker
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(device_count())]
    first = int(env["LOCAL_RANK"]) * tensor_parallel_size
    mine = gpus[first : first + tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise RuntimeError(f"local rank {env['LOCAL_RANK']} needs GPUs {first}…{first + tensor_parallel_size - 1}"
                           f" of {len(gpus)} visible: lower launch.num_processes or generate.tensor_parallel_size")
    worker["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return worker


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


class VLLMSampler:
    """:class:`models.engine.generation.Sampler` on a vLLM worker process over the prepared policy's folder; a
    context manager: entering starts the worker and loads the model (once per stage), leaving stops it.

    ``python``: the interpreter of vLLM's venv (``generate.vllm_python``); ``tokenizer``: the policy's HF tokenizer
    (the prompts are tokenised as the HF engine tokenises them); ``eos_ids``: the end tokens
    (:func:`models.engine.generation.end_token_ids`); ``tensor_parallel_size``: GPUs one model is split over (vLLM's
    own workers); ``logger``: where the worker's stderr (vLLM's log) goes, line by line."""

    def __init__(self, python: str | Path, model_path: Path, policy: PolicySpec, cfg: Sampling, tokenizer,
                 eos_ids: set[int], tensor_parallel_size: int = 1,
                 logger: logging.Logger | logging.LoggerAdapter | None = None):
        self.python, self.cfg, self.tokenizer, self.eos_ids = str(python), cfg, tokenizer, eos_ids
        self.tensor_parallel_size = tensor_parallel_size
        self.logger = logger or logging.getLogger(__name__)
        # the policy's dtype; its "auto" on a GPU is bf16 (vLLM's "auto" would take the checkpoint's, float32 for
        # the embedded model's conversion)
        dtype = "bfloat16" if policy.dtype == "auto" else policy.dtype
        self.llm = {"model": str(model_path), "dtype": dtype, "seed": cfg.seed,
                    "tensor_parallel_size": tensor_parallel_size, "trust_remote_code": policy.trust_remote_code}
        self.process: subprocess.Popen | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)

    def __enter__(self) -> VLLMSampler:
        env = worker_environment(os.environ, self.tensor_parallel_size, _cuda_device_count)
        started = time.perf_counter()
        self.process = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env, text=True, encoding="utf-8", bufsize=1)
        self._stderr_reader = threading.Thread(target=self._stream_stderr, args=(self.process.stderr,),
                                              name="vllm-worker-stderr", daemon=True)
        self._stderr_reader.start()
        try:
            ready = self._ask({"op": "load", "llm": self.llm}, "loading the model")
        except BaseException:
            self._stop(timeout=10)
            raise
        if ready["vllm_version"] != TESTED_VLLM:
            self.logger.warning("vLLM %s in %s; the worker was written and tested against %s",
                                ready["vllm_version"], self.python, TESTED_VLLM)
        self.logger.info("vLLM %s worker ready (%s, GPUs %s): model loaded in %.1f s", ready["vllm_version"],
                         self.python, env.get("CUDA_VISIBLE_DEVICES", "all visible"), time.perf_counter() - started)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # after an error its answers are not wanted: a worker busy with a batch is not waited for
        returncode = self._stop(timeout=STOP_SECONDS if exc_type is None else 10)
        if exc_type is None and returncode != 0:
            raise self._failure(f"exited with code {returncode} when asked to stop")

    def __call__(self, prompts: Sequence[str], batch_index: int, first_index: int) -> list[Completion]:
        if self.process is None:
            raise RuntimeError("VLLMSampler is a context manager: sample inside `with sampler:`")
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        params = [sampling_params(self.cfg, first_index + i, self.eos_ids) for i in range(len(prompts))]
        answer = self._ask({"op": "generate", "prompts": prompt_ids, "params": params}, f"sampling batch {batch_index}")
        return vllm_completions(answer["outputs"], prompt_ids, first_index)

    def _ask(self, request: dict, doing: str) -> dict:
        """Send one request, read its answer; a worker that dies on the way is an error quoting its stderr."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died: its exit code and stderr say why
        line = self.process.stdout.readline()
        if not line:
            returncode = self.process.wait()
            self._stderr_reader.join(timeout=10)
            raise self._failure(f"exited with code {returncode} while {doing}")
        return json.loads(line)

    def _stop(self, timeout: float) -> int:
        """Close the worker's stdin (its signal to return) and wait ``timeout`` seconds for it; then SIGTERM (the
        worker exits through vLLM's finalizers, which stop its engine processes), then, 30 s later, SIGKILL."""
        process, self.process = self.process, None
        try:
            process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.logger.warning("the vLLM worker did not stop within %.0f s: terminated", timeout)
            process.terminate()
            try:
                returncode = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.logger.warning("the vLLM worker did not stop within 30 s of SIGTERM: killed")
                process.kill()
                returncode = process.wait()
        self._stderr_reader.join(timeout=10)
        process.stdout.close()
        return returncode

    def _stream_stderr(self, stderr) -> None:
        for line in stderr:
            line = line.rstrip("\n")
            self.stderr_tail.append(line)
            self.logger.info("vllm: %s", line)

    def _failure(self, what: str) -> RuntimeError:
        tail = "\n".join(self.stderr_tail) or "(nothing)"
        return RuntimeError(f"the vLLM worker ({self.python} {WORKER}) {what} (generate.vllm_python; "
                            f"docs/pipeline.md#generation-engines). The end of its stderr:\n{tail}")
