"""Prefect task of the ``prepare_prompts`` stage: the deterministic train / held-out prompt splits (docs/pipeline.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from transformers import AutoTokenizer

from foresight.prompt_limits import drop_long_prompts
from foresight.prompts import load_prompts
from foresight.storage import write_table
from models.engine.policy import policy_path
from models.labeling.answers import unreadable_references
from tasks.common import StageResult, prompt_split_path, prompt_token_limit

if TYPE_CHECKING:
    from foresight.config import Config


@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_prompts_task(cfg: Config) -> StageResult:
    """Read the prompt source and write the deterministic train / eval splits without the prompts longer than
    ``prompts.max_prompt_tokens`` in the policy's chat template (:func:`foresight.prompts.drop_long_prompts`; the
    policy's tokenizer and config.json are read, not its weights)."""
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
    paths = {split: prompt_split_path(cfg, split) for split in ("train", "eval")}
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
