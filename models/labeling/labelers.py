"""Reward labelers behind one interface: ``labeler.score(questions, responses, answers, on_batch, truncated)
-> scores``.

- ``verifiable``: 1.0 when the response's final answer equals the reference answer, else 0.0; both are read as
  real datasets write them (:mod:`models.labeling.answers`: GSM8K's ``#### N``, MATH's ``\\boxed{N}``, "The answer
  is N", a bare value). A missing or unreadable reference is an error, never a silent 0. A response cut by the
  length limit (``truncated``) is credited only for a marked answer, never for its last number.
- ``armorm``: ArmoRM-Llama3-8B-v0.1 (RLHFlow), loaded natively from its own config and safetensors
  (:mod:`models.labeling.armorm`, no remote code); the reward is its gated score, as the SLA paper evaluates with it
  (§5.1); :meth:`ArmoRMLabeler.score_objectives` also returns the 19 objective rewards behind it.
- ``hf-classifier``: any sequence-classification reward model; the reward is the first logit. A model that ships
  its own code runs only with ``trust_remote_code`` set explicitly.

Reward models see each (question, response) as a two-turn conversation through their own chat template,
right-padded, at most ``label.max_length`` tokens: a longer one loses the tail of its response, never its prompt
nor its end of turn (:mod:`models.labeling.conversations`). Rows are scored in batches of similar length (longest
first, so an out-of-memory shows at once) and put back in their order. The label stage: docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from models.engine.policy import resolve_device, resolve_dtype
from models.labeling.answers import is_correct, is_missing, unreadable_references
from models.labeling.armorm import ArmoRMError, encode_conversations, gating_pattern, load_armorm
from models.labeling.config import LabelerSpec
from models.labeling.conversations import conversation_ids

OnBatch = Callable[[int, int], None]
"""Called after each batch with (rows scored so far, rows in all): progress bars and artifacts."""


class LabelerError(RuntimeError):
    """A labeler could not be built or failed while scoring; the message names the model and the cause."""


class Labeler(Protocol):
    """Scores responses; higher is better."""

    name: str
    truncated_responses: int
    """Responses the last ``score`` call cut to fit the reward model (``label.max_length``); 0 for ``verifiable``."""

    def score(self, questions: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
              on_batch: OnBatch | None = None, truncated: Sequence[bool] | None = None) -> list[float]:
        """``truncated``: per response, whether the length limit cut it (None: none was). The verifiable labeler
        then credits only a marked answer (:func:`models.labeling.answers.extract_answer`); a reward model judges
        the text it is given either way."""
        ...


class VerifiableLabeler:
    """1.0 when the response's final answer equals the reference answer, else 0.0."""

    name = "verifiable"
    truncated_responses = 0

    def score(self, questions, responses, answers, on_batch=None, truncated=None):
        missing = sum(is_missing(a) for a in answers)
        unreadable = unreadable_references(answers)
        if missing or unreadable:
            examples = list(dict.fromkeys(str(a)[:60] for a in unreadable))[:3]
            raise LabelerError(
                f"the verifiable labeler needs a reference answer it can read for every row: of {len(answers)} rows, "
                f"{missing} have none and {len(unreadable)} have one without a number, '#### X', '\\boxed{{X}}' "
                f"or 'The answer is N'{f' (e.g. {examples})' if examples else ''}. Set the prompt source's "
                "answer_column, write text answers as '#### X', or use labeler armorm / hf-classifier"
            )
        cut = [False] * len(responses) if truncated is None else truncated
        scores = [1.0 if is_correct(r, a, c) else 0.0 for r, a, c in zip(responses, answers, cut, strict=True)]
        if on_batch is not None:
            on_batch(len(scores), len(scores))
        return scores


def score_in_batches(lengths: Sequence[int], batch_size: int, score_batch: Callable[[list[int]], torch.Tensor],
                     model_name: str, on_batch: OnBatch | None = None) -> torch.Tensor:
    """Run ``score_batch(rows) -> (b, C)`` over all rows in batches of similar ``lengths`` (longest first: an
    out-of-memory shows in the first batch, and short rows are not padded to long ones) and return (N, C) in the
    rows' own order. Failures and non-finite scores are errors naming the rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: torch.Tensor | None = None
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        try:
            batch = score_batch(rows).float().cpu()  # (b, C)
        except Exception as err:
            raise LabelerError(f"reward model {model_name!r} failed on rows {_span(rows)}: {err}") from err
        bad = [row for row, ok in zip(rows, torch.isfinite(batch).all(dim=1).tolist()) if not ok]
        if bad:
            raise LabelerError(f"reward model {model_name!r} returned non-finite scores for rows {sorted(bad)[:10]}")
        if out is None:
            out = torch.empty(len(lengths), batch.shape[1])
        out[rows] = batch
        if on_batch is not None:
            on_batch(min(start + batch_size, len(order)), len(order))
    return out if out is not None else torch.empty(0, 1)


def _span(rows: list[int]) -> str:
    rows = sorted(rows)
    return f"{rows[0]}..{rows[-1]}" if rows == list(range(rows[0], rows[-1] + 1)) else str(rows[:10])


def _conversation_lengths(questions: Sequence[str], responses: Sequence[str]) -> list[int]:
    """Characters per (question, response): a free proxy of token length for grouping rows into batches."""
    return [len(q) + len(r) for q, r in zip(questions, responses, strict=True)]


class ArmoRMLabeler:
    """ArmoRM's gated preference score (``output.score`` of the published model), computed natively."""

    name = "armorm"

    def __init__(self, cfg: LabelerSpec):
        self.cfg = cfg
        self.truncated_responses = 0
        device = resolve_device(cfg.device)
        try:
            self.model, self.tokenizer = load_armorm(cfg.model, resolve_dtype(cfg.dtype, device), device)
            self.pattern = gating_pattern(self.tokenizer)
        except ArmoRMError as err:
            raise LabelerError(f"reward model could not be loaded: {err}") from err

    @torch.no_grad()
    def score_objectives(self, questions, responses, on_batch=None) -> tuple[list[float], list[list[float]]]:
        """The gated scores and, per row, the objective rewards they mix (ArmoRM's 19 rating dimensions).
        Conversations over ``max_length`` lose the tail of their response (:attr:`truncated_responses` counts them)."""
        self.truncated_responses = 0

        def score_batch(rows: list[int]) -> torch.Tensor:
            enc, truncated = encode_conversations(self.tokenizer, [questions[i] for i in rows],
                                                  [responses[i] for i in rows], self.cfg.max_length, self.pattern)
            self.truncated_responses += sum(truncated)
            output = self.model(**{k: v.to(self.model.device) for k, v in enc.items()})
            return torch.cat([output.score[:, None], output.rewards], dim=1)  # (b, 1 + objectives)

        table = score_in_batches(_conversation_lengths(questions, responses), self.cfg.batch_size, score_batch,
                                 self.cfg.model, on_batch)
        return table[:, 0].tolist(), table[:, 1:].tolist()

    def score(self, questions, responses, answers, on_batch=None, truncated=None):
        return self.score_objectives(questions, responses, on_batch)[0]


class ClassifierLabeler:
    """A Hugging Face sequence-classification reward model; the reward is its first logit."""

    name = "hf-classifier"

    def __init__(self, cfg: LabelerSpec):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg = cfg
        self.truncated_responses = 0
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
                    "label.trust_remote_code: true in params.yaml (for ArmoRM use labeler: armorm, which needs none)"
                ) from err
            raise LabelerError(f"reward model {cfg.model!r} could not be loaded: {err}") from err
        except ImportError as err:
            import transformers

            raise LabelerError(
                f"reward model {cfg.model!r}: its own modeling code does not import under transformers "
                f"{transformers.__version__}: {err}. Code written for transformers 4.x (ArmoRM's imports "
                "LLAMA_INPUTS_DOCSTRING, removed in 5.x) needs a patched copy of the model folder; for ArmoRM use "
                "labeler: armorm, which loads it without its code."
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
        self.tokenizer.padding_side = "right"  # sequence classifiers pool the last non-pad token

    def encode(self, questions, responses):
        """The (question, response) conversations as one right-padded batch on the model's device, and per row
        whether its response was cut to ``max_length``: in the model's chat template, cut in the response
        (:func:`models.labeling.conversations.conversation_ids`: the prompt and the end of turn stay); without one,
        plain "question\n\nresponse" with the tokenizer's special tokens, cut at the end."""
        if getattr(self.tokenizer, "chat_template", None):
            rows, truncated = conversation_ids(self.tokenizer, questions, responses, self.cfg.max_length)
        else:
            rows = self.tokenizer([f"{q}\n\n{r}" for q, r in zip(questions, responses, strict=True)])["input_ids"]
            truncated = [len(row) > self.cfg.max_length for row in rows]
            rows = [row[: self.cfg.max_length] for row in rows]
        width = max(map(len, rows), default=0)
        input_ids = torch.tensor([row + [self.tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        return {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}, truncated

    @torch.no_grad()
    def score(self, questions, responses, answers, on_batch=None, truncated=None):
        self.truncated_responses = 0

        def score_batch(rows: list[int]) -> torch.Tensor:
            enc, truncated = self.encode([questions[i] for i in rows], [responses[i] for i in rows])
            self.truncated_responses += sum(truncated)
            return self.model(**enc).logits[:, :1]  # (b, 1)

        return score_in_batches(_conversation_lengths(questions, responses), self.cfg.batch_size, score_batch,
                                self.cfg.model, on_batch)[:, 0].tolist()


def build_labeler(cfg: LabelerSpec) -> Labeler:
    """The labeler named by ``cfg.labeler``."""
    if cfg.labeler == "verifiable":
        return VerifiableLabeler()
    if cfg.labeler == "armorm":
        return ArmoRMLabeler(cfg)
    return ClassifierLabeler(cfg)
