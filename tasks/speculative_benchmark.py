"""Prefect task of the ``benchmark_medusa`` stage: every drafter side by side, against HF greedy decoding.

Thin wrapper around :mod:`models.engine.speculative` and :mod:`models.engine.batched`: it loads the trained drafters,
decodes each prompt set with every decoder, checks every output against greedy's, and writes the report atomically.

The decoders (``medusa_benchmark.decoders``):

* ``greedy`` — HF greedy decoding with its KV cache at batch 1: the speed reference.
* ``prompt_lookup`` — HF prompt-lookup decoding (Saxena 2023, "Prompt Lookup Decoding"): drafts copied from the
  prompt's n-grams, no drafter to train.
* ``medusa_supervised`` — Medusa-1 heads (Cai et al. 2024, arXiv:2401.10774, §2.1.2 tree attention, §2.2.1
  Medusa-1) from the ``train_medusa`` stage (:mod:`tasks.medusa`), on one candidate tree (:func:`candidate_tree`).
* ``medusa_rl_<init>`` — the same heads with head 1 trained by RLMedusa (ICLR 2025 Workshop on Sparsity in LLMs;
  docs/medusa.md) in the ``train_rlmedusa`` stage, on the same tree.
* ``mtp_chain`` — the ``train_mtp`` stage's MTP module (MTP-RL §2.1 and §3.1, DeepSeek-V3's module with its depths
  sharing one set of parameters: docs/mtp.md) drafting a chain of its K top-1 drafts
  (:class:`models.mtp.module.MTPDrafter`).
* ``mtp_tree`` — the same module drafting EAGLE-2's dynamic tree (Li et al. 2024, §4:
  :class:`models.mtp.dynamic_tree.MTPTreeDrafter`), its verification budget and depth chosen from the policy's
  measured forward cost against tree width, the drafter's measured time per depth and the module's acceptance at
  each budget and depth on training prompts (:func:`models.mtp.dynamic_tree.calibrate_budget`).

Each runs at batch 1 on each prompt set (task, general, files), the batched engine's drafters also batched and on a
batch speed curve: speedup over greedy in the same run, τ and the share of outputs identical to greedy, each with a
95 % interval over prompts (:mod:`foresight.statistics`), and, for every output that differs from greedy's, the
policy's logit margin where it first differs.

Its own module, apart from the training tasks of :mod:`tasks.medusa`: a stage's DVC code deps follow its task
module's imports (:func:`foresight.stages.stage_modules`), so the training stages do not re-run when only a
benchmarked drafter's decoding code (e.g. :mod:`models.mtp`) changes.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import torch
from tqdm.auto import tqdm

from foresight import statistics
from foresight.benchmark import (
    CURVE_METRICS,
    batch_speed_curve,
    curve_bars,
    display_rows,
    interleaved_decoding,
    markdown_table,
    speed_row,
)
from foresight.plots import bar_plot, interval_bar, line_panels_figure, save
from foresight.prompts import file_prompts, general_instructions
from foresight.storage import atomic_path, write_json, write_table
from models.engine.batched import (
    BatchDrafter,
    BatchGreedy,
    HeadsDrafter,
    batched_speculative_generate,
    unsupported_layers,
)
from models.engine.config import DynamicTree
from models.engine.decoding import GREEDY, hf_decode
from models.engine.generation import chat_prompts, encode_prompt, end_token_ids
from models.engine.policy import load_policy
from models.engine.speculative import (
    AdaptiveDrafting,
    VERIFICATION_REPEATS,
    TreeVerifier,
    build_tree,
    speculative_generate,
)
from models.medusa.heads import MedusaDrafter, MedusaHeads
from models.mtp.dynamic_tree import (
    CALIBRATION_COLUMNS,
    DEPTH_COLUMNS,
    BudgetCalibration,
    MTPBatchTreeDrafter,
    MTPTreeDrafter,
    resolved_tree,
)
from models.mtp.module import MTPBatchDrafter, MTPDrafter, MTPModule, MTPModuleConfig, draft_parts
from tasks.common import (
    StageResult,
    drop_long_prompt_sets,
    gpu_task,
    load_stage_policy,
    markdown_artifact,
    read_prompts,
    stage_logger,
    table_artifact,
)

if TYPE_CHECKING:
    from foresight.config import Config


SPEED_COLUMNS = ["prompt_set", "decoder", "batch", "tau", "speedup_vs_reference", "tokens_per_s", "identical_to_greedy",
                 "plain_share", "prompts", "speed_prompts"]
DIVERGENCE_COLUMNS = ["prompt_set", "decoder", "prompt_index", "position", "greedy_text", "decoder_text", "margin",
                      "top2_margin", "argmax", "float32_margin", "float32_choice"]


def _prompt_sets(cfg: Config) -> dict[str, list[str]]:
    """``held_out`` (the first ``medusa_benchmark.num_prompts`` of the eval split), ``general`` (the first
    ``medusa_benchmark.general_prompts`` held-out instructions of the general set; none when 0) and one set per
    prompt file: ``num_prompts`` rows drawn across the whole file with ``medusa_benchmark.seed``, in the drawn order
    (a file sorted by category gives every category its share, the timed first ``speed_prompts`` included; the
    eval split and the general set's held-out part are seeded permutations already)."""
    s = cfg.medusa_benchmark
    sets = {"held_out": read_prompts(cfg, "eval")["question"].head(s.num_prompts).tolist()}
    if s.general_prompts:
        sets["general"] = general_instructions("eval", s.general_prompts)["question"].tolist()
    for file_cfg in s.prompt_files:
        questions = file_prompts(file_cfg, cfg.root)["question"].tolist()
        # seeded as the splits are drawn (foresight.prompts.load_prompts): the same rows on every machine
        drawn = random.Random(s.seed).sample(range(len(questions)), min(s.num_prompts, len(questions)))
        sets[Path(file_cfg.path).stem] = [questions[i] for i in drawn]
    for name, questions in sets.items():
        if not questions:
            raise ValueError(f"prompt set {name!r} is empty")
    return sets


def benchmark_prompt_sets(cfg: Config, tokenizer) -> tuple[dict[str, list[str]], dict[str, int]]:
    """:func:`_prompt_sets` without the prompts over the prompt limit in the policy's chat template (the rule
    ``prepare_prompts`` applies to the splits: :func:`tasks.common.drop_long_prompt_sets`), and the metrics
    ``dropped_long_prompts.<set>``. The general set and prompt files never passed ``prepare_prompts``: an over-long
    prompt there would decode past the policy's context."""
    sets = {name: pd.DataFrame({"question": questions}) for name, questions in _prompt_sets(cfg).items()}
    kept, dropped = drop_long_prompt_sets(cfg, tokenizer, sets, cfg.medusa_benchmark.max_new_tokens)
    return {name: table["question"].tolist() for name, table in kept.items()}, dropped


def candidate_tree(cfg: Config):
    """The configured tree, or (``auto``) the ``tree_size`` paths the supervised heads' held-out drafts had
    accepted most often (:func:`models.engine.speculative.likeliest_paths`, measured by ``train_medusa``). Every
    Medusa decoder uses the same tree, so they differ only in their heads."""
    s = cfg.medusa_benchmark
    if s.tree != "auto":
        return build_tree(s.tree)
    evaluation = cfg.path(cfg.paths.medusa_dir) / "supervised" / "evaluation.json"
    if not evaluation.is_file():
        raise FileNotFoundError(f"{evaluation} is missing: run the train_medusa stage (speculative.tree: auto reads it)")
    paths = [entry["path"] for entry in json.loads(evaluation.read_text())["path_acceptance"][: s.tree_size]]
    if not paths:  # no held-out draft was ever right: the smallest tree, and adaptive drafting will mostly skip it
        stage_logger().warning("the heads' held-out drafts were never accepted: drafting one token per cycle")
        paths = [[0]]
    return build_tree(paths)


@gpu_task("benchmark-medusa")
def benchmark_medusa_task(cfg: Config) -> StageResult:
    """Every speculative decoder against HF greedy, on each prompt set: at batch 1 on its first ``speed_prompts``
    prompts (speed, every decoder interleaved prompt by prompt; τ; identity), and — each drafter the batched engine
    runs (Medusa's, ``mtp_chain``, ``mtp_tree``), under greedy verification — batched on all of them
    (``<decoder>_batched``: τ and identity over the whole set, in batches of ``batch_size``, untimed); and the
    policy's logit margin at every divergence. ``mtp_tree``'s budget and depth, when ``auto``, are calibrated
    first, on the policy's measured verification cost and the drafter's measured drafting time.

    Identity is judged against HF greedy decoding the whole set in left-padded batches of ``batch_size``. In half
    precision that reference rounds differently from greedy at batch 1 too; the greedy row's own identity share
    (its timed, batch-1 outputs against it) measures by how much."""
    logger = stage_logger()
    started = time.perf_counter()
    s = cfg.medusa_benchmark
    policy = load_stage_policy(cfg, "base")
    sets, dropped = benchmark_prompt_sets(cfg, policy.tokenizer)
    unknown = sorted(set(s.curve_sets) - set(sets))
    if unknown:
        raise ValueError(f"medusa_benchmark.curve_sets names {unknown}, not a benchmarked prompt set ({sorted(sets)})")
    encoded = {name: [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, questions,
                                                                     cfg.prompts.system_prompt)]
               for name, questions in sets.items()}
    mtp_parts = _mtp_draft_parts(cfg, policy)
    dynamic, calibration = _dynamic_tree(cfg, policy, mtp_parts)
    tree = candidate_tree(cfg)
    decoders, batch_drafters = _medusa_decoders(cfg, policy, tree, mtp_parts, dynamic)
    batched = _batched_drafters(cfg, policy, batch_drafters)
    checks = _DivergenceChecks(cfg, policy)
    eos = end_token_ids(policy)
    records, rows, divergences, curve = [], [], [], []
    for set_name, prompt_ids in encoded.items():
        reference = hf_decode(policy, [ids[0].tolist() for ids in prompt_ids], GREEDY, s.max_new_tokens, eos,
                              batch_size=s.batch_size)
        timers, decoded = interleaved_decoding(list(decoders), prompt_ids[: s.speed_prompts],
                                               lambda decoder, ids, n: decoders[decoder](ids, n), s.max_new_tokens,
                                               f"speculative decoding, timed ({set_name})")
        for record in decoded:
            record["batch"] = 1
        decoded += _batched_decoding(cfg, policy, batched, [ids[0].tolist() for ids in prompt_ids], eos, set_name)
        set_records = [{"prompt_set": set_name, "prompt_index": r["prompt_index"], "decoder": r["decoder"],
                        "batch": r["batch"], "tokens": r["tokens"], "new_tokens": len(r["tokens"]),
                        "forwards": r["stats"].forwards if r["stats"] else None,
                        "plain_forwards": r["stats"].plain_forwards if r["stats"] else None,
                        "response": policy.tokenizer.decode(r["tokens"], skip_special_tokens=True)} for r in decoded]
        set_rows = _speed_rows(set_name, set_records, timers, reference)
        set_divergences = checks(set_name, set_records, prompt_ids, reference)
        logger.info("\n%s\n%d outputs differ from greedy's", markdown_table(set_rows, SPEED_COLUMNS),
                    len(set_divergences))
        records += set_records
        rows += set_rows
        divergences += set_divergences
        if set_name in s.curve_sets and s.curve_batch_sizes and batched:
            set_curve = _speed_curve(cfg, policy, batched, [ids[0].tolist() for ids in prompt_ids], eos, set_name)
            logger.info("\n%s", markdown_table(set_curve, CURVE_COLUMNS))
            curve += set_curve
    result = _medusa_report(cfg, records, rows, divergences, curve, tree, str(policy.model.dtype),
                            time.perf_counter() - started, dynamic, calibration)
    result.metrics |= dropped
    return result


def _mtp_draft_parts(cfg: Config, policy) -> tuple | None:
    """The ``train_mtp`` stage's module as its drafters run it (:func:`models.mtp.module.draft_parts` in
    ``medusa_benchmark.draft_dtype``), or None when no MTP decoder is benchmarked."""
    if not {"mtp_chain", "mtp_tree"} & set(cfg.medusa_benchmark.decoders):
        return None
    module = MTPModule.load(cfg.path(cfg.paths.mtp_dir) / "module", policy.model).eval().requires_grad_(False)
    return draft_parts(policy.model, module, getattr(torch, cfg.medusa_benchmark.draft_dtype))


def _dynamic_tree(cfg: Config, policy, mtp_parts: tuple | None) -> tuple[DynamicTree | None,
                                                                          BudgetCalibration | None]:
    """``mtp_tree``'s tree (``medusa_benchmark.dynamic_tree``) with its budget and depth resolved and, with ``auto``,
    the calibration that chose them (:func:`models.mtp.dynamic_tree.resolved_tree`) on training prompts, never
    benchmarked ones: the task's training split and, where the benchmark has a general set, the general set's
    training instructions, half each. None and None without ``mtp_tree``."""
    s = cfg.medusa_benchmark
    if "mtp_tree" not in s.decoders:
        return None, None
    count = s.dynamic_tree.calibration_prompts
    general = count // 2 if s.general_prompts else 0
    questions = read_prompts(cfg, "train")["question"].head(count - general).tolist()
    if general:
        questions += general_instructions("train", general)["question"].tolist()
    prompts = [encode_prompt(policy, p) for p in chat_prompts(policy.tokenizer, questions, cfg.prompts.system_prompt)]
    dynamic, calibration = resolved_tree(policy.model, *mtp_parts, s.dynamic_tree, prompts, s.max_new_tokens,
                                         end_token_ids(policy))
    if calibration is not None:
        stage_logger().info("dynamic tree: %d nodes, depth %d, calibrated on %d training prompts (%d cycles):\n%s\n%s",
                            dynamic.budget, dynamic.depth, len(prompts), calibration.cycles,
                            markdown_table(calibration.depth_rows(), DEPTH_COLUMNS),
                            markdown_table(calibration.rows(), CALIBRATION_COLUMNS))
    return dynamic, calibration


def _speed_curve(cfg: Config, policy, drafters: dict[str, Callable[[], BatchDrafter]], prompts: list[list[int]],
                 eos: set[int], set_name: str) -> list[dict]:
    """Speed against batch size on one prompt set (:func:`foresight.benchmark.batch_speed_curve`): HF batched greedy
    (the reference) and each batched drafter (``drafters``: name → a new one; Medusa's, ``mtp_chain``, ``mtp_tree``) in
    the batched tree engine, greedy-verified, adaptive as configured with one decision state per drafter and batch
    size (a cycle's cost in plain steps grows with the batch)."""
    s = cfg.medusa_benchmark
    states: dict[tuple[str, int], AdaptiveDrafting | None] = {}

    def decode(decoder: str, batch: list[list[int]], max_new_tokens: int):
        if decoder == "greedy":
            return hf_decode(policy, batch, GREEDY, max_new_tokens, eos, batch_size=len(batch)), None
        if (decoder, len(batch)) not in states:
            states[decoder, len(batch)] = AdaptiveDrafting(s.adaptation) if s.adaptive else None
        return batched_speculative_generate(policy.model, drafters[decoder](), BatchGreedy(), batch, max_new_tokens,
                                            eos, states[decoder, len(batch)])

    rows = batch_speed_curve(["greedy", *drafters], prompts, decode, "greedy", s.curve_batch_sizes,
                             s.curve_batches, s.max_new_tokens, f"speed curve ({set_name})")
    return [{"prompt_set": set_name, **row} for row in rows]


def _medusa_decoders(cfg: Config, policy, tree, mtp_parts: tuple | None, dynamic: DynamicTree | None
                     ) -> tuple[dict[str, Callable], dict[str, Callable[[], BatchDrafter]]]:
    """Name → ``decode(ids, max_new_tokens) → (tokens, stats or None)``: HF greedy (batch 1, the speed reference),
    prompt lookup, one Medusa drafter per trained set of heads on ``tree``, and the ``train_mtp`` stage's MTP module
    (``mtp_parts``: :func:`_mtp_draft_parts`) as a drafter — ``mtp_chain`` (its K chained drafts) and ``mtp_tree``
    (EAGLE-2's dynamic tree ``dynamic``, its budget and depth resolved), both from the module's draft vocabulary
    where it has one — every drafter with the configured verification, adaptive or not (``medusa_benchmark.adaptive``,
    one decision state per decoder); and name → a new batched drafter (:class:`models.engine.batched.BatchDrafter`)
    for each of them the batched engine runs: the Medusa drafters, ``mtp_chain`` and ``mtp_tree`` (each row its own dynamic tree)."""
    s = cfg.medusa_benchmark
    eos = end_token_ids(policy)
    # the section is-a TypicalAcceptance: its typical_* knobs are the rule
    verifier = TreeVerifier(None if s.acceptance == "greedy" else s)
    adaptation = s.adaptation if s.adaptive else None
    hf_kwargs = {"greedy": GREEDY}
    if "prompt_lookup" in s.decoders:
        hf_kwargs["prompt_lookup"] = {**GREEDY, "prompt_lookup_num_tokens": s.prompt_lookup_tokens}
    folders = {"medusa_supervised": Path("supervised")} if "medusa_supervised" in s.decoders else {}
    if "medusa_rl" in s.decoders:
        folders |= {f"medusa_rl_{init}": Path("rl") / init for init in cfg.rlmedusa.inits}
    lm_head = policy.model.get_output_embeddings()
    draft_dtype = getattr(torch, s.draft_dtype)
    medusa_dir = cfg.path(cfg.paths.medusa_dir)
    heads = {name: MedusaDrafter(policy.model, MedusaHeads.load(medusa_dir / folder, lm_head), tree, draft_dtype)
             for name, folder in folders.items()}
    # name → the drafter of one prompt: Medusa's starts afresh at each prefill, an MTP drafter keeps its prompt's
    # states, so each prompt gets a new one
    drafters = {name: (lambda drafter=drafter: drafter) for name, drafter in heads.items()}
    batched = {name: (lambda drafter=drafter: HeadsDrafter(drafter.tree, drafter.draft_logits))
               for name, drafter in heads.items()}
    if mtp_parts is not None:
        draft_base, draft_module = mtp_parts
        if "mtp_chain" in s.decoders:
            drafters["mtp_chain"] = lambda: MTPDrafter(draft_base, draft_module)
            batched["mtp_chain"] = lambda: MTPBatchDrafter(draft_base, draft_module)
        if "mtp_tree" in s.decoders:
            drafters["mtp_tree"] = lambda: MTPTreeDrafter(draft_base, draft_module, dynamic, dynamic.budget)
            batched["mtp_tree"] = lambda: MTPBatchTreeDrafter(draft_base, draft_module, dynamic, dynamic.budget)

    def hf(kwargs):
        return lambda ids, max_new_tokens: (
            hf_decode(policy, [ids[0].tolist()], kwargs, max_new_tokens, eos, batch_size=1)[0], None)

    def speculative(new_drafter: Callable):
        # one drafting state per decoder, carried from prompt to prompt as a server would
        drafting = AdaptiveDrafting(adaptation) if adaptation is not None else None
        return lambda ids, max_new_tokens: speculative_generate(policy.model, new_drafter(), verifier, ids,
                                                                max_new_tokens, eos, adaptation=drafting)

    return ({name: hf(kwargs) for name, kwargs in hf_kwargs.items()}
            | {name: speculative(new_drafter) for name, new_drafter in drafters.items()}, batched)


def _batched_drafters(cfg: Config, policy, drafters: dict[str, Callable[[], BatchDrafter]]
                      ) -> dict[str, Callable[[], BatchDrafter]]:
    """The drafters to run batched as well (:mod:`models.engine.batched`): all of ``drafters`` under greedy
    verification on a full-attention policy; none otherwise (the batch-1 rows then cover the timed prompts only)."""
    unsupported = unsupported_layers(policy.model)
    if cfg.medusa_benchmark.acceptance != "greedy" or unsupported:
        stage_logger().warning("no batched drafter rows: batched tree decoding verifies greedily on full-attention "
                               "models only (%s)", unsupported or f"acceptance {cfg.medusa_benchmark.acceptance}")
        return {}
    return drafters


def _batched_decoding(cfg: Config, policy, drafters: dict[str, Callable[[], BatchDrafter]], prompts: list[list[int]],
                      eos: set[int], set_name: str) -> list[dict]:
    """Each drafter's outputs on every prompt (``drafters``: name → a new batched drafter), decoded in batches of
    ``medusa_benchmark.batch_size`` up to an end token in ``eos`` (one record per prompt, decoder
    ``<name>_batched``)."""
    s = cfg.medusa_benchmark
    records = []
    for name, new_drafter in drafters.items():
        for start in tqdm(range(0, len(prompts), s.batch_size), unit="batch",
                          desc=f"batched speculative decoding ({set_name}, {name})"):
            outputs, stats = batched_speculative_generate(policy.model, new_drafter(), BatchGreedy(),
                                                          prompts[start : start + s.batch_size], s.max_new_tokens, eos)
            records += [{"prompt_index": start + i, "decoder": f"{name}_batched", "batch": s.batch_size,
                         "tokens": tokens, "stats": row}
                        for i, (tokens, row) in enumerate(zip(outputs, stats, strict=True))]
    return records


def _speed_rows(set_name: str, records: list[dict], timers: dict, reference: list[list[int]]) -> list[dict]:
    """One row per decoder of a prompt set: its batch size, τ (Σ tokens / Σ forwards, greedy = 1) and the share of
    outputs equal to ``reference`` (greedy's per prompt index), with intervals over the prompts it decoded; speed
    against HF greedy on the timed prompts (timed decoders only); the share of plain (non-draft) forwards where the
    decoder reports it."""
    outputs = pd.DataFrame(records)
    rows = []
    for decoder, mine in outputs.groupby("decoder", sort=False):
        mine = mine.set_index("prompt_index")
        identical = [float(mine["tokens"][i] == reference[i]) for i in mine.index]
        # greedy makes one forward per token, the prefill included; prompt lookup does not expose its forwards
        forwards = mine["new_tokens"] if decoder == "greedy" else mine["forwards"]
        # τ = Σ tokens / Σ forwards over the prompts, resampled together
        tau = (statistics.interval_columns("tau", statistics.ratio_of_sums(mine["new_tokens"].tolist(),
                                                                           forwards.tolist()), 1.0)
               if forwards.notna().all() else {"tau": float("nan")})
        plain = mine["plain_forwards"]
        timed = decoder in timers
        rows.append({"prompt_set": set_name, "decoder": decoder, "batch": int(mine["batch"].iloc[0]), **tau,
                     **(speed_row(timers[decoder], timers["greedy"]) if timed else {}),
                     **statistics.interval_columns("identical_to_greedy", statistics.mean_interval(identical)),
                     "plain_share": float(plain.sum() / forwards.sum()) if plain.notna().all() else float("nan"),
                     "prompts": len(mine), "speed_prompts": timers[decoder].calls if timed else 0})
    return rows


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """The first position where two outputs differ (the shorter one's length when one extends the other)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b),
                min(len(tokens), len(reference)))


@torch.no_grad()
def next_token_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits (V,) for the token after ``ids`` (1, L), in float32, from one forward without a cache."""
    return model(input_ids=ids.to(model.device), logits_to_keep=1).logits[0, -1].float()


def _choice(logits: torch.Tensor, greedy_token: int, token: int) -> str:
    """Whose token the argmax of ``logits`` is: ``greedy``'s, the ``decoder``'s, or an ``other`` one."""
    best = int(logits.argmax())
    return "greedy" if best == greedy_token else "decoder" if best == token else "other"


class _DivergenceChecks:
    """Why a decoder's output differs from HF greedy's (bf16: a multi-token forward, or a padded batch, rounds
    differently from a one-token one). For each such output: the first differing position, and the policy's
    logits there from one forward over the prompt and the common prefix, in the policy's dtype — ``margin`` =
    logit of greedy's token − logit of the decoder's (near 0: a near-tie that rounding decides), ``top2_margin`` =
    top-1 − top-2, ``argmax`` = whose token that forward prefers — and, when the policy is not float32 and
    ``float32_recheck`` is on, the same from a float32 copy of the policy (loaded once, at the first divergence)."""

    def __init__(self, cfg: Config, policy):
        self.cfg, self.policy = cfg, policy
        self.float32 = None

    def _float32_model(self):
        if self.float32 is None:
            spec = self.cfg.policy.model_copy(update={"dtype": "float32"})
            self.float32 = load_policy(spec, self.cfg.path(self.cfg.paths.policy_dir)).model
        return self.float32

    def __call__(self, set_name: str, records: list[dict], prompt_ids: list[torch.Tensor],
                 greedy: list[list[int]]) -> list[dict]:
        """One row per output of ``records`` (a prompt set's) that differs from ``greedy``'s (per prompt index)."""
        recheck = self.cfg.medusa_benchmark.float32_recheck and self.policy.model.dtype != torch.float32
        decode = self.policy.tokenizer.decode
        rows = []
        for r in records:
            reference = greedy[r["prompt_index"]]
            if r["tokens"] == reference:
                continue
            position = first_difference(r["tokens"], reference)
            row = {"prompt_set": set_name, "decoder": r["decoder"], "prompt_index": r["prompt_index"],
                   "position": position}
            if position < min(len(r["tokens"]), len(reference)):
                greedy_token, token = reference[position], r["tokens"][position]
                context = torch.cat([prompt_ids[r["prompt_index"]][0].cpu(),
                                     torch.tensor(reference[:position], dtype=torch.long)])[None]  # (1, L + position)
                logits = next_token_logits(self.policy.model, context)
                top2 = logits.topk(2).values
                row |= {"greedy_token": greedy_token, "decoder_token": token, "greedy_text": decode([greedy_token]),
                        "decoder_text": decode([token]), "margin": float(logits[greedy_token] - logits[token]),
                        "top2_margin": float(top2[0] - top2[1]), "argmax": _choice(logits, greedy_token, token)}
                if recheck:
                    exact = next_token_logits(self._float32_model(), context)
                    row |= {"float32_margin": float(exact[greedy_token] - exact[token]),
                            "float32_choice": _choice(exact, greedy_token, token)}
            rows.append(row)
        return rows


DIVERGENCE_FIELDS = ["prompt_set", "decoder", "prompt_index", "position", "greedy_token", "decoder_token",
                     "greedy_text", "decoder_text", "margin", "top2_margin", "argmax", "float32_margin",
                     "float32_choice"]
METRIC_COLUMNS = ("tau", "speedup_vs_reference", "tokens_per_s", "identical_to_greedy", "plain_share")
CURVE_COLUMNS = ["prompt_set", "batch", "decoder", "speedup_vs_reference", "tokens_per_s", "tokens_per_forward",
                 "slowest_row_tokens_per_forward", "plain_share", "identical_to_reference", "batches"]


def _medusa_report(cfg: Config, records: list[dict], rows: list[dict], divergences: list[dict], curve: list[dict],
                   tree, dtype: str, seconds: float, dynamic: DynamicTree | None,
                   calibration: BudgetCalibration | None) -> StageResult:
    """``benchmarks/medusa``: every output, the speed table, the divergences from greedy, the speed curve over batch
    sizes, the speedup, τ and curve plots (with their intervals), the report and Medusa's tree; with ``mtp_tree``
    its tree (``dynamic``), and where it was calibrated the verification cost, τ and expected speedup against width
    and the drafting time and best tree by depth."""
    out_dir = cfg.path(cfg.paths.benchmarks_dir) / "medusa"
    divergence_table = pd.DataFrame(divergences, columns=DIVERGENCE_FIELDS)
    cost_rows = calibration.rows() if calibration is not None else []
    depth_rows = calibration.depth_rows() if calibration is not None else []
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        write_table(pd.DataFrame(records).drop(columns=["tokens"]), tmp / "outputs.parquet")
        write_table(pd.DataFrame(rows), tmp / "table.csv")
        write_table(divergence_table, tmp / "divergences.parquet")
        sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
        bar_plot({p: {r["decoder"]: interval_bar(r, "speedup_vs_reference") for r in rows
                      if r["prompt_set"] == p and "speedup_vs_reference" in r} for p in sets},
                 "Speedup over HF greedy (batch 1, same run)", "× greedy tokens/s", tmp / "speedup.png",
                 reference_line=1.0)
        bar_plot({p: {r["decoder"]: interval_bar(r, "tau") for r in rows
                      if r["prompt_set"] == p and r["tau"] == r["tau"]} for p in sets},
                 "Mean accepted length τ (tokens per forward)", "τ", tmp / "tau.png", reference_line=1.0)
        if curve:
            write_table(pd.DataFrame(curve), tmp / "speed_curve.csv")
            bar_plot(curve_bars(curve, lambda r: f"{r['prompt_set']} {r['decoder']}"),
                     "Batched drafters over HF batched greedy, by batch size (same run)", "× greedy tokens/s",
                     tmp / "speed_curve.png", reference_line=1.0)
        if cost_rows:
            write_table(pd.DataFrame(cost_rows), tmp / "verification_cost.csv")
            write_table(pd.DataFrame(depth_rows), tmp / "draft_depth.csv")
            trees = [r for r in cost_rows if r["width"] > 1]
            save(line_panels_figure(
                {"× one-token forward": {"verification forward": ([r["width"] for r in cost_rows],
                                                                  [r["cost_vs_one_token"] for r in cost_rows])},
                 "tokens per cycle (τ)": {"τ on training prompts": ([r["width"] for r in trees],
                                                                    [r["tau"] for r in trees])},
                 "× greedy (expected)": {"τ · V(1) / (F + V(width))": ([r["width"] for r in trees],
                                                                       [r["expected_speedup"] for r in trees])}},
                f"Dynamic tree budget ({dtype.removeprefix('torch.')}): chosen {dynamic.budget} nodes, depth "
                f"{dynamic.depth}",
                "tokens per verification forward (root included)",
                references={"× greedy (expected)": (1.0, "greedy")}), tmp / "verification_cost.png")
        (tmp / "report.md").write_text(_report(rows, divergence_table, curve, tree, dtype, cfg, dynamic, cost_rows,
                                               depth_rows))
        write_json({"choices": [list(c) for c in tree.choices]}, tmp / "tree.json")
    metrics = {f"{r['prompt_set']}.{r['decoder']}.{column}": r[column] for r in rows
               for key in METRIC_COLUMNS for column in (key, f"{key}_low", f"{key}_high")
               if column in r and r[column] == r[column]}
    metrics |= {f"{r['prompt_set']}.{r['decoder']}.batch{r['batch']}.{column}": r[column] for r in curve
                for key in CURVE_METRICS for column in (key, f"{key}_low", f"{key}_high") if column in r}
    metrics["divergences"] = len(divergence_table)
    if divergence_table["float32_choice"].notna().any():
        metrics["divergences_float32_greedy_share"] = float((divergence_table["float32_choice"] == "greedy").mean())
    if dynamic is not None:
        metrics["mtp_tree.budget"] = dynamic.budget
        metrics["mtp_tree.depth"] = dynamic.depth
    if calibration is not None:
        metrics["mtp_tree.budget_expected_speedup"] = calibration.expected_speedup(dynamic.budget)
        metrics["mtp_tree.budget_fixed_ms"] = 1000 * calibration.fixed_seconds
    metrics["wall_seconds"] = seconds
    table_artifact(key="medusa-benchmark", table=display_rows(rows, SPEED_COLUMNS),
                   description="Speculative decoders against HF greedy: speed at batch 1, τ and identity at batch 1 "
                               "and batched (95 % intervals, * = significant)")
    markdown_artifact(key="medusa-benchmark-report", markdown=(out_dir / "report.md").read_text(),
                      description="Speculative decoding benchmark report (prompt lookup, Medusa, RLMedusa, MTP)")
    return StageResult(metrics=metrics, tables={"medusa_table": out_dir / "table.csv"}, artifacts={"benchmark": out_dir})


def _report(rows: list[dict], divergences: pd.DataFrame, curve: list[dict], tree, dtype: str, cfg: Config,
            dynamic: DynamicTree | None, cost_rows: list[dict], depth_rows: list[dict]) -> str:
    s = cfg.medusa_benchmark
    rl_eval_path = cfg.path(cfg.paths.medusa_dir) / "rl" / "evaluation.json"
    described = []  # the decoders besides greedy and Medusa's
    if "prompt_lookup" in s.decoders:
        described.append(f"`prompt_lookup`: HF prompt-lookup decoding ({s.prompt_lookup_tokens} tokens per lookup)")
    if "mtp_chain" in s.decoders:
        depths = MTPModuleConfig.read(cfg.path(cfg.paths.mtp_dir) / "module").num_depths
        described.append(f"`mtp_chain`: the `train_mtp` stage's MTP module drafting a chain of its {depths} top-1 "
                         "drafts")
    if "mtp_tree" in s.decoders:
        t = s.dynamic_tree
        how = ("calibrated on training prompts: the most tokens per second (below)" if t.budget == "auto"
               else "as configured")
        described.append(f"`mtp_tree`: the same module drafting EAGLE-2's dynamic tree (depth {dynamic.depth} of at "
                         f"most {t.depth}, top-{t.top_k} children of the {t.frontier} likeliest nodes per depth, "
                         f"re-ranked to a budget of {dynamic.budget} nodes besides the root: {how}); batched, each row "
                         "drafts its own tree")
    lines = [
        "# Speculative decoding benchmark (HF greedy, prompt lookup, Medusa, RLMedusa, MTP)",
        (f"\nPolicy in {dtype.removeprefix('torch.')}, max {s.max_new_tokens} new tokens, {s.acceptance} "
         f"verification; Medusa on a {tree.size}-node tree (root included; "
         f"{'the paths held-out drafts were accepted on most often' if s.tree == 'auto' else 'as configured'}, "
         f"choices in `tree.json`){''.join(f'; {d}' for d in described)}. Drafts in {s.draft_dtype}. "
         "Rows at `batch` 1 decode the first `speed_prompts` prompts one at a time, timed; "
         "`<decoder>_batched` rows decode every prompt of the set in batches of "
         f"{s.batch_size} with the batched tree engine (untimed; every step drafts). τ = generated tokens / model "
         "forwards (greedy = 1), and `identical_to_greedy` = share of prompts whose output equals HF greedy's token "
         f"for token (greedy decoding the set in left-padded batches of {s.batch_size}; the `greedy` row is HF greedy "
         "at batch 1 against it: what batching alone changes in this dtype), both over `prompts` prompts. Speedup "
         "= tokens/s over HF greedy with KV cache at batch 1, every decoder interleaved prompt by prompt. "
         "`plain_share` = share of forwards that verified no draft (adaptive mode). Brackets: "
         "95 % bootstrap intervals over prompts (paired with greedy's for the speedup); * = the interval "
         "excludes 1.\n"),
    ]
    for name in dict.fromkeys(r["prompt_set"] for r in rows):
        lines += [f"\n## Prompt set `{name}`\n", markdown_table([r for r in rows if r["prompt_set"] == name],
                                                                 SPEED_COLUMNS)]
    if curve:
        lines += [
            "\n## Speed against batch size\n",
            (f"Each prompt set's prompts in batches of {', '.join(map(str, s.curve_batch_sizes))} ({s.curve_batches} "
             "timed batches per size, every decoder on the same batch in turn): HF batched greedy (left-padded, the "
             "reference) against each batched drafter in the batched tree engine (greedy-verified"
             f"{', adaptive with one decision state per batch size' if s.adaptive else ', every step drafting'}). "
             "Speedup = tokens/s over the reference's with its 95 % interval over the batches (* = excludes 1); "
             "`tokens_per_forward` = generated tokens / batch forwards per row; `identical_to_reference` = share of "
             "rows equal to HF batched greedy's output, token for token (half precision rounds a batch's rows "
             "differently at each batch size). A bigger batch makes a tree forward cost more plain batch steps, so "
             "drafting pays less as the batch grows; the adaptive rule measures that cost at each size.\n"),
            markdown_table(curve, CURVE_COLUMNS),
        ]
    if cost_rows:
        lines += [
            "\n## The dynamic tree's budget and depth\n",
            (f"`ms` = one forward of the policy scoring `width` tokens (root included) after a context of the median "
             f"calibration prompt plus {s.max_new_tokens // 2} tokens, median of {VERIFICATION_REPEATS} interleaved "
             "rounds (V(width)); `cost_vs_one_token` = V(width) / V(1). `tau` = tokens per cycle (accepted drafts + "
             "the bonus) a tree of `nodes` nodes drafted `depth` deep gains, from one greedy-verified decoding of "
             f"{s.dynamic_tree.calibration_prompts} training prompts with the widest tree (such a tree accepts the "
             "nodes of the path ranked below n among those no deeper than d); `draft_ms` = D(depth), the median "
             "cycle's drafting through that depth; `expected_speedup` = τ · V(1) / (F + D(depth) + V(width)), F the "
             "rest of a cycle (bookkeeping: the median cycle's time less its drafting and the widest forward). The "
             f"tree is the (`nodes`, `depth`) of the highest expected speedup: **{dynamic.budget} nodes, depth "
             f"{dynamic.depth}** (`draft_depth.csv`; by width at that depth: `verification_cost.csv`, "
             "`verification_cost.png`).\n"),
            markdown_table(depth_rows, DEPTH_COLUMNS),
            f"\nAt depth {dynamic.depth}, by width:\n",
            markdown_table(cost_rows, CALIBRATION_COLUMNS),
        ]
    lines.append("\n## Outputs that differ from greedy\n")
    if divergences.empty:
        lines.append("None: every output equals HF greedy's token for token.")
    else:
        lines += [
            ("At the first differing position, one forward of the policy over prompt + common prefix, in its dtype: "
             "`margin` = logit of greedy's token − logit of the decoder's (≈ 0: a near-tie that rounding decides), "
             "`top2_margin` = top-1 − top-2 logit, `argmax` = whose token that forward picks; `float32_*`: the same "
             "from a float32 copy of the policy.\n"),
            markdown_table(divergences.to_dict("records"), DIVERGENCE_COLUMNS),
        ]
    if rl_eval_path.is_file():
        t2 = json.loads(rl_eval_path.read_text())["t_plus_2"]
        lines += ["\n## Head 1 (predicts t + 2): supervised vs RLMedusa, held-out accuracy\n",
                  markdown_table([{"head": name, **values} for name, values in t2.items()])]
    return "\n".join(lines) + "\n"
