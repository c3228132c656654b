"""Prefect tasks of the data stages: prepare policy → prompts → generate → label → validate + pairs.

Thin wrappers: the work lives in ``models/`` and ``foresight/`` (docs/pipeline.md); model code gets its own
small configs, built from the params sections with :func:`foresight.config.component`. Each task writes its outputs
atomically (nothing half-written survives a failure) and returns a :class:`StageResult` of metrics
and paths, never models or tensors. DVC decides what is stale, so Prefect's own result caching is off.

Tasks that run a neural network are :func:`gpu_task` s: tagged ``gpu``, so a Prefect concurrency limit
(``prefect concurrency-limit create gpu 1``) guards the GPUs, and retried once after a transient CUDA error.
Only stage tasks carry the tag, never a task that waits for them (that would deadlock the limit).

A training stage may run in several processes at once (``launch.num_processes``, docs/gpu.md): its task then
runs in each process of an ``accelerate launch``, outside any Prefect run, so tasks log through
:func:`stage_logger` and publish artifacts through :func:`table_artifact` / :func:`markdown_artifact` /
:func:`progress_artifact`, which outside a run keep them for the flow's process to publish.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pandas as pd
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError
from tqdm.auto import tqdm

from foresight.config import Config, component
from foresight.pairs import SAMPLE_COLUMNS, SCORE_COLUMNS, make_pairs
from foresight.storage import read_table, write_table

GPU_TAG = "gpu"

TRANSIENT_CUDA_ERRORS = ("CUDA error: unspecified launch failure", "CUDA error: an illegal memory access",
                         "CUDA error: uncorrectable ECC error", "NCCL", "CUDA-capable device(s) is/are busy",
                         "CUBLAS_STATUS_EXECUTION_FAILED", "CUDA error: misaligned address")
"""Messages of CUDA failures that a fresh attempt may not meet (a flaky device, a busy GPU, a collective that
timed out). Out of memory is not among them: it fails again, and says which knob to turn."""


def is_transient_cuda_error(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA or NCCL failure worth one more attempt (never out-of-memory)."""
    import torch

    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    return isinstance(error, RuntimeError) and any(message in str(error) for message in TRANSIENT_CUDA_ERRORS)


def _retry_on_transient_cuda_error(task, task_run, state) -> bool:
    try:
        state.result()
    except Exception as error:  # noqa: BLE001 - the failure's own exception decides
        return is_transient_cuda_error(error)
    return False


def gpu_task(name: str, log_prints: bool | None = None):
    """A stage task that runs a neural network: tagged ``gpu``, uncached, retried once after a transient CUDA
    error (:func:`is_transient_cuda_error`). ``log_prints``: the flow's setting unless given."""
    return task(name=name, tags=[GPU_TAG], cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10,
                retry_condition_fn=_retry_on_transient_cuda_error, log_prints=log_prints)


def in_prefect_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run (not so in a worker of ``accelerate launch``)."""
    try:
        get_run_context()
    except MissingContextError:
        return False
    return True


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; outside one (an ``accelerate launch`` worker) a plain logger."""
    return get_run_logger() if in_prefect_run() else logging.getLogger("foresight.stage")


PENDING_ARTIFACTS: list[dict] = []
"""Artifacts a task made outside a Prefect run, for the flow's process to publish (``flows.stages``)."""


def table_artifact(key: str, table: list[dict], description: str) -> None:
    """A Prefect table artifact (kept for the flow's process when outside a run)."""
    if in_prefect_run():
        create_table_artifact(key=key, table=table, description=description)
    else:
        PENDING_ARTIFACTS.append({"kind": "table", "key": key, "table": table, "description": description})


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    """A Prefect markdown artifact (kept for the flow's process when outside a run)."""
    if in_prefect_run():
        create_markdown_artifact(key=key, markdown=markdown, description=description)
    else:
        PENDING_ARTIFACTS.append({"kind": "markdown", "key": key, "markdown": markdown, "description": description})


def progress_artifact(key: str, description: str):
    """A Prefect progress artifact at 0 %; returns the function that moves it (a no-op outside a run)."""
    if not in_prefect_run():
        return lambda percent: None
    progress_id = create_progress_artifact(progress=0.0, key=key, description=description)
    return lambda percent: update_progress_artifact(progress_id, progress=percent)


@dataclass
class StageResult:
    """What a stage reports: scalar metrics, tables to preview in MLflow, folders to attach, training curves (one
    value per step) to log as MLflow metric histories, and the trained artifacts users reuse (``models``: name →
    folder; registered in MLflow's model registry when ``tracking.register_models`` names them, else attached)."""

    metrics: dict
    curves: dict[str, list[float]] = field(default_factory=dict)
    tables: dict[str, Path] = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)
    models: dict[str, Path] = field(default_factory=dict)


POLICY_SOURCES = ("base", "dpo")

COLLECTIVE_TIMEOUT = timedelta(hours=6)
"""How long a process of a launched stage waits at a barrier or collective before giving up."""


def load_stage_policy(cfg: Config, policy_source: str, training: bool = False):
    """The policy a stage works on: ``base`` (the prepared policy) or ``dpo`` (the DPO-tuned folder); ``training``
    for a stage that trains through it (``policy.dtype: auto`` is then float32 on a CPU)."""
    from models.engine.config import PolicySpec
    from models.engine.policy import load_policy

    if policy_source not in POLICY_SOURCES:
        raise ValueError(f"policy_source must be one of {POLICY_SOURCES}, got {policy_source!r}")
    if policy_source == "base":
        return load_policy(component(PolicySpec, cfg.policy), cfg.path(cfg.paths.policy_dir), training)
    return load_trained_policy(cfg, cfg.path(cfg.paths.dpo_dir), training)


def load_trained_policy(cfg: Config, folder: Path, training: bool = False):
    """A model folder a stage wrote (the DPO policy, the COrAL model) on the policy's device, in its dtype."""
    from models.engine.config import PolicySpec
    from models.engine.policy import load_pretrained

    return load_pretrained(folder, component(PolicySpec, cfg.policy), training)


def stage_accelerator(device, mixed_precision: str = "no"):
    """The ``accelerate.Accelerator`` a stage runs under: on the policy's ``device`` (CPU when it is on the CPU),
    one or many processes as ``accelerate launch`` configured them.

    Under several processes, some work runs on the main process alone while the others wait at a barrier (the
    Medusa stage's distillation pass, writing outputs): hours at 8B on real data, so the process group's timeout
    is raised from torch's default (10 min for NCCL) to ``COLLECTIVE_TIMEOUT``.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    return Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision,
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)])


DISTILLED_SPLIT_FILE = "split.safetensors"
"""In ``train_medusa``'s ``distilled/``: the rows of ``responses.parquet`` held out (``eval_samples``) and trained on
(``train_samples``); every drafter that learns from these responses uses this one split."""


def distilled_dir(cfg: Config) -> Path:
    """``train_medusa``'s folder of distilled responses, their frozen pass and their split."""
    return cfg.path(cfg.paths.medusa_dir) / "distilled"


def split_distilled(responses: pd.DataFrame, eval_fraction: float, seed: int):
    """Training and held-out rows of the distilled responses, split by prompt among the responses that every drafter
    learns from (not ``further_prompt``); the responses to further task prompts, the Medusa heads' alone, all train.
    So the held-out sequences are the same for Medusa, COrAL and the MTP module (:func:`drafter_split`)."""
    import torch

    shared = responses.index[~responses["further_prompt"].to_numpy(bool)]
    train_shared, eval_rows = split_responses(responses.loc[shared], eval_fraction, seed)
    further = torch.from_numpy(responses.index[responses["further_prompt"].to_numpy(bool)].to_numpy())
    train_rows = torch.cat([torch.from_numpy(shared.to_numpy())[train_shared], further]).sort().values
    return train_rows, torch.from_numpy(shared.to_numpy())[eval_rows]


def shared_distilled_responses(cfg: Config, key: str, further: bool = False) -> pd.DataFrame:
    """The responses ``train_medusa`` distilled from that the other stages learn from too — those to the training
    prompts and general instructions; those to further task prompts (``medusa.task_prompts``) only with ``further``
    — indexed by their row in ``distilled/responses.parquet``. ``key`` names the setting that reads them."""
    path = distilled_dir(cfg) / "responses.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the train_medusa stage ({key} reads it)")
    responses = read_table(path, "distilled responses")
    return responses if further else responses[~responses["further_prompt"]]


def sft_responses(cfg: Config, source: str, key: str, further: bool = False) -> pd.DataFrame:
    """Responses a stage fine-tunes on: ``distilled`` = the policy's own (greedy) responses to the training prompts
    and general instructions that ``train_medusa`` distilled from, with ``further`` also those to the further task
    prompts its heads learn from (:func:`shared_distilled_responses`; column ``distilled_row`` keeps their row
    there; further rows always train, :func:`split_distilled`); ``correct`` = the generated samples the labeler
    marked correct. ``key`` names the setting."""
    if source == "distilled":
        responses = (shared_distilled_responses(cfg, f"{key}: distilled", further).rename_axis("distilled_row")
                     .reset_index())
    else:
        scores = read_table(cfg.path(cfg.paths.scores), "scored samples")
        responses = scores[scores["correct"].fillna(False).astype(bool)].reset_index(drop=True)
        if responses.empty:
            raise ValueError(f"{cfg.path(cfg.paths.scores)} has no sample labeled correct: {key}: correct needs "
                             "prompts with known answers and a verifiable labeler")
    if responses.empty:
        raise ValueError(f"no responses to train on ({key}: {source})")
    return responses


def drafter_split(cfg: Config, responses: pd.DataFrame, eval_fraction: float, seed: int):
    """Row indices of training and held-out ``responses`` (from :func:`sft_responses`). Distilled responses take
    ``train_medusa``'s split (:data:`DISTILLED_SPLIT_FILE`), so that every drafter's accuracy and acceptance are
    measured on the same held-out sequences; ``eval_fraction`` and ``seed`` split other responses by prompt."""
    if "distilled_row" not in responses:
        return split_responses(responses, eval_fraction, seed)
    import torch
    from safetensors.torch import load_file

    path = distilled_dir(cfg) / DISTILLED_SPLIT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the train_medusa stage first")
    is_eval = torch.from_numpy(responses["distilled_row"].isin(load_file(path)["eval_samples"].numpy()).to_numpy())
    rows = torch.arange(len(responses))
    return rows[~is_eval], rows[is_eval]


def validation_split(responses: pd.DataFrame, train_rows, fraction: float, seed: int):
    """``train_rows`` split by prompt into rows to fit on and validation rows that decide when training stops
    (:class:`models.common.training.EarlyStopping`): the held-out rows that a stage reports its accuracy on never
    choose the epoch they are measured at."""
    fit, validation = split_responses(responses.iloc[train_rows.tolist()], fraction, seed)
    return train_rows[fit], train_rows[validation]


def split_responses(responses: pd.DataFrame, eval_fraction: float, seed: int):
    """Row indices of training and held-out responses, split by prompt; an error if either side is empty."""
    from models.common.splits import split_by_prompt

    train_rows, eval_rows = split_by_prompt(responses, eval_fraction, seed)
    if len(train_rows) == 0 or len(eval_rows) == 0:
        raise ValueError(f"{len(responses)} responses from {responses['prompt_id'].nunique()} prompt(s) cannot be split "
                         "into training and held-out prompts: at least 2 prompts are needed")
    return train_rows, eval_rows


PROMPT_SPLITS = {"train": "training prompts", "eval": "held-out prompts"}


def _prompt_split_path(cfg: Config, split: str) -> Path:
    return cfg.path(cfg.paths.prompts_dir) / f"{split}.jsonl"


def read_prompts(cfg: Config, split: str) -> pd.DataFrame:
    """The ``train`` or ``eval`` (held-out) prompts ``prepare_prompts`` wrote; a clear error if it has not run."""
    return read_table(_prompt_split_path(cfg, split), PROMPT_SPLITS[split])


def prompt_token_limit(cfg: Config, max_new_tokens: int | None = None) -> int:
    """The longest prompt, in the policy's chat template, that any stage gives the policy:
    ``prompts.max_prompt_tokens``, or automatically the policy's context minus ``generate.max_new_tokens`` and, with a
    reward-model labeler, at most ``label.max_length`` minus it (:func:`foresight.prompts.resolve_max_prompt_tokens`).
    One rule for the splits (``prepare_prompts``) and every prompt set read elsewhere (:func:`drop_long_prompt_sets`);
    a stage that decodes with a budget of its own (``max_new_tokens``) keeps, besides, only prompts that leave it room
    in the context. Reads the prepared policy's config.json, not its weights."""
    from foresight.prompts import policy_context_length, resolve_max_prompt_tokens
    from models.engine.policy import policy_path

    context = policy_context_length(policy_path(cfg.path(cfg.paths.policy_dir)), cfg.policy.trust_remote_code)
    reward_model_length = cfg.label.max_length if cfg.label.labeler != "verifiable" else None
    limit = resolve_max_prompt_tokens(cfg.prompts.max_prompt_tokens, context, cfg.generate.max_new_tokens,
                                      reward_model_length)
    return limit if max_new_tokens is None else min(limit, context - max_new_tokens)


def drop_long_prompt_sets(cfg: Config, tokenizer, sets: dict[str, pd.DataFrame], max_new_tokens: int
                          ) -> tuple[dict[str, pd.DataFrame], dict[str, int]]:
    """Each prompt set (a table with ``question``) without its prompts over :func:`prompt_token_limit`, counted in
    the policy's chat template (:func:`foresight.prompts.drop_long_prompts`: a set that keeps none is an error), and
    metrics ``dropped_long_prompts.<set>``; a warning names each set that lost prompts and how many. For the stages
    that read prompts besides the splits ``prepare_prompts`` already checked (further task prompts, the general
    instruction set, benchmark prompt files), which decode up to ``max_new_tokens``: a prompt over the policy's
    context would fail or decode junk."""
    from foresight.prompts import drop_long_prompts

    limit = prompt_token_limit(cfg, max_new_tokens)
    kept, counts = drop_long_prompts(sets, tokenizer, cfg.prompts.system_prompt, limit)
    dropped = {name: [n for n in set_counts if n > limit] for name, set_counts in counts.items()}
    for name, over in dropped.items():
        if over:
            stage_logger().warning(
                "prompt set %r: dropped %d of %d prompt(s) longer than prompts.max_prompt_tokens = %d tokens in the "
                "policy's chat template (the longest %d tokens)", name, len(over), len(sets[name]), limit, max(over))
    return kept, {f"dropped_long_prompts.{name}": len(over) for name, over in dropped.items()}


def reference_answers(table: pd.DataFrame) -> list[str | None]:
    """The table's ``answer`` column as Python values, None where a prompt has no reference answer (NaN in a
    parquet or jsonl column)."""
    return [None if pd.isna(answer) else answer for answer in table["answer"]]


@task(name="prepare-policy", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def prepare_policy_task(cfg: Config) -> StageResult:
    """Make the configured policy available locally (retried: a hub download can fail transiently)."""
    from models.engine.config import PolicySpec
    from models.engine.policy import prepare_policy

    started = time.perf_counter()
    manifest = prepare_policy(component(PolicySpec, cfg.policy), cfg.path(cfg.paths.policy_dir))
    get_run_logger().info("policy ready: %s", manifest)
    return StageResult(metrics={"wall_seconds": time.perf_counter() - started})


@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_prompts_task(cfg: Config) -> StageResult:
    """Read the prompt source and write the deterministic train / eval splits without the prompts longer than
    ``prompts.max_prompt_tokens`` in the policy's chat template (:func:`foresight.prompts.drop_long_prompts`; the
    policy's tokenizer and config.json are read, not its weights)."""
    from transformers import AutoTokenizer

    from foresight.prompts import drop_long_prompts, load_prompts
    from models.engine.policy import policy_path
    from models.labeling.answers import unreadable_references

    started = time.perf_counter()
    logger = get_run_logger()
    limit = prompt_token_limit(cfg)
    source_counts: dict[str, int] = {}
    train, held_out = load_prompts(cfg.prompts, cfg.root, source_counts)
    tokenizer = AutoTokenizer.from_pretrained(policy_path(cfg.path(cfg.paths.policy_dir)),
                                              trust_remote_code=cfg.policy.trust_remote_code)
    kept, counts = drop_long_prompts({"train": train, "eval": held_out}, tokenizer, cfg.prompts.system_prompt, limit)
    dropped = {split: [n for n in split_counts if n > limit] for split, split_counts in counts.items()}
    if any(dropped.values()):
        logger.warning("dropped %d prompt(s) longer than prompts.max_prompt_tokens = %d tokens in the policy's chat "
                       "template (%d training, %d held-out; the longest %d tokens)",
                       sum(map(len, dropped.values())), limit, len(dropped["train"]), len(dropped["eval"]),
                       max(max(d, default=0) for d in dropped.values()))
    train, held_out = kept["train"], kept["eval"]
    paths = {split: _prompt_split_path(cfg, split) for split in ("train", "eval")}
    write_table(train, paths["train"])
    write_table(held_out, paths["eval"])
    unreadable = unreadable_references([*train["answer"].dropna(), *held_out["answer"].dropna()])
    metrics = {
        "num_train": len(train),
        "num_eval": len(held_out),
        "with_answer": float(train["answer"].notna().mean()),
        "unparseable_references": len(unreadable),
        "max_prompt_tokens": limit,
        "longest_prompt_tokens": max((n for split_counts in counts.values() for n in split_counts if n <= limit),
                                     default=0),
        "dropped_long_prompts": sum(map(len, dropped.values())),
        "dropped_long_train": len(dropped["train"]),
        "dropped_long_eval": len(dropped["eval"]),
        "multi_turn_prompts": source_counts["multi_turn_prompts"],  # source rows cut to their first turn
        "wall_seconds": time.perf_counter() - started,
    }
    logger.info("prompts: %d train, %d eval from source '%s' (at most %d tokens each in the policy's chat template)",
                len(train), len(held_out), cfg.prompts.source, limit)
    if len(unreadable):
        logger.warning("%d reference answer(s) have no answer the verifiable labeler can read (a number, '#### X', "
                       "'\\boxed{X}', 'The answer is N'), e.g. %s; with label.labeler: verifiable the label stage "
                       "will fail on them", len(unreadable), [str(a)[:60] for a in unreadable[:3]])
    return StageResult(metrics=metrics, tables=paths)


@gpu_task("generate-samples")
def generate_task(cfg: Config) -> StageResult:
    """Sample N responses per training prompt from the policy with the configured engine, batch by batch: each
    batch's rows go to a shard as soon as it is done, and a re-run after a crash samples only the batches missing
    (:mod:`foresight.shards`); the shards become the samples table at the end."""
    import torch

    from foresight.shards import ShardStore, shard_folder
    from models.engine.config import Sampling
    from models.engine.generation import chat_prompts, sample_batches

    logger = stage_logger()
    started = time.perf_counter()
    prompts_df = read_prompts(cfg, "train")
    sampling = component(Sampling, cfg.generate)
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
    from models.engine.generation import batch_plan, batch_tokens

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
    from contextlib import nullcontext

    from models.engine.config import PolicySpec
    from models.engine.generation import HFSampler

    if sampling.engine == "hf":
        policy = load_stage_policy(cfg, "base")
        return nullcontext(HFSampler(policy, sampling)), policy.tokenizer, policy.device
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from models.engine.generation import generation_end_token_ids
    from models.engine.policy import policy_path, resolve_device
    from models.engine.vllm_sampling import VLLMSampler

    path = policy_path(cfg.path(cfg.paths.policy_dir))
    spec = component(PolicySpec, cfg.policy)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's end tokens
        generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    eos = generation_end_token_ids(generation_config, tokenizer)
    sampler = VLLMSampler(sampling.vllm_python, path, spec, sampling, tokenizer, eos, sampling.tensor_parallel_size,
                          logger)
    return sampler, tokenizer, resolve_device(spec.device)


def _policy_manifest(cfg: Config) -> str:
    """The prepared policy's manifest (which model, which revision), or "" before it exists."""
    from models.engine.policy import MANIFEST

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


@gpu_task("label-samples")
def label_task(cfg: Config) -> StageResult:
    """Score every sample with the configured labeler (batched, with a progress bar and artifact); record
    correctness wherever a reference answer is known, and count the references no answer can be read from."""
    from models.labeling.answers import extract_answer, is_correct, unreadable_references
    from models.labeling.config import LabelerSpec
    from models.labeling.labelers import ArmoRMLabeler, build_labeler

    logger = get_run_logger()
    started = time.perf_counter()
    samples = read_table(cfg.path(cfg.paths.samples), "samples")
    if samples.empty:
        raise ValueError(f"{cfg.path(cfg.paths.samples)} has no rows: nothing to label")
    answers = reference_answers(samples)
    references = samples.drop_duplicates("prompt_id")["answer"].dropna()
    unreadable = len(unreadable_references(references))
    if unreadable:
        logger.warning("%d of %d reference answers cannot be read (no number, '#### X', '\\boxed{X}' or 'The "
                       "answer is N'): their samples get no correctness", unreadable, len(references))
    labeler = build_labeler(component(LabelerSpec, cfg.label))
    logger.info("labeling %d samples with '%s' (batches of %d)", len(samples), labeler.name, cfg.label.batch_size)

    progress = progress_artifact(key="label-progress", description="Samples scored")
    bar = tqdm(total=len(samples), desc="label", unit="sample")

    def on_batch(done: int, total: int) -> None:
        bar.update(done - bar.n)
        progress(100.0 * done / total)

    questions, responses = samples["question"].tolist(), samples["response"].tolist()
    cut = (samples["finish_reason"] == "length").tolist()  # credited only for a marked answer (answers.py)
    labeled = samples.copy()
    scoring_started = time.perf_counter()
    if isinstance(labeler, ArmoRMLabeler):  # keep the objective rewards behind ArmoRM's score for reports
        labeled["score"], objectives = labeler.score_objectives(questions, responses, on_batch)
    else:
        labeled["score"], objectives = labeler.score(questions, responses, answers, on_batch, truncated=cut), None
    scoring_seconds = time.perf_counter() - scoring_started
    bar.close()
    labeled["correct"] = pd.array([is_correct(r, a, c) for r, a, c in zip(responses, answers, cut)], dtype="boolean")
    labeled["extracted_answer"] = [extract_answer(r, c) for r, c in zip(responses, cut)]
    labeled["labeler"] = labeler.name
    table = labeled[SCORE_COLUMNS].copy()
    if objectives is not None:
        table["objective_rewards"] = objectives
    out = write_table(table, cfg.path(cfg.paths.scores))
    if labeler.truncated_responses:
        logger.warning("%d of %d responses were cut to fit label.max_length = %d tokens (the prompt and the end of "
                       "turn kept): their scores judge a response's beginning", labeler.truncated_responses,
                       len(labeled), cfg.label.max_length)
    metrics = {"num_scored": len(labeled), "mean_reward": float(labeled["score"].mean()),
               "unparseable_references": unreadable, "truncated_responses": labeler.truncated_responses,
               "seconds_per_1k_samples": 1000 * scoring_seconds / len(labeled),
               "wall_seconds": time.perf_counter() - started}
    known = labeled["correct"].dropna()
    if len(known):
        metrics["sample_accuracy"] = float(known.astype(float).mean())
    return StageResult(metrics=metrics, tables={"scores": out})


@task(name="validate-and-pair", cache_policy=NO_CACHE)
def validate_task(cfg: Config) -> StageResult:
    """Run the GX suites on samples and scores, build preference pairs, validate them, then write them.

    A failed suite raises before the pairs file is replaced, so downstream stages never see bad data.
    """
    from foresight.validation import pairs_suite, samples_suite, scores_suite, validate_tables
    from models.labeling.config import LabelerSpec

    logger = get_run_logger()
    started = time.perf_counter()
    samples = read_table(cfg.path(cfg.paths.samples), "samples")
    scores = read_table(cfg.path(cfg.paths.scores), "scores")
    pairs, pair_stats = make_pairs(scores, cfg.validate_.min_score_gap, cfg.validate_.pairing,
                                   cfg.validate_.max_pairs_per_prompt)
    docs_dir = cfg.path(cfg.paths.reports_dir) / "datadocs"
    summary = validate_tables(
        {
            "samples": (samples, samples_suite(cfg.validate_, cfg.generate.max_new_tokens)),
            "scores": (scores, scores_suite(cfg.validate_, component(LabelerSpec, cfg.label))),
            "pairs": (pairs, pairs_suite(cfg.validate_)),
        },
        docs_dir,
    )
    out = write_table(pairs, cfg.path(cfg.paths.pairs))
    logger.info("validation passed; %d pairs (%s, %d before validate.max_pairs_per_prompt) from %d prompts (Data "
                "Docs: %s)", pair_stats["num_pairs"], cfg.validate_.pairing, pair_stats["num_pairs_uncapped"],
                pair_stats["num_prompts"], summary["docs_index"])
    metrics = dict(pair_stats)
    for name, suite in summary["suites"].items():
        metrics[f"{name}_expectations_passed"] = suite["successful"]
    metrics["wall_seconds"] = time.perf_counter() - started
    return StageResult(metrics=metrics, tables={"pairs": out}, artifacts={"datadocs": docs_dir})
