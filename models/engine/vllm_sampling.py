"""vLLM as the generate stage's engine (``generate.engine: vllm``): the engine the SLA and SimPO authors sampled their
preference data with, for the paper-scale job (~60k prompts × 5 samples from an 8B policy) that HF ``generate``
would take 11–22 h for on one H100 (docs/pipeline.md#generation-engines).

vLLM is an optional extra (``pip install -e .[vllm]``, GPU machines): it pins its own torch, so it is imported only
when this engine is asked for, and a missing install is an error that says how to get it. The mapping both ways is
plain functions, tested against stand-ins that follow vLLM's documented types (``tests/test_policy_generation.py``):

* requests: each prompt as token ids (``{"prompt_token_ids": …}``), tokenised as the HF engine does, without adding
  special tokens (the chat template holds them; vLLM's text path would add a second BOS to a Llama-3 prompt), with
  its own ``SamplingParams(n=N, temperature, top_p, top_k, seed, max_tokens, stop_token_ids)``. The seed is
  ``seed + prompt index``: a prompt's samples do not depend on what else is in the batch, so a resumed job draws
  what an uninterrupted one does. ``top_k`` 0 (off) is vLLM's −1.
* responses: ``RequestOutput.outputs[i]`` (``CompletionOutput``: ``index``, ``text``, ``token_ids``,
  ``finish_reason``) → :class:`models.engine.generation.Completion`, the same schema as the HF engine's:
  ``finish_reason`` ``"stop"`` (an end token) is ``"eos"``, ``"length"`` stays; ``response_tokens`` counts the end
  token, as the HF engine does.

The two engines draw from the same distribution but not the same random numbers: their samples differ row by row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from models.engine.config import PolicySpec, Sampling
from models.engine.generation import Completion

FINISH_REASONS = {"stop": "eos", "length": "length"}
"""vLLM's ``CompletionOutput.finish_reason`` → the samples table's."""


def import_vllm():
    """The ``vllm`` module, or an error that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError("generate.engine: vllm needs vLLM, an optional extra for GPU machines: pip install -e "
                          ".[vllm] (it pins its own torch: docs/pipeline.md#generation-engines), or set "
                          "generate.engine: hf") from err
    return vllm


def vllm_requests(vllm, prompt_ids: Sequence[Sequence[int]], first_index: int, cfg: Sampling,
                  eos_ids: set[int]) -> tuple[list[dict], list]:
    """One request per prompt: its token ids and its ``SamplingParams`` (seeded with ``seed`` + its index)."""
    prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
    params = [vllm.SamplingParams(n=cfg.num_samples, temperature=cfg.temperature, top_p=cfg.top_p,
                                  top_k=cfg.top_k if cfg.top_k > 0 else -1, seed=cfg.seed + first_index + i,
                                  max_tokens=cfg.max_new_tokens, stop_token_ids=sorted(eos_ids))
              for i in range(len(prompt_ids))]
    return prompts, params


def vllm_completions(outputs: Sequence, first_index: int) -> list[Completion]:
    """``LLM.generate``'s ``RequestOutput`` list (in request order) as completions, prompt by prompt, sample by
    sample. An unknown finish reason (an abort) is an error naming the prompt, never a silent row."""
    completions = []
    for i, request in enumerate(outputs):
        for out in sorted(request.outputs, key=lambda o: o.index):
            if out.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"vLLM finished sample {out.index} of prompt {first_index + i} with "
                                   f"{out.finish_reason!r}; expected one of {sorted(FINISH_REASONS)}")
            completions.append(Completion(prompt_index=first_index + i, sample_index=out.index,
                                          response=out.text.strip(), prompt_tokens=len(request.prompt_token_ids),
                                          response_tokens=len(out.token_ids),
                                          finish_reason=FINISH_REASONS[out.finish_reason]))
    return completions


def narrow_to_local_gpus(tensor_parallel_size: int) -> None:
    """Under ``accelerate launch`` (data parallel: ``launch.num_processes`` processes on a host, each sampling its
    share of the batches), show this process's vLLM only its own GPUs: local rank r gets the r-th group of
    ``tensor_parallel_size`` visible GPUs. vLLM's engine starts on the first GPU it sees, so without this every
    process would pile onto GPU 0. A single process (no launch) keeps every visible GPU."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    first = int(os.environ["LOCAL_RANK"]) * tensor_parallel_size
    mine = gpus[first : first + tensor_parallel_size]
    if len(mine) < tensor_parallel_size:
        raise RuntimeError(f"local rank {os.environ['LOCAL_RANK']} needs GPUs {first}…{first + tensor_parallel_size - 1}"
                           f" of {len(gpus)} visible: lower launch.num_processes or generate.tensor_parallel_size")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)


class VLLMSampler:
    """:class:`models.engine.generation.Sampler` on a vLLM ``LLM`` over the prepared policy's folder.

    ``tokenizer``: the policy's HF tokenizer (the prompts are tokenised as the HF engine tokenises them);
    ``eos_ids``: the end tokens (:func:`models.engine.generation.end_token_ids`); ``tensor_parallel_size``: GPUs
    one model is split over (vLLM's own workers)."""

    def __init__(self, model_path: Path, policy: PolicySpec, cfg: Sampling, tokenizer, eos_ids: set[int],
                 tensor_parallel_size: int = 1):
        vllm = import_vllm()
        self.vllm, self.cfg, self.tokenizer, self.eos_ids = vllm, cfg, tokenizer, eos_ids
        narrow_to_local_gpus(tensor_parallel_size)
        # the policy's dtype; its "auto" on a GPU is bf16 (vLLM's "auto" would take the checkpoint's, float32 for
        # the embedded model's conversion)
        dtype = "bfloat16" if policy.dtype == "auto" else policy.dtype
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, seed=cfg.seed,
                            tensor_parallel_size=tensor_parallel_size, trust_remote_code=policy.trust_remote_code)

    def __call__(self, prompts: Sequence[str], batch_index: int, first_index: int) -> list[Completion]:
        prompt_ids = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        requests, params = vllm_requests(self.vllm, prompt_ids, first_index, self.cfg, self.eos_ids)
        return vllm_completions(self.llm.generate(requests, params, use_tqdm=False), first_index)
