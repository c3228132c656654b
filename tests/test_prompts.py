"""Prompt sources: arithmetic, local files (jsonl/parquet/csv), HF datasets; deterministic splits."""

import json
import re

import pandas as pd
import pytest

from foresight.config import parse_config
from foresight.params import ArithmeticConfig
from foresight.prompts import PromptSourceError, arithmetic_prompts, further_prompts, load_prompts

INSTRUCTION = "End your answer with 'The answer is <number>.'"


def _prompts_cfg(**prompts):
    return parse_config({"prompts": prompts}).prompts


def _evaluate(question: str) -> int:
    """Recompute a word problem's answer from its text (independent of the generator)."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if "more" in question and "Then" not in question:
        return numbers[0] + numbers[1]
    if "gives" in question and "Then" not in question:
        return numbers[0] - numbers[1]
    if "bags" in question:
        return numbers[0] * numbers[1]
    value = numbers[0]
    for step, n in zip(re.findall(r"Then [^.]*\.", question), numbers[1:]):
        value = value + n if "finds" in step else value - n if "away" in step else value * n
    return value


def test_arithmetic_answers_are_right_and_in_range():
    df = arithmetic_prompts(ArithmeticConfig(), 200, seed=3)
    assert len(df) == 200 and df["question"].is_unique
    for q, a in zip(df["question"], df["answer"]):
        assert _evaluate(q) == int(a), q
        assert int(a) >= 0
        assert all(1 <= int(n) <= 10 for n in re.findall(r"\d+", q))


def test_arithmetic_multi_step_and_knobs():
    cfg = ArithmeticConfig(max_number=5, operations=["+", "-"], num_operations=3)
    df = arithmetic_prompts(cfg, 50, seed=1)
    for q, a in zip(df["question"], df["answer"]):
        assert q.count("Then") == 3 and _evaluate(q) == int(a) and int(a) >= 0
        assert "multiplied" not in q


def test_arithmetic_too_many_requested_fails_clearly():
    with pytest.raises(PromptSourceError, match="distinct arithmetic problems"):
        arithmetic_prompts(ArithmeticConfig(max_number=1, operations=["+"]), 2000, seed=0)  # 132 name pairs × 8 items exist


def test_splits_are_deterministic_and_disjoint(tmp_path):
    cfg = _prompts_cfg(num_train=30, num_eval=10, seed=5)
    train, held_out = load_prompts(cfg, tmp_path)
    train2, held_out2 = load_prompts(cfg, tmp_path)
    pd.testing.assert_frame_equal(train, train2)
    pd.testing.assert_frame_equal(held_out, held_out2)
    assert (len(train), len(held_out)) == (30, 10)
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])
    assert train["question"].str.endswith(INSTRUCTION).all()
    other, _ = load_prompts(_prompts_cfg(num_train=30, num_eval=10, seed=6), tmp_path)
    assert list(other["prompt_id"]) != list(train["prompt_id"])


def test_further_prompts_are_new_the_same_each_time_and_come_from_the_source(tmp_path):
    cfg = _prompts_cfg(num_train=30, num_eval=10, seed=5)
    train, held_out = load_prompts(cfg, tmp_path)
    taken = pd.concat([train, held_out])
    further = further_prompts(cfg, tmp_path, 50, taken)
    assert len(further) == 50 and further["prompt_id"].is_unique
    assert not set(further["prompt_id"]) & set(taken["prompt_id"])
    pd.testing.assert_frame_equal(further, further_prompts(cfg, tmp_path, 50, taken))
    assert further["question"].str.endswith(INSTRUCTION).all()
    for question, answer in zip(further["question"], further["answer"], strict=True):
        assert _evaluate(question.removesuffix(f" {INSTRUCTION}")) == int(answer)

    # a file gives the rows the split left unused, and no more than it has
    path = tmp_path / "prompts.jsonl"
    pd.DataFrame({"prompt": [f"Question {i}?" for i in range(12)]}).to_json(path, orient="records", lines=True)
    cfg = _prompts_cfg(source="file", num_train=5, num_eval=3, file={"path": path.name})
    train, held_out = load_prompts(cfg, tmp_path)
    further = further_prompts(cfg, tmp_path, 10, pd.concat([train, held_out]))
    assert sorted(pd.concat([train, held_out, further])["question"]) == sorted(f"Question {i}?" for i in range(12))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_file_source(tmp_path, fmt):
    df = pd.DataFrame({"text": [f"What is {i} + {i}?" for i in range(8)], "gold": [str(2 * i) for i in range(8)]})
    path = tmp_path / f"prompts.{fmt}"
    {"jsonl": lambda: df.to_json(path, orient="records", lines=True), "parquet": lambda: df.to_parquet(path),
     "csv": lambda: df.to_csv(path, index=False)}[fmt]()
    cfg = _prompts_cfg(source="file", num_train=5, num_eval=2,
                       file={"path": path.name, "text_column": "text", "answer_column": "gold"})
    train, held_out = load_prompts(cfg, tmp_path)
    assert (len(train), len(held_out)) == (5, 2)
    both = pd.concat([train, held_out])
    assert set(both["question"]) <= {f"{text} {INSTRUCTION}" for text in df["text"]}  # rows with an answer get it
    for q, a in zip(both["question"], both["answer"]):
        assert str(2 * int(q.split()[2])) == a


def test_instruction_goes_to_prompts_with_a_reference_only_and_null_means_none(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": f"Question {i}?", "answer": f"Worked out.\n#### {i}" if i % 2 else None} for i in range(8)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    source = {"path": str(path), "answer_column": "answer"}
    train, held_out = load_prompts(_prompts_cfg(source="file", num_train=6, num_eval=2, file=source), tmp_path)
    both = pd.concat([train, held_out])
    with_answer = both["answer"].notna()
    assert with_answer.any() and (~with_answer).any()
    assert both.loc[with_answer, "question"].str.endswith(f"? {INSTRUCTION}").all()
    assert both.loc[~with_answer, "question"].str.endswith("?").all()  # open prompts (UltraFeedback) stay as written

    cfg = parse_config({"prompts": {"source": "file", "num_train": 6, "num_eval": 2, "instruction": None,
                                    "file": source}}).prompts
    assert cfg.instruction is None
    train, held_out = load_prompts(cfg, tmp_path)
    assert sorted(pd.concat([train, held_out])["question"]) == sorted(r["prompt"] for r in rows)


def test_list_valued_column_uses_first_turn_and_says_so(tmp_path, caplog):
    """MT-Bench style ``turns``: each row keeps its first turn; the rows that held more are counted (for
    prepare_prompts' ``multi_turn_prompts`` metric) and a warning names the file, the column and the count."""
    path = tmp_path / "mtbench.jsonl"
    rows = [{"question_id": i, "turns": [f"First turn {i}", "Follow-up"] if i < 3 else [f"First turn {i}"]}
            for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = _prompts_cfg(source="file", num_train=4, num_eval=1, file={"path": str(path), "text_column": "turns"})
    counts = {}
    with caplog.at_level("WARNING", logger="foresight.prompts"):
        train, held_out = load_prompts(cfg, tmp_path, counts)
    assert sorted(pd.concat([train, held_out])["question"]) == [f"First turn {i}" for i in range(5)]
    assert train["answer"].isna().all()
    assert counts == {"multi_turn_prompts": 3}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(path) in warning and "3 of 5 rows" in warning and "'turns'" in warning and "dropped" in warning

    single = tmp_path / "single.jsonl"
    single.write_text("\n".join(json.dumps({"prompt": f"q{i}"}) for i in range(4)))
    counts = {}
    load_prompts(_prompts_cfg(source="file", num_train=3, num_eval=1, file={"path": str(single)}), tmp_path, counts)
    assert counts == {"multi_turn_prompts": 0}


@pytest.mark.parametrize(("suffix", "text", "column"), [
    (".jsonl", '{"prompt": "ok"}\n{"prompt": "caf\u00e9 ok"}\n{"prompt": "na\u00efve"}\n', 16),
    (".csv", "prompt\ncaf\u00e9 ok\nna\u00efve\n", 4),
])
def test_a_file_not_in_utf8_names_its_line_and_byte_and_the_fix(tmp_path, suffix, text, column):
    """A Latin-1 file fails before ``datasets`` reads it (whose pyarrow error names neither file nor line), at the
    first byte that is not UTF-8 (line 2, the "é"), with the iconv command that converts it."""
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(PromptSourceError) as err:
        load_prompts(_prompts_cfg(source="file", num_train=1, num_eval=1, file={"path": str(path)}), tmp_path)
    message = str(err.value)
    assert str(path) in message and f"line 2, byte {column} " in message and "0xe9" in message
    assert f"iconv -f latin1 -t utf-8 {path}" in message


def test_utf8_check_streams_and_finds_the_same_byte_at_any_chunk_size(tmp_path):
    """The check reads in chunks: a valid multi-byte character split between chunks passes, and the bad byte's
    line and column do not depend on where the chunks end."""
    from foresight.prompts import check_utf8

    path = tmp_path / "mixed.jsonl"
    valid = '{"prompt": "caf\u00e9 \u20ac \U0001f600"}\n'.encode()
    path.write_bytes(valid * 3)
    for size in (1, 2, 3, 5, 1 << 20):
        check_utf8(path, size)
    path.write_bytes(valid * 2 + b'{"prompt": "x\xe9"}\n')
    for size in (1, 2, 3, 5, 1 << 20):
        with pytest.raises(PromptSourceError, match=r"line 3, byte 14 "):
            check_utf8(path, size)


def test_file_errors_are_clear(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PromptSourceError, match="is empty"):
        load_prompts(_prompts_cfg(source="file", file={"path": str(empty)}), tmp_path)

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "hi"}\n{"question": "there"}\n')
    with pytest.raises(PromptSourceError, match=r"no column 'prompt'.*question"):
        load_prompts(_prompts_cfg(source="file", file={"path": str(wrong)}), tmp_path)

    with pytest.raises(PromptSourceError, match="not found"):
        load_prompts(_prompts_cfg(source="file", file={"path": "nope.jsonl"}), tmp_path)

    few = tmp_path / "few.jsonl"
    few.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(PromptSourceError, match="not enough for num_eval=5"):
        load_prompts(_prompts_cfg(source="file", num_eval=5, file={"path": str(few)}), tmp_path)


def test_hf_dataset_source_reads_a_local_dataset(tmp_path):
    import datasets

    folder = tmp_path / "gsm"
    datasets.Dataset.from_dict({"question": [f"q{i}?" for i in range(6)], "answer": [str(i) for i in range(6)]}) \
        .to_parquet(str(folder / "train.parquet"))
    cfg = _prompts_cfg(source="dataset", num_train=4, num_eval=2,
                       dataset={"name": str(folder), "split": "train", "text_column": "question",
                                "answer_column": "answer"})
    train, held_out = load_prompts(cfg, tmp_path)
    assert (len(train), len(held_out)) == (4, 2) and set(train["source"]) == {"dataset"}


def test_hf_dataset_offline_and_absent_is_a_clear_error(tmp_path):
    cfg = _prompts_cfg(source="dataset", dataset={"name": "nobody/no-such-dataset-xyz"})
    with pytest.raises(PromptSourceError, match="could not be loaded.*Offline"):
        load_prompts(cfg, tmp_path)


def test_general_instruction_set_split_is_fixed_disjoint_and_varied():
    from foresight.prompts import GENERAL_HELD_OUT, GENERAL_INSTRUCTIONS, general_instructions

    rows = [json.loads(line) for line in GENERAL_INSTRUCTIONS.read_text().splitlines()]
    texts = [r["prompt"] for r in rows]
    assert len(texts) >= 150 and len(set(texts)) == len(texts) and all(t.strip() for t in texts)
    train, held_out = general_instructions("train"), general_instructions("eval")
    assert (len(train), len(held_out)) == (len(texts) - GENERAL_HELD_OUT, GENERAL_HELD_OUT)
    assert sorted([*train["question"], *held_out["question"]]) == sorted(texts)  # a partition of the file
    assert not set(train["prompt_id"]) & set(held_out["prompt_id"])
    assert (train["source"] == "general").all() and held_out["answer"].isna().all()
    # fixed: the same split on every call, and a shuffle (not the file's first rows, which are all "writing")
    pd.testing.assert_frame_equal(general_instructions("eval"), held_out)
    assert held_out["question"].tolist() != texts[-GENERAL_HELD_OUT:]
    categories = {r["category"] for r in rows}
    assert len(categories) >= 6 and set(train["category"]) == set(held_out["category"]) == categories
    assert general_instructions("train", 5).equals(train.head(5))


def test_general_instruction_set_errors_are_clear(tmp_path):
    from foresight.prompts import general_instructions

    with pytest.raises(PromptSourceError, match="holds 48"):
        general_instructions("eval", 49)
    with pytest.raises(PromptSourceError, match="general instruction set .* is missing"):
        general_instructions("train", path=tmp_path / "gone.jsonl")
    with pytest.raises(ValueError, match="'train' and 'eval'"):
        general_instructions("test")


def test_general_instruction_set_is_package_data():
    """A non-editable install keeps only the data files pyproject declares: the set must match one of them."""
    import tomllib
    from pathlib import Path, PurePosixPath

    from foresight.prompts import GENERAL_INSTRUCTIONS

    root = Path(__file__).resolve().parent.parent
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["foresight"]
    relative = PurePosixPath(GENERAL_INSTRUCTIONS.relative_to(root / "foresight").as_posix())
    assert any(relative.match(pattern) for pattern in declared), (relative, declared)
