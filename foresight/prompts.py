"""Prompt sources and deterministic train / held-out splits.

Three sources, one output schema (``prompt_id``, ``question``, ``answer``, ``source``):

- ``arithmetic``: seeded word problems with known answers. SmolLM2-135M measured ≈37 % greedy / ≈18 %
  sampled on one-operation problems with numbers ≤ 10, so most prompts get both right
  and wrong samples: real preference pairs with room to improve (docs/pipeline.md#arithmetic-prompts).
- ``dataset``: any Hugging Face dataset through ``datasets.load_dataset`` (UltraFeedback, GSM8K, ...).
- ``file``: a local jsonl / parquet / csv file, also read through ``datasets``.

Besides the task prompts, the project ships a general instruction set (:func:`general_instructions`): hand-written
writing, summarising, explaining, reasoning, coding, planning, advice and rewriting requests, with a fixed
train / held-out split. The speculative decoders' drafters learn from the policy's responses to its training part
and are benchmarked on its held-out part, so their speed is measured on open-ended text, not only on the task's.

The chat template is applied later, by the policy's tokenizer (:func:`models.engine.generation.chat_prompts`),
because it belongs to the model, not to the prompt. Its length is checked here, though: a prompt longer than
``prompts.max_prompt_tokens`` in that template (:func:`prompt_token_counts`; automatic: the policy's context minus
the response budget, :func:`resolve_max_prompt_tokens`) is dropped from the splits (:func:`drop_long_prompts`).
Such a prompt would overflow Llama-3's 8,192-token context during generation (8,192 − 512 new tokens = 7,680), and
one over ArmoRM's ``label.max_length`` would leave its response no room in the label stage.
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path
from typing import Literal

import pandas as pd

from foresight.params import ArithmeticConfig, DatasetSourceConfig, FileSourceConfig, PromptsConfig
from foresight.prompt_limits import PromptSourceError

PROMPT_COLUMNS = ["prompt_id", "question", "answer", "source"]

logger = logging.getLogger(__name__)

GENERAL_INSTRUCTIONS = Path(__file__).parent / "instructions" / "general.jsonl"
"""The general instruction set: one ``{"prompt": ..., "category": ...}`` per line, no reference answers (package
data: installed with the ``foresight`` package)."""
GENERAL_HELD_OUT = 48
"""Instructions of the general set held out from every training stage: the last ones of its seeded permutation."""
GENERAL_SPLIT_SEED = 0

_NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Lena", "Omar"]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells"]

# One-step problems: one sentence per operation, phrased the way grade-school problems are.
_SINGLE = {
    "+": "{name} has {a} {item}. {friend} gives {name} {b} more {item}. How many {item} does {name} have now?",
    "-": "{name} has {a} {item} and gives {b} of them to {friend}. How many {item} does {name} have left?",
    "*": "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in total?",
}
# Multi-step problems: a running count changed step by step, evaluated left to right.
_STEP = {
    "+": "Then {name} finds {b} more.",
    "-": "Then {name} gives {b} away.",
    "*": "Then the number of {item} is multiplied by {b}.",
}


def _apply(op: str, x: int, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def arithmetic_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, int]:
    """One word problem and its answer, drawn from ``rng``."""
    name, friend = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    start = value = rng.randint(1, cfg.max_number)
    ops = [rng.choice(cfg.operations) for _ in range(cfg.num_operations)]
    operands = []
    for op in ops:
        b = rng.randint(1, cfg.max_number)
        if op == "-" and not cfg.allow_negative and b > value:
            if len(ops) == 1:  # a single subtraction is reordered: the larger number comes first
                start, b = b, start
                value = start
            else:
                b = rng.randint(0, value)
        operands.append(b)
        value = _apply(op, value, b)
    if len(ops) == 1:
        text = _SINGLE[ops[0]].format(name=name, friend=friend, item=item, a=start, b=operands[0])
    else:
        steps = " ".join(_STEP[op].format(name=name, item=item, b=b) for op, b in zip(ops, operands))
        text = f"{name} has {start} {item}. {steps} How many {item} does {name} have now?"
    return text, value


def arithmetic_prompts(cfg: ArithmeticConfig, count: int, seed: int) -> pd.DataFrame:
    """``count`` distinct problems (deduplicated by text), reproducible from ``seed``."""
    rng = random.Random(seed)
    rows: dict[str, int] = {}
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise PromptSourceError(
                f"could only make {len(rows)} distinct arithmetic problems of {count} requested: "
                "raise prompts.arithmetic.max_number or lower prompts.num_train/num_eval"
            )
        text, answer = arithmetic_problem(rng, cfg)
        rows.setdefault(text, answer)
    return pd.DataFrame({"question": list(rows), "answer": [str(a) for a in rows.values()]})


def _first_turn(value) -> tuple[object, bool]:
    """A text cell's prompt and whether it held several turns. MT-Bench style ``turns`` columns hold a list of
    user turns; only the first can be a one-shot prompt: each later turn is asked after the model's own answer to
    the ones before it, which a single prompt cannot hold."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and not isinstance(value, str)):
        value = list(value)
        return (value[0] if value else None), len(value) > 1
    return value, False


def _table_from_dataset(ds, text_column: str, answer_column: str | None, where: str) -> tuple[pd.DataFrame, int]:
    """The source's rows in the prompt schema (empty texts dropped) and how many held several turns, of which
    the first is kept and the rest dropped (:func:`_first_turn`), with a warning naming the source and column."""
    if len(ds) == 0:
        raise PromptSourceError(f"{where} is empty: no prompts to read")
    missing = [c for c in (text_column, answer_column) if c and c not in ds.column_names]
    if missing:
        raise PromptSourceError(
            f"{where} has no column {', '.join(repr(c) for c in missing)}; its columns are: "
            f"{', '.join(ds.column_names)} (set text_column / answer_column in params.yaml)"
        )
    firsts = [_first_turn(v) for v in ds[text_column]]
    multi_turn = sum(several for _, several in firsts)
    if multi_turn:
        logger.warning("%s: %d of %d rows of column %r hold several turns; each keeps its first turn only (a later "
                       "turn follows the model's own answer to the earlier ones, which a one-shot prompt cannot "
                       "give) and the later turns are dropped", where, multi_turn, len(firsts), text_column)
    df = pd.DataFrame({"question": [first for first, _ in firsts]})
    df["answer"] = [None if v is None else str(v) for v in ds[answer_column]] if answer_column else None
    df = df[df["question"].map(lambda q: isinstance(q, str) and q.strip() != "")]
    if df.empty:
        raise PromptSourceError(f"{where}: column {text_column!r} has no non-empty text")
    return df.reset_index(drop=True), multi_turn


def check_utf8(path: Path, chunk_bytes: int = 1 << 20) -> None:
    """Raise :class:`PromptSourceError` at the first byte of ``path`` that is not UTF-8, naming its line (1-based),
    its byte column in that line (1-based) and how to convert the file. Read in chunks of ``chunk_bytes`` (a
    multi-gigabyte file, or a one-line .json, is never held whole); a character split between two chunks is carried
    over to the next. A leading byte-order mark is valid UTF-8 and passes."""
    lines, line_start, base, carry = 1, 0, 0, b""  # line_start, base: absolute byte offsets
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            data, carry = carry + chunk, b""
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                if err.reason != "unexpected end of data" or err.end != len(data):
                    lines += data.count(b"\n", 0, err.start)
                    newline = data.rfind(b"\n", 0, err.start)
                    line_start = base + newline + 1 if newline >= 0 else line_start
                    raise PromptSourceError(
                        f"prompt file {path} is not UTF-8: line {lines}, byte {base + err.start - line_start + 1} of "
                        f"that line is 0x{data[err.start]:02x} ({err.reason}). It was probably saved as Latin-1 or "
                        f"Windows-1252: convert it, e.g. `iconv -f latin1 -t utf-8 {path} > {path}.utf8` (and point "
                        "prompts.file.path at the new file), or re-save it as UTF-8") from err
                data, carry = data[: err.start], data[err.start :]  # a character cut by the chunk's end
            lines += data.count(b"\n")
            if (newline := data.rfind(b"\n")) >= 0:
                line_start = base + newline + 1
            base += len(data)
    if carry:
        raise PromptSourceError(f"prompt file {path} is not UTF-8: it ends inside a multi-byte character (line "
                                f"{lines}, byte {base - line_start + 1}); re-save it as UTF-8")


def file_prompts(cfg: FileSourceConfig, root: Path) -> pd.DataFrame:
    """Read a local jsonl / parquet / csv file through ``datasets``: its rows in the prompt schema. A text file
    (.jsonl / .json / .csv) must be UTF-8 (:func:`check_utf8`); a list-valued text column keeps its first turn
    (:func:`_table_from_dataset`)."""
    return _file_table(cfg, root)[0]


def _file_table(cfg: FileSourceConfig, root: Path) -> tuple[pd.DataFrame, int]:
    import datasets

    path = cfg.path if cfg.path.is_absolute() else root / cfg.path
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
    if builder is None:
        raise PromptSourceError(f"prompt file {path}: unsupported extension (use .jsonl, .parquet or .csv)")
    if not path.is_file():
        raise PromptSourceError(f"prompt file not found: {path}")
    if path.stat().st_size == 0:
        raise PromptSourceError(f"prompt file {path} is empty: no prompts to read")
    if builder != "parquet":  # text formats: pyarrow's decode error names neither the file nor the line
        check_utf8(path)
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # datasets raises several types for unreadable files (a parquet's bad UTF-8 too)
        raise PromptSourceError(f"prompt file {path} could not be read as {builder}: {err}") from err
    return _table_from_dataset(ds, cfg.text_column, cfg.answer_column, f"prompt file {path}")


def dataset_prompts(cfg: DatasetSourceConfig) -> pd.DataFrame:
    """Read prompts from a Hugging Face dataset (hub or local cache); a list-valued text column keeps its first
    turn (:func:`_table_from_dataset`)."""
    return _dataset_table(cfg)[0]


def _dataset_table(cfg: DatasetSourceConfig) -> tuple[pd.DataFrame, int]:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.name, cfg.config, split=cfg.split)
    except Exception as err:
        raise PromptSourceError(
            f"dataset {cfg.name!r} (config {cfg.config!r}, split {cfg.split!r}) could not be loaded: {err}. "
            "Offline? Download it once with network access (it is then read from the local cache), "
            "or export it to a jsonl file and use prompts.source: file."
        ) from err
    return _table_from_dataset(ds, cfg.text_column, cfg.answer_column, f"dataset {cfg.name!r}")


def stable_id(source: str, text: str) -> str:
    """A prompt's id: its source and the first 12 hex digits of its text's SHA-1 (the same on every machine)."""
    return f"{source}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def general_instructions(split: Literal["train", "eval"], count: int | None = None,
                         path: Path = GENERAL_INSTRUCTIONS) -> pd.DataFrame:
    """The ``train`` or ``eval`` (held-out) part of the general instruction set — its first ``count`` instructions
    (all when None) — in the prompt schema (no answers, ``source`` = ``general``) plus each one's ``category``.

    The split is fixed: a permutation seeded with :data:`GENERAL_SPLIT_SEED`, the last :data:`GENERAL_HELD_OUT`
    instructions held out, the rest for training (disjoint, and the same on every machine).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"the general instruction set splits into 'train' and 'eval', not {split!r}")
    if not path.is_file():
        raise PromptSourceError(f"the general instruction set {path} is missing: it ships with the foresight package "
                                "(reinstall it with `pip install -e .`)")
    df = pd.read_json(path, lines=True)
    if "prompt" not in df.columns or len(df) <= GENERAL_HELD_OUT:
        raise PromptSourceError(f"{path} must hold more than {GENERAL_HELD_OUT} rows with a 'prompt' field")
    order = random.Random(GENERAL_SPLIT_SEED).sample(range(len(df)), len(df))
    held_out = len(df) - GENERAL_HELD_OUT
    part = df.iloc[order[:held_out] if split == "train" else order[held_out:]].reset_index(drop=True)
    if count is not None and count > len(part):
        raise PromptSourceError(f"{count} instructions asked of the general set's {split} part, which holds "
                                f"{len(part)}")
    part = part.head(count)
    return pd.DataFrame({"prompt_id": [stable_id("general", q) for q in part["prompt"]], "question": part["prompt"],
                         "answer": None, "source": "general", "category": part["category"]})


def load_prompts(cfg: PromptsConfig, root: Path,
                 counts: dict[str, int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Read the configured source and split it deterministically into (train, eval). ``counts``, when given,
    receives ``multi_turn_prompts``: the source's rows whose text held several turns, each cut to its first turn
    (:func:`_first_turn`; 0 for the arithmetic source)."""
    wanted = cfg.num_train + cfg.num_eval
    multi_turn = 0
    if cfg.source == "arithmetic":
        df = arithmetic_prompts(cfg.arithmetic, wanted, cfg.seed)
    elif cfg.source == "dataset":
        df, multi_turn = _dataset_table(cfg.dataset)
    else:
        df, multi_turn = _file_table(cfg.file, root)
    if counts is not None:
        counts["multi_turn_prompts"] = multi_turn
    if cfg.instruction:  # only where a reference answer will be compared with the response's
        with_answer = df["answer"].notna()
        df.loc[with_answer, "question"] = df.loc[with_answer, "question"] + " " + cfg.instruction
    df = df.drop_duplicates("question").reset_index(drop=True)
    df["source"] = cfg.source
    df["prompt_id"] = [stable_id(cfg.source, q) for q in df["question"]]
    # Deterministic split: a seeded permutation, eval first so that adding train prompts keeps eval fixed.
    order = random.Random(cfg.seed).sample(range(len(df)), len(df))
    df = df.iloc[order].reset_index(drop=True)[PROMPT_COLUMNS]
    if len(df) <= cfg.num_eval:
        raise PromptSourceError(
            f"the {cfg.source} source has {len(df)} distinct prompts, not enough for num_eval={cfg.num_eval} "
            "plus at least one training prompt"
        )
    eval_df = df.iloc[: cfg.num_eval].reset_index(drop=True)
    train_df = df.iloc[cfg.num_eval : wanted].reset_index(drop=True)
    return train_df, eval_df


def further_prompts(cfg: PromptsConfig, root: Path, count: int, taken: pd.DataFrame) -> pd.DataFrame:
    """Up to ``count`` prompts of the configured source besides ``taken`` (the training and held-out prompts), for
    a stage that learns from more of the task's prompts than the split holds without touching the held-out ones.
    The arithmetic source makes new problems (the same on every machine); a dataset or file source gives rows the
    split left unused, fewer than ``count`` where it has no more."""
    wider = cfg.model_copy(update={"num_train": len(taken) + count})
    train, held_out = load_prompts(wider, root)
    pool = pd.concat([train, held_out], ignore_index=True)
    return pool[~pool["prompt_id"].isin(set(taken["prompt_id"]))].head(count).reset_index(drop=True)
