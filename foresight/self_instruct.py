"""Instructions the policy writes itself, for the distillation data (Self-Instruct: Wang et al., ACL 2023,
"Self-Instruct: Aligning Language Models with Self-Generated Instructions", §2.2).

A drafter learns to predict the policy's answers, so what the distillation prompts need is variety, not quality: the
hand-written general set's 112 training instructions give the drafters too few open-ended responses (docs/mtp.md).
As in Self-Instruct's instruction generation (§2.2, "Instruction Generation"), the policy is shown a few instructions
drawn at random from a pool — here only the general set's training part, never its held-out part, which the
benchmarks decode — and asked for a new one; its samples are filtered as §2.2's "Filtering and Postprocessing" does:
one line, bounded length, no duplicate and no near-duplicate of an instruction already in the pool. Self-Instruct
measures overlap by ROUGE-L > 0.7; here a word-set Jaccard similarity (:func:`overlap`), as cheap and as blunt, with
the held-out instructions in the pool too, so no generated instruction restates a benchmark prompt.

Sampling is Hugging Face ``generate`` through :func:`models.engine.decoding.hf_decode` (round ``r`` seeded with
``seed + r``), so the instructions are a function of the policy, the knobs and the seed.
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Iterable, Sequence

import pandas as pd

from foresight.params import SelfInstructConfig
from foresight.prompts import stable_id
from models.engine.decoding import hf_decode
from models.engine.generation import chat_prompts, end_token_ids
from models.engine.policy import Policy

SOURCE = "self_instruct"
"""``source`` and ``category`` of a generated instruction, and the prefix of its ``prompt_id``."""
MAX_ROUNDS_PER_BATCH = 4
"""Sampling rounds allowed per batch of instructions asked for: the filter drops some samples, so more rounds than
``ceil(count / batch_size)`` run, but never without end where the policy keeps repeating itself."""

logger = logging.getLogger(__name__)

_NUMBERING = re.compile(r"^\s*(?:\d+\s*[.):]|[-*•]|task\s*\d*\s*:|instruction\s*\d*\s*:)\s*", re.IGNORECASE)


def generator_prompt(examples: Sequence[str]) -> str:
    """The user turn that asks for one new instruction after ``examples`` (§2.2: in-context seed tasks, numbered)."""
    listed = "\n".join(f"{i}. {text}" for i, text in enumerate(examples, start=1))
    return (f"Here are {len(examples)} example requests a user might send to an assistant:\n{listed}\n"
            "Write one new request on a different topic. Reply with the request only, on one line.")


def normalise(text: str) -> str:
    """Lower case, words only: the form two instructions are compared in."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def overlap(a: str, b: str) -> float:
    """Word-set Jaccard similarity of two normalised instructions (0 when both are empty)."""
    words_a, words_b = set(a.split()), set(b.split())
    union = words_a | words_b
    return len(words_a & words_b) / len(union) if union else 0.0


def clean_instruction(text: str) -> str:
    """A sampled reply as an instruction: its first non-empty line, without list numbering or quotes around it."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return _NUMBERING.sub("", line).strip().strip('"“”').strip()


def filter_instructions(candidates: Iterable[str], pool: Iterable[str], held_out: Iterable[str], count: int,
                        token_count, min_tokens: int, max_tokens: int, max_overlap: float) -> list[str]:
    """Up to ``count`` of ``candidates`` (cleaned: :func:`clean_instruction`), in order, each kept where it is
    ``min_tokens``…``max_tokens`` tokens long (``token_count``), does not end in a colon, is not the same as any
    instruction of ``pool`` (the training seeds and those kept so far) or ``held_out`` once normalised
    (:func:`normalise`), and whose word overlap (:func:`overlap`) with each of them stays below ``max_overlap``
    (Self-Instruct §2.2: ROUGE-L < 0.7)."""
    seen = [normalise(text) for text in (*pool, *held_out)]
    kept = []
    for candidate in candidates:
        if len(kept) == count:
            break
        text = clean_instruction(candidate)
        # a line ending in a colon announces what follows ("Here is a new request:"), it asks nothing
        if text.endswith(":") or not min_tokens <= token_count(text) <= max_tokens:
            continue
        key = normalise(text)
        if not key or any(key == other or overlap(key, other) >= max_overlap for other in seen):
            continue
        kept.append(text)
        seen.append(key)
    return kept


def self_instruct_prompts(policy: Policy, seeds: pd.DataFrame, held_out: pd.DataFrame, count: int,
                          cfg: SelfInstructConfig, system_prompt: str | None = None) -> pd.DataFrame:
    """``count`` new instructions written by ``policy`` (fewer, with a warning, where rounds run out), in the general
    set's schema (:func:`foresight.prompts.general_instructions`: ``prompt_id``, ``question``, ``answer`` None,
    ``source`` and ``category`` :data:`SOURCE`). Each round samples ``cfg.batch_size`` replies, each to its own
    prompt of ``cfg.shots`` instructions drawn from ``seeds`` (the general set's training part); the replies are
    filtered against ``seeds``, ``held_out`` and those kept before (:func:`filter_instructions`)."""
    if count == 0:
        return pd.DataFrame({"prompt_id": [], "question": [], "answer": None, "source": SOURCE, "category": SOURCE})
    pool = seeds["question"].tolist()
    if len(pool) < cfg.shots:
        raise ValueError(f"self-instruct needs {cfg.shots} seed instructions per prompt (distill.self_instruct.shots),"
                         f" the pool holds {len(pool)}")
    tok, eos = policy.tokenizer, end_token_ids(policy)
    rng = random.Random(cfg.seed)
    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    token_count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    kept: list[str] = []
    rounds = MAX_ROUNDS_PER_BATCH * math.ceil(count / cfg.batch_size)
    for r in range(rounds):
        asked = [generator_prompt(rng.sample(pool, cfg.shots)) for _ in range(cfg.batch_size)]
        prompt_ids = [tok(text, add_special_tokens=False)["input_ids"]
                      for text in chat_prompts(tok, asked, system_prompt)]
        # one more token than an instruction may hold: a reply cut at the limit is over it and dropped
        replies = hf_decode(policy, prompt_ids, sampling, cfg.max_tokens + 1, eos, cfg.batch_size, seed=cfg.seed + r)
        texts = [tok.decode(reply, skip_special_tokens=True) for reply in replies]
        kept += filter_instructions(texts, pool + kept, held_out["question"], count - len(kept), token_count,
                                    cfg.min_tokens, cfg.max_tokens, cfg.max_overlap)
        logger.info("self-instruct round %d: %d of %d instructions", r + 1, len(kept), count)
        if len(kept) == count:
            break
    else:
        logger.warning("self-instruct: %d rounds of %d samples gave %d of the %d instructions asked for (the rest "
                       "were duplicates, near-duplicates or out of the length bounds)", rounds, cfg.batch_size,
                       len(kept), count)
    return pd.DataFrame({"prompt_id": [stable_id(SOURCE, text) for text in kept], "question": kept, "answer": None,
                         "source": SOURCE, "category": SOURCE})
