"""Reward labelers behind one interface: ``labeler.score(questions, responses, answers) -> scores``.

- ``verifiable``: reads the final answer ("The answer is N", else the last number) and compares it
  with the known answer: 1.0 right, 0.0 wrong.
- ``armorm``: ArmoRM-Llama3-8B-v0.1 (RLHFlow) through its real loading code,
  ``AutoModelForSequenceClassification.from_pretrained(..., trust_remote_code=True)``; the reward is
  ``output.score`` (the gated mixture of its 19 objectives), as the SLA paper evaluates with it.
- ``hf-classifier``: any sequence-classification reward model; the reward is the first logit.

Reward models see the conversation through their own chat template, right-padded, because both
HF sequence classifiers and ArmoRM pool the last non-pad token. The label stage: docs/pipeline.md.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Protocol

import torch

from models.engine.policy import resolve_device, resolve_dtype
from models.labeling.config import LabelerSpec

log = logging.getLogger(__name__)



class LabelerError(RuntimeError):
    """A labeler could not be built or failed while scoring; the message names the model and the cause."""


# "The answer is 12." / "the answer is: $1,200" / "**The answer is -3**"
_ANSWER_RE = re.compile(r"answer\s+is\s*:?\s*\**\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*\.?\d*|-?\.\d+")


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last "answer is N", else the last number; None if no number."""
    found = _ANSWER_RE.findall(response)
    if not found:
        found = _NUMBER_RE.findall(response)
    if not found:
        return None
    return _normalise_number(found[-1])


def _normalise_number(text: str) -> str | None:
    text = text.replace(",", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def is_correct(response: str, answer: str | None) -> bool | None:
    """True/False when the reference answer is known, None otherwise."""
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        return None
    expected = _normalise_number(str(answer))
    if expected is None:  # non-numeric reference: exact text match on the stripped final line
        return response.strip().splitlines()[-1].strip().lower() == str(answer).strip().lower() if response.strip() else False
    return extract_answer(response) == expected


class Labeler(Protocol):
    """Scores responses; higher is better."""

    name: str

    def score(self, questions: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]) -> list[float]:
        ...


class VerifiableLabeler:
    """1.0 when the extracted final answer equals the known answer, else 0.0."""

    name = "verifiable"

    def score(self, questions, responses, answers):
        missing = sum(a is None for a in answers)
        if missing:
            raise LabelerError(
                f"the verifiable labeler needs known answers, but {missing} of {len(answers)} prompts have none "
                "(set prompts.*.answer_column, or use labeler armorm / hf-classifier)"
            )
        return [1.0 if is_correct(r, a) else 0.0 for r, a in zip(responses, answers)]


class SequenceClassifierLabeler:
    """A Hugging Face reward model scoring (question, response) conversations in batches.

    ``score_field`` picks the output: ``"score"`` for ArmoRM's custom output, ``"logits"`` (first
    column) for ordinary sequence classifiers.
    """

    def __init__(self, cfg: LabelerSpec, score_field: str):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name, self.cfg, self.score_field = cfg.labeler, cfg, score_field
        self.device = resolve_device(cfg.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                cfg.model, dtype=resolve_dtype(cfg.dtype, self.device), trust_remote_code=cfg.trust_remote_code
            )
        except ValueError as err:
            if "trust_remote_code" in str(err) and not cfg.trust_remote_code:
                raise LabelerError(
                    f"reward model {cfg.model!r} ships its own code; allow it explicitly with "
                    "label.trust_remote_code: true in params.yaml"
                ) from err
            raise LabelerError(f"reward model {cfg.model!r} could not be loaded: {err}") from err
        except ImportError as err:
            import transformers

            raise LabelerError(
                f"reward model {cfg.model!r}: its own modeling code does not import under transformers "
                f"{transformers.__version__}: {err}. Code written for transformers 4.x (ArmoRM's imports "
                "LLAMA_INPUTS_DOCSTRING, removed in 5.x) needs a transformers 4.x environment for labeling, "
                "or a patched copy of the model folder."
            ) from err
        except OSError as err:
            raise LabelerError(
                f"reward model {cfg.model!r} could not be loaded: {err}. Offline? Put the model in the Hugging Face "
                "cache or a local folder first and point label.model at it."
            ) from err
        self.model.to(self.device).eval()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"

    def _encode(self, questions, responses):
        convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": r}]
                 for q, r in zip(questions, responses)]
        if getattr(self.tokenizer, "chat_template", None):
            texts = [self.tokenizer.apply_chat_template(c, tokenize=False) for c in convs]
            add_special = False
        else:  # classifier without a chat template: plain "question\n\nresponse"
            texts = [f"{q}\n\n{r}" for q, r in zip(questions, responses)]
            add_special = True
        return self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                              max_length=self.cfg.max_length, add_special_tokens=add_special).to(self.device)

    @torch.no_grad()
    def score(self, questions, responses, answers):
        scores: list[float] = []
        for start in range(0, len(responses), self.cfg.batch_size):
            stop = start + self.cfg.batch_size
            enc = self._encode(questions[start:stop], responses[start:stop])
            try:
                output = self.model(**enc)
            except Exception as err:
                raise LabelerError(f"reward model {self.cfg.model!r} failed on rows {start}..{stop - 1}: {err}") from err
            if self.score_field == "score":
                if getattr(output, "score", None) is None:
                    raise LabelerError(
                        f"reward model {self.cfg.model!r} returned no 'score' field (ArmoRM's custom output has one); "
                        "for an ordinary sequence classifier use labeler: hf-classifier"
                    )
                batch = output.score.reshape(len(enc["input_ids"]), -1)[:, 0]
            else:
                batch = output.logits[:, 0]
            batch = batch.float().cpu().tolist()
            bad = [start + i for i, s in enumerate(batch) if not math.isfinite(s)]
            if bad:
                raise LabelerError(f"reward model {self.cfg.model!r} returned non-finite scores for rows {bad[:10]}")
            scores += batch
        return scores


def build_labeler(cfg: LabelerSpec) -> Labeler:
    """The labeler named by ``cfg.labeler``."""
    if cfg.labeler == "verifiable":
        return VerifiableLabeler()
    return SequenceClassifierLabeler(cfg, score_field="score" if cfg.labeler == "armorm" else "logits")
