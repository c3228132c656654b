"""Reward labelers: the verifiable labeler's errors, native ArmoRM behind the labeler interface (batching, order,
objectives), HF sequence classifiers, remote code only by explicit opt-in, and reward models that fail.

The answer reading itself is tested in tests/test_answers.py, ArmoRM's forward against the published one in
tests/test_armorm.py."""

import pytest
import torch

from foresight.config import parse_config
from models.labeling.config import LabelerSpec
from models.labeling.labelers import LabelerError, build_labeler
from tests.helpers import tiny_params

QUESTIONS = ["Ben has 4 apples. How many?", "What is 2 + 3?", "Ivy has 3 cookies and gives 1 of them to Omar.",
             "Sum 1 and 1"]
RESPONSES = ["The answer is 4.", "5", "Ivy has 3 cookies, she gives 1 away, so 3 - 1 = 2. The answer is 2.", "2"]


def test_verifiable_labeler_reads_worked_solutions():
    labeler = build_labeler(LabelerSpec())
    references = ["Ben has 4.\n#### 4", "\\boxed{5}", "3 - 1 = 2\n#### 2", "2"]
    assert labeler.score(QUESTIONS, RESPONSES, references) == [1.0, 1.0, 1.0, 1.0]
    wrong = ["#### 5", "\\boxed{6}", "#### 3", "3"]
    assert labeler.score(QUESTIONS, RESPONSES, wrong) == [0.0, 0.0, 0.0, 0.0]


def test_verifiable_labeler_credits_a_cut_response_only_for_a_marked_answer():
    """``truncated``: the responses the length limit cut. The verifiable labeler credits those only for a marked
    answer, never for their last number; ended ones as before."""
    labeler = build_labeler(LabelerSpec())
    responses = ["4 + 2 = 6", "4 + 2 = 6", "4 + 2 = 6. The answer is 6. Then 2"]
    assert labeler.score(["q"] * 3, responses, ["6"] * 3, truncated=[False, True, True]) == [1.0, 0.0, 1.0]
    assert labeler.score(["q"] * 3, responses, ["6"] * 3) == [1.0, 1.0, 1.0]  # none cut


def test_verifiable_labeler_refuses_missing_and_unreadable_references():
    labeler = build_labeler(LabelerSpec())
    with pytest.raises(LabelerError, match=r"of 3 rows, 1 have none and 0 have one"):
        labeler.score(["q"] * 3, ["1", "2", "3"], ["1", None, "3"])
    with pytest.raises(LabelerError, match=r"of 3 rows, 0 have none and 2 have one without a number.*'Paris'"):
        labeler.score(["q"] * 3, ["1", "2", "Paris"], ["1", "Paris", "see the solution"])


def test_labeler_reports_progress_per_batch(tiny_armorm):
    seen = []
    labeler = build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_armorm), batch_size=3, device="cpu"))
    labeler.score(QUESTIONS, RESPONSES, [None] * 4, on_batch=lambda done, total: seen.append((done, total)))
    assert seen == [(3, 4), (4, 4)]
    seen.clear()
    build_labeler(LabelerSpec()).score(["q"], ["1"], ["1"], on_batch=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]


def test_armorm_labeler_scores_are_the_native_models_in_the_rows_order(tiny_armorm):
    """Rows are batched by length and put back: each score is that row's own, as scored alone by the model."""
    from models.labeling.armorm import encode_conversations

    # float32: batching by length changes bf16 rounding; what is tested is that each row gets its own score back
    cfg = LabelerSpec(labeler="armorm", model=str(tiny_armorm), batch_size=3, device="cpu", dtype="float32")
    labeler = build_labeler(cfg)
    assert type(labeler.model).__module__ == "models.labeling.armorm"  # native, no remote code
    scores, objectives = labeler.score_objectives(QUESTIONS, RESPONSES)
    assert labeler.score(QUESTIONS, RESPONSES, [None] * 4) == scores
    for question, response, score, rewards in zip(QUESTIONS, RESPONSES, scores, objectives):
        enc, _ = encode_conversations(labeler.tokenizer, [question], [response], cfg.max_length, labeler.pattern)
        with torch.no_grad():
            alone = labeler.model(**enc)
        assert score == pytest.approx(alone.score.item(), abs=1e-5)
        assert rewards == pytest.approx(alone.rewards[0].tolist(), abs=1e-5)
    assert len(set(scores)) == 4 and len(objectives[0]) == labeler.model.regression_layer.out_features
    # a batch of one gives the same scores
    assert build_labeler(cfg.model_copy(update={"batch_size": 1})).score(QUESTIONS, RESPONSES, [None] * 4) == pytest.approx(
        scores, abs=1e-5)


def test_armorm_labeler_refuses_a_plain_classifier_folder(tiny_classifier):
    with pytest.raises(LabelerError, match="not an ArmoRM-layout checkpoint.*hf-classifier"):
        build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_classifier), device="cpu"))


def test_armorm_labeler_names_truncated_rows(tiny_armorm):
    labeler = build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_armorm), max_length=16, device="cpu"))
    with pytest.raises(LabelerError, match=r"failed on rows .*label.max_length"):
        labeler.score([QUESTIONS[2] * 3], ["ok"], [None])


def test_armorm_config_takes_no_remote_code_and_a_sane_range():
    with pytest.raises(ValueError, match="loaded natively.*hf-classifier"):
        parse_config({"label": {"labeler": "armorm", "model": "m", "trust_remote_code": True}})
    with pytest.raises(ValueError, match=r"score_min \(1.0\) must be below score_max \(0.0\)"):
        parse_config({"label": {"labeler": "armorm", "model": "m", "score_min": 1.0, "score_max": 0.0}})


def test_hf_classifier_uses_first_logit(tiny_classifier):
    cfg = LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), batch_size=2, device="cpu")
    labeler = build_labeler(cfg)
    scores = labeler.score(QUESTIONS, RESPONSES, [None] * 4)
    for i in range(4):
        enc, _ = labeler.encode(QUESTIONS[i : i + 1], RESPONSES[i : i + 1])
        with torch.no_grad():
            assert scores[i] == pytest.approx(labeler.model(**enc).logits[0, 0].item(), abs=1e-5)
    assert len(set(scores)) == 4


def test_remote_code_runs_only_when_allowed(remote_code_classifier):
    with pytest.raises(LabelerError, match="label.trust_remote_code: true"):
        build_labeler(LabelerSpec(labeler="hf-classifier", model=str(remote_code_classifier), device="cpu"))
    labeler = build_labeler(LabelerSpec(labeler="hf-classifier", model=str(remote_code_classifier),
                                        trust_remote_code=True, batch_size=2, device="cpu"))
    assert type(labeler.model).__module__.startswith("transformers_modules")  # the folder's own code ran
    scores = labeler.score(QUESTIONS, RESPONSES, [None] * 4)
    assert len(set(scores)) == 4


def test_missing_reward_model_is_a_clear_error(tmp_path):
    with pytest.raises(LabelerError, match="could not be loaded"):
        build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tmp_path / "absent"), device="cpu"))
    with pytest.raises(LabelerError, match="no such folder"):
        build_labeler(LabelerSpec(labeler="armorm", model=str(tmp_path / "absent"), device="cpu"))


def test_failing_reward_model_names_the_rows(tiny_classifier, monkeypatch):
    labeler = build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), batch_size=2, device="cpu"))

    def broken(**_):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(labeler, "model", broken)
    # the longest rows go first: rows 0 and 2 (by length) form the first batch
    with pytest.raises(LabelerError, match=r"failed on rows \[0, 2\]: CUDA out of memory"):
        labeler.score(QUESTIONS, RESPONSES, [None] * 4)


def test_non_finite_scores_are_refused(tiny_classifier, monkeypatch):
    labeler = build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), batch_size=4, device="cpu"))
    real = labeler.model

    def half_nan(**enc):
        output = real(**enc)
        output.logits[1, 0] = float("nan")
        return output

    monkeypatch.setattr(labeler, "model", half_nan)
    with pytest.raises(LabelerError, match=r"non-finite scores for rows \[\d\]"):
        labeler.score(QUESTIONS, RESPONSES, [None] * 4)


def test_remote_code_written_for_older_transformers_is_named(remote_code_classifier, tmp_path):
    """ArmoRM's published code imports LLAMA_INPUTS_DOCSTRING, which transformers 5 removed: say so."""
    import shutil

    folder = tmp_path / "old-code"
    shutil.copytree(remote_code_classifier, folder)
    (code,) = folder.glob("modeling_*.py")
    code.write_text("from transformers.models.llama.modeling_llama import LLAMA_INPUTS_DOCSTRING\n" + code.read_text())
    with pytest.raises(LabelerError, match=r"does not import under transformers 5\..*LLAMA_INPUTS_DOCSTRING"):
        build_labeler(LabelerSpec(labeler="hf-classifier", model=str(folder), trust_remote_code=True, device="cpu"))


def test_the_label_stage_credits_a_cut_sample_only_for_a_marked_answer(tiny_llama, tmp_path):
    """The label stage reads each sample's ``finish_reason``: a sample cut at max_new_tokens (``length``) whose last
    number happens to equal the reference scores 0, is not correct and has no extracted answer; the same text that
    ended scores 1; a cut sample with "The answer is 6" before the cut scores 1."""
    import pandas as pd
    import yaml
    from prefect.logging import disable_run_logger

    from foresight.config import load_config
    from foresight.pairs import SAMPLE_COLUMNS
    from foresight.storage import read_table, write_table
    from tasks.label import label_task

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(tmp_path, tiny_llama)))
    cfg = load_config(tmp_path / "params.yaml")
    rows = [("4 + 2 = 6", "eos"), ("4 + 2 = 6", "length"), ("4 + 2 = 6. The answer is 6. Then 2", "length")]
    samples = pd.DataFrame([{"sample_id": f"p/{i}", "prompt_id": "p", "sample_index": i, "question": "4 + 2?",
                             "prompt": "4 + 2?", "response": response, "answer": "6", "prompt_tokens": 1,
                             "response_tokens": 1, "finish_reason": reason, "temperature": 1.0, "top_p": 1.0,
                             "top_k": 0, "max_new_tokens": 12, "seed": 0, "model": "tiny"}
                            for i, (response, reason) in enumerate(rows)], columns=SAMPLE_COLUMNS)
    write_table(samples, cfg.path(cfg.paths.samples))
    assert cfg.label.labeler == "verifiable"
    with disable_run_logger():
        metrics = label_task.fn(cfg).metrics
    scores = read_table(cfg.path(cfg.paths.scores), "scores")
    assert scores["score"].tolist() == [1.0, 0.0, 1.0]
    assert scores["correct"].tolist() == [True, False, True]
    assert [None if pd.isna(a) else a for a in scores["extracted_answer"]] == ["6", None, "6"]
    assert metrics["sample_accuracy"] == pytest.approx(2 / 3)


def test_the_label_section_is_the_labeler_spec_and_its_keys_reach_the_labeler(tiny_llama, tmp_path, monkeypatch):
    """``label`` is-a LabelerSpec, handed to :func:`build_labeler` as it is (no copy that could drop a key): a
    params.yaml key naming a LabelerSpec field reaches the labeler."""
    import pandas as pd
    import yaml
    from prefect.logging import disable_run_logger

    import tasks.label as task
    from foresight.config import load_config
    from models.labeling.config import LabelConfig

    class Handed(Exception):
        pass

    def built(spec):
        handed.append(spec)
        raise Handed

    assert issubclass(LabelConfig, LabelerSpec)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(tmp_path, tiny_llama)))
    cfg = load_config(tmp_path / "params.yaml", {"label.batch_size": 3, "label.score_max": 5.0})
    handed = []
    monkeypatch.setattr(task, "read_table", lambda path, name: pd.DataFrame({"prompt_id": ["p"], "answer": ["6"]}))
    monkeypatch.setattr(task, "build_labeler", built)
    with disable_run_logger(), pytest.raises(Handed):
        task.label_task.fn(cfg)
    assert isinstance(handed[0], LabelerSpec) and (handed[0].batch_size, handed[0].score_range) == (3, (0.0, 1.0))
    assert handed[0].score_max == 5.0
