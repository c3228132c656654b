"""Prefect task of the ``generate`` stage: N sampled responses per training prompt from the policy, with the hf or
the vLLM engine, resumable batch by batch (docs/pipeline.md)."""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from foresight.pairs import SAMPLE_COLUMNS
from foresight.shards import ShardStore, shard_folder
from foresight.storage import write_table
from models.engine.generation import (
    HFSampler,
    batch_plan,
    batch_tokens,
    chat_prompts,
    generation_end_token_ids,
    sample_batches,
)
from models.engine.policy import MANIFEST, policy_path, resolve_device
from models.engine.vllm_sampling import VLLMSampler
from tasks.common import (
    StageResult,
    gpu_task,
    load_stage_policy,
    progress_artifact,
    read_prompts,
    stage_accelerator,
    stage_logger,
)

if TYPE_CHECKING:
    from foresight.config import Config


@gpu_task("generate-samples")
def generate_task(cfg: Config) -> StageResult:
    """Sample N responses per training prompt from the policy with the configured engine, batch by batch: each
    batch's rows go to a shard as soon as it is done, and a re-run after a crash samples only the batches missing
    (:mod:`foresight.shards`); the shards become the samples table at the end."""
    logger = stage_logger()
    started = time.perf_counter()
    prompts_df = read_prompts(cfg, "train")
    sampling = cfg.generate  # is-a models.engine.config.Sampling
    engine, tokenizer, device = _sampler(cfg, sampling, logger)
    prompts = chat_prompts(tokenizer, prompts_df["question"].tolist(), cfg.prompts.system_prompt)
    output = cfg.path(cfg.paths.samples)
    # what decides the shards' contents: another value of any of these makes old shards useless
    # (not where vLLM's venv lives: a path on this machine, not a setting of the draws)
    spec = {"generate": cfg.generate.model_dump(exclude={"vllm_python"}), "policy": cfg.policy.model_dump(),
            "policy_manifest": _policy_manifest(cfg), "prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest()}
    # under `accelerate launch` (launch.num_processes) each process samples every N-th batch: a batch's draws
    # depend on its index only, so the table is the one process's, row for row
    accelerator = stage_accelerator(device)
    with accelerator.main_process_first():  # the main process clears shards of other settings before any is read
        shards = ShardStore(shard_folder(output), spec)
    plan = _generate_batches(sampling, tokenizer, prompts, logger)
    batches = range(len(plan))
    resumed = shards.done() & set(batches)
    accelerator.wait_for_everyone()  # every process has seen the same finished batches before any is written
    mine = set(batches[accelerator.process_index :: accelerator.num_processes]) - resumed
    logger.info("sampling %d × %d with %s on %s%s", len(prompts), sampling.num_samples, sampling.engine,
                f"{device}, {accelerator.num_processes} process(es)",
                f"; {len(resumed)} of {len(batches)} batches already sampled by an earlier run" if resumed else "")

    progress = progress_artifact(key="generate-progress", description="Batches of prompts sampled")
    bar = tqdm(total=len(batches), initial=len(resumed), desc="generate", unit="batch",
               disable=not accelerator.is_local_main_process)
    new_tokens, seconds = 0, 0.0
    with engine as sampler:  # vLLM: its worker process lives while this process samples
        for b, completions, batch_seconds in sample_batches(sampler, prompts, plan, skip=set(batches) - mine):
            shards.write(b, _sample_rows(cfg, sampling, prompts_df, prompts, completions))
            new_tokens += sum(c.response_tokens for c in completions)
            seconds += batch_seconds
            bar.update(min(accelerator.num_processes, bar.total - bar.n))  # the others advance alike
            progress(100.0 * bar.n / len(batches))
    bar.close()
    totals = accelerator.reduce(torch.tensor([new_tokens, seconds], dtype=torch.float64, device=accelerator.device))
    new_tokens, seconds = int(totals[0]), float(totals[1]) / accelerator.num_processes  # processes run side by side
    accelerator.wait_for_everyone()  # every shard is written
    samples = shards.read(batches)
    accelerator.wait_for_everyone()  # every process has read the shards
    out = write_table(samples, output) if accelerator.is_main_process else output
    if accelerator.is_main_process:
        shards.remove()
    metrics = {
        "num_samples": len(samples),
        # this run's sampling only (batches resumed from an earlier run are not timed)
        "generation_tokens_per_s": new_tokens / seconds if seconds else float("nan"),
        "generation_seconds": seconds,
        "new_tokens": new_tokens,
        "resumed_batches": len(resumed),
        "num_batches": len(plan),
        "num_processes": accelerator.num_processes,
        "mean_response_tokens": float(samples["response_tokens"].mean()),
        "truncated_share": float((samples["finish_reason"] == "length").mean()),
        "wall_seconds": time.perf_counter() - started,
    }
    logger.info("generated %d samples (%d new tokens at %.1f tok/s)", len(samples), new_tokens,
                metrics["generation_tokens_per_s"])
    return StageResult(metrics=metrics, tables={"samples": out})


def _generate_batches(sampling, tokenizer, prompts: list[str], logger) -> list[range]:
    """The generate stage's batches (:func:`models.engine.generation.batch_plan`): ``generate.batch_size`` prompts,
    and with the hf engine at most ``generate.max_batch_tokens`` tokens, from the templated prompts' token lengths
    (as the sampler tokenises them). A function of the prompts and the knobs alone, which the shards' spec holds, so
    a resumed run forms the same batches. vLLM pages its KV cache and schedules its sequences within its own memory
    budget: the token budget would only shrink its batches."""
    budget = sampling.max_batch_tokens if sampling.engine == "hf" else None
    if sampling.max_batch_tokens is not None and budget is None:
        logger.info("generate.max_batch_tokens applies to the hf engine only: vLLM schedules its own KV cache")
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]] if prompts else []
    plan = batch_plan(lengths, sampling.batch_size, sampling.num_samples, sampling.max_new_tokens, budget)
    over = [batch for batch in plan if budget is not None
            and batch_tokens(lengths[batch.start : batch.stop], sampling.num_samples, sampling.max_new_tokens) > budget]
    if over:
        logger.warning("%d prompt(s) alone exceed generate.max_batch_tokens = %d (%d samples × (prompt + %d new "
                       "tokens); the longest prompt %d tokens): each is sampled in a batch of its own", len(over),
                       budget, sampling.num_samples, sampling.max_new_tokens, max(lengths[b.start] for b in over))
    return plan


def _sampler(cfg: Config, sampling, logger):
    """The configured engine, a context manager that gives its :class:`models.engine.generation.Sampler`; the
    policy's tokenizer; the device it runs on. vLLM loads the weights itself, in its worker process (its own venv,
    ``generate.vllm_python``; entering starts it, leaving stops it): the HF model is never loaded beside it."""
    if sampling.engine == "hf":
        policy = load_stage_policy(cfg, "base")
        return nullcontext(HFSampler(policy, sampling)), policy.tokenizer, policy.device
    path = policy_path(cfg.path(cfg.paths.policy_dir))
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.policy.trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's end tokens
        generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    eos = generation_end_token_ids(generation_config, tokenizer)
    sampler = VLLMSampler(sampling.vllm_python, path, cfg.policy, sampling, tokenizer, eos,
                          sampling.tensor_parallel_size, logger)
    return sampler, tokenizer, resolve_device(cfg.policy.device)


def _policy_manifest(cfg: Config) -> str:
    """The prepared policy's manifest (which model, which revision), or "" before it exists."""
    path = cfg.path(cfg.paths.policy_dir) / MANIFEST
    return path.read_text() if path.is_file() else ""


def _sample_rows(cfg: Config, sampling, prompts_df: pd.DataFrame, prompts: list[str], completions) -> pd.DataFrame:
    """The samples table's rows of some completions."""
    rows = []
    for c in completions:
        src = prompts_df.iloc[c.prompt_index]
        rows.append({
            "sample_id": f"{src['prompt_id']}/{c.sample_index}", "prompt_id": src["prompt_id"],
            "sample_index": c.sample_index, "question": src["question"], "prompt": prompts[c.prompt_index],
            "response": c.response, "answer": src["answer"], "prompt_tokens": c.prompt_tokens,
            "response_tokens": c.response_tokens, "finish_reason": c.finish_reason,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "max_new_tokens": sampling.max_new_tokens, "seed": sampling.seed, "model": cfg.policy.model,
        })
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)
