"""Reward labelers: verifiable answers, ArmoRM through its real remote-code loading path, HF classifiers."""

from dataclasses import replace

import pytest

from models.labeling.config import LabelerSpec
from models.labeling.labelers import LabelerError, build_labeler, extract_answer, is_correct


@pytest.mark.parametrize(
    "response, expected",
    [
        ("4 + 2 = 6. The answer is 6.", "6"),
        ("The answer is N.\n\nBen has 4 + 2 = 6 apples.", "6"),  # no number after "answer is": last number
        ("So the answer is: $1,200.", "1200"),
        ("**The answer is -3**", "-3"),
        ("The answer is 7. Wait, the answer is 8.", "8"),
        ("I think 3 and then 5", "5"),
        ("The answer is 2.5.", "2.5"),
        ("The answer is 6.0", "6"),
        ("no numbers at all", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_is_correct():
    assert is_correct("The answer is 12.", "12") is True
    assert is_correct("The answer is 12.", "13") is False
    assert is_correct("The answer is 12.", None) is None
    assert is_correct("", "3") is False


def test_verifiable_labeler_scores_and_requires_answers():
    labeler = build_labeler(LabelerSpec())
    assert labeler.score(["q"] * 3, ["The answer is 4.", "It is 5", "none"], ["4", "4", "4"]) == [1.0, 0.0, 0.0]
    with pytest.raises(LabelerError, match="needs known answers.*1 of 2"):
        labeler.score(["q", "q"], ["1", "2"], ["1", None])


QUESTIONS = ["Ben has 4 apples. How many?", "What is 2 + 3?", "Ivy has 3 cookies.", "Sum 1 and 1"]
RESPONSES = ["The answer is 4.", "5", "Ivy has 3 cookies, the answer is 3.", "2"]


def test_armorm_path_reads_output_score_from_remote_code_model(tiny_armorm):
    cfg = LabelerSpec(labeler="armorm", model=str(tiny_armorm), trust_remote_code=True, batch_size=3, device="cpu")
    labeler = build_labeler(cfg)
    assert type(labeler.model).__name__ == "TinyArmoRM"  # the model's own code was loaded
    scores = labeler.score(QUESTIONS, RESPONSES, [None] * 4)
    assert len(scores) == 4 and len(set(scores)) == 4
    # batching and right padding do not change a score: each row scored alone gives the same value
    alone = [build_labeler(replace(cfg, batch_size=1)).score([q], [r], [None])[0]
             for q, r in zip(QUESTIONS, RESPONSES)]
    assert scores == pytest.approx(alone, abs=1e-5)


def test_armorm_needs_explicit_trust_remote_code(tiny_armorm):
    with pytest.raises(LabelerError, match="label.trust_remote_code: true"):
        build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_armorm), device="cpu"))


def test_armorm_labeler_rejects_a_model_without_score(tiny_classifier):
    labeler = build_labeler(LabelerSpec(labeler="armorm", model=str(tiny_classifier), device="cpu"))
    with pytest.raises(LabelerError, match="no 'score' field.*hf-classifier"):
        labeler.score(QUESTIONS[:1], RESPONSES[:1], [None])


def test_hf_classifier_uses_first_logit(tiny_classifier):
    import torch

    cfg = LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), batch_size=2, device="cpu")
    labeler = build_labeler(cfg)
    scores = labeler.score(QUESTIONS, RESPONSES, [None] * 4)
    enc = labeler._encode(QUESTIONS[:1], RESPONSES[:1])
    with torch.no_grad():
        direct = labeler.model(**enc).logits[0, 0].item()
    assert scores[0] == pytest.approx(direct, abs=1e-5) and len(set(scores)) == 4


def test_missing_reward_model_is_a_clear_error(tmp_path):
    with pytest.raises(LabelerError, match="could not be loaded"):
        build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tmp_path / "absent"), device="cpu"))


def test_failing_reward_model_names_the_rows(tiny_classifier, monkeypatch):
    labeler = build_labeler(LabelerSpec(labeler="hf-classifier", model=str(tiny_classifier), batch_size=2, device="cpu"))

    def broken(**_):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(labeler, "model", broken)
    with pytest.raises(LabelerError, match=r"failed on rows 0\.\.1: CUDA out of memory"):
        labeler.score(QUESTIONS, RESPONSES, [None] * 4)


def test_remote_code_written_for_older_transformers_is_named(tiny_armorm, tmp_path):
    """ArmoRM's published code imports LLAMA_INPUTS_DOCSTRING, which transformers 5 removed: say so."""
    import shutil

    folder = tmp_path / "old-armo"
    shutil.copytree(tiny_armorm, folder)
    code = folder / "modeling_tiny_armo.py"
    code.write_text("from transformers.models.llama.modeling_llama import LLAMA_INPUTS_DOCSTRING\n" + code.read_text())
    with pytest.raises(LabelerError, match=r"does not import under transformers 5\..*LLAMA_INPUTS_DOCSTRING"):
        build_labeler(LabelerSpec(labeler="armorm", model=str(folder), trust_remote_code=True, device="cpu"))
