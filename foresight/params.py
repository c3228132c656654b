"""The params every stage process reads, and how a stage's own sections are loaded.

``params.yaml`` has one section per stage or method. A method's sections live beside its code
(``models/<method>/config.py``: one declaration per knob, :class:`models.common.config.Knobs`); the sections here are
the pipeline's own: where files go (``paths``), the prompts, validation, the launch and tracking. :data:`SECTIONS`
names every section's class by module, so a stage process imports the configs of the sections it reads and no
other (``foresight/stages.py``: a stage's code deps are what it imports); :func:`load_params` builds a config of
those sections alone, the whole file being ``foresight.config.Config``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from models.common.config import FileSourceConfig, Knobs


class ConfigError(ValueError):
    """params.yaml (or an override) is malformed; the message names the key and the allowed values."""


class PathsConfig(Knobs):
    """Where each stage reads and writes. Relative paths are resolved against the params file's folder."""

    policy_dir: Path = Path("data/policy")
    """The prepared policy: converted safetensors for the embedded model, or a manifest pointing at the source."""
    prompts_dir: Path = Path("data/prompts")
    """Prompt splits: ``train.jsonl`` (used for generation) and ``eval.jsonl`` (held out for benchmarks)."""
    samples: Path = Path("data/samples/samples.parquet")
    """Generated samples, one row per (prompt, sample)."""
    scores: Path = Path("data/labels/scores.parquet")
    """The samples with their reward score (and correctness where answers are known)."""
    pairs: Path = Path("data/pairs/pairs.parquet")
    """Validated preference pairs, one per prompt with a score spread."""
    reports_dir: Path = Path("data/reports")
    """Human-readable outputs: Great Expectations Data Docs, sample previews."""
    metrics_dir: Path = Path("data/metrics")
    """One JSON of metrics per stage, declared as DVC metrics."""
    reward_dir: Path = Path("data/reward")
    """Trained reward heads: ``base/`` (on the base policy) and ``dpo/`` (on the DPO policy), with curves."""
    dpo_dir: Path = Path("data/dpo")
    """The DPO-tuned policy (a Hugging Face folder)."""
    distill_dir: Path = Path("data/distill")
    """The policy's greedy responses that the drafters learn from (stage ``distill``): ``responses.parquet``, their
    train / held-out split (``split.safetensors``) and the prompts dropped as too long."""
    benchmarks_dir: Path = Path("data/benchmarks")
    """Benchmark tables, plots and reports."""
    medusa_dir: Path = Path("data/medusa")
    """Medusa heads: ``supervised/`` (Medusa-1) and ``rl/`` (head 1 trained by RLMedusa), with their evaluations."""
    coral_dir: Path = Path("data/coral")
    """The COrAL model (a Hugging Face folder, order-agnostic after two-stage training) with its curves."""
    mtp_dir: Path = Path("data/mtp")
    """The MTP module of the equip stage (``module/``), its depth ablation, curves and evaluation."""
    mtp_rl_dir: Path = Path("data/mtp_rl")
    """GRPO / MTP-RL results: per-step histories of every variant, the summary table, plots, the report."""


class ArithmeticConfig(Knobs):
    """Seeded arithmetic word problems with known answers (``prompts.arithmetic``)."""

    max_number: int = Field(10, ge=1, le=1_000_000)
    """Operands are drawn from 1..max_number. ≤ 10 gives real preference pairs on SmolLM2-135M
    (docs/pipeline.md#arithmetic-prompts)."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    """Operations to draw from."""
    num_operations: int = Field(1, ge=1, le=4)
    """Operations per problem (1 = one-step problems)."""
    allow_negative: bool = False
    """When false, subtractions are ordered so that every intermediate result stays ≥ 0."""


class DatasetSourceConfig(Knobs):
    """A Hugging Face dataset, loaded with ``datasets.load_dataset`` (``prompts.dataset``)."""

    name: str
    """Dataset id on the hub (e.g. ``HuggingFaceH4/ultrafeedback_binarized``) or a local dataset script/folder."""
    config: str | None = None
    """Dataset configuration name (e.g. ``main`` for gsm8k)."""
    split: str = "train"
    """Split to read prompts from."""
    text_column: str = "prompt"
    """Column holding the prompt text; a list-valued column uses its first element (MT-Bench ``turns``)."""
    answer_column: str | None = None
    """Optional column with the reference answer (enables the ``verifiable`` labeler)."""


class PromptsConfig(Knobs):
    """Prompt source and splits (stage ``prepare_prompts``)."""

    source: Literal["arithmetic", "dataset", "file"] = "arithmetic"
    """Which source to read: generated ``arithmetic`` problems, a hub ``dataset``, or a local ``file``."""
    num_train: int = Field(96, ge=1)
    """Prompts in the training split (the ones sampled from)."""
    num_eval: int = Field(40, ge=0)
    """Held-out prompts for benchmarks; never sampled from in training stages."""
    seed: int = 0
    """Seed for problem generation and for the deterministic train/eval split."""
    instruction: str | None = "End your answer with 'The answer is <number>.'"
    """Appended to every prompt that has a reference answer (all arithmetic problems; the rows of a dataset or file
    with an ``answer_column`` value), so the verifiable labeler can read the response's answer. ``null`` or empty:
    none. Prompts without a reference (UltraFeedback) never get it. Measured on SmolLM2-135M (48 default problems ×
    4 samples, docs/pipeline.md#arithmetic-prompts): with ``<number>`` 3 % of the responses copy the placeholder and
    12 % are right; with "N" 22 % copy it (11.5 % right); a concrete example ("The answer is 42.") is copied by 54 %
    and leaves 2.6 % right; no instruction 9.9 %."""
    system_prompt: str | None = None
    """Optional system message placed before the user turn in the chat template."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longest prompt kept, in tokens of the policy's chat template as generation tokenises it (system prompt
    included); ``prepare_prompts`` drops longer rows from both splits, counts them and reports the counts. ``null``
    = automatic: the policy's context (``max_position_embeddings`` of its config.json) minus
    ``generate.max_new_tokens``, and with a reward model (``label.labeler`` armorm / hf-classifier) at most
    ``label.max_length`` minus ``generate.max_new_tokens``, so that the reward model sees the whole response. A value
    above the policy's context minus ``generate.max_new_tokens`` is an error."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Settings of the arithmetic source."""
    dataset: DatasetSourceConfig | None = None
    """Settings of the dataset source (required when ``source: dataset``)."""
    file: FileSourceConfig | None = None
    """Settings of the file source (required when ``source: file``)."""

    @model_validator(mode="after")
    def _source_section_present(self) -> PromptsConfig:
        if self.source in ("dataset", "file") and getattr(self, self.source) is None:
            raise ValueError(f"source is '{self.source}' but the '{self.source}' section is missing")
        return self


class ValidateConfig(Knobs):
    """Great Expectations suites and preference-pair construction (stage ``validate``)."""

    min_score_gap: float = Field(0.0, ge=0.0)
    """A prompt yields a pair only when best − worst score exceeds this."""
    min_response_chars: int = Field(1, ge=0)
    """Responses shorter than this (after stripping) fail validation."""
    max_response_chars: int = Field(20_000, ge=1)
    """Responses longer than this fail validation."""
    min_pairs: int = Field(1, ge=1)
    """Fewer pairs than this fails the pairs suite (nothing to train on)."""
    pairing: Literal["all", "best_worst"] = "all"
    """Pairs per prompt: ``all`` = every (higher, lower) pair of its responses whose scores differ by more than
    ``min_score_gap`` (with the answer check: every (correct, incorrect) pair); ``best_worst`` = the best and the
    worst response only. Every pair carries ``best_worst`` (true for the prompt's best–worst pair) so DPO can keep
    to one pair per prompt (``dpo.pairs``)."""
    max_pairs_per_prompt: int | None = Field(None, ge=1)
    """``pairing: all``: keep at most this many pairs per prompt, the widest score gaps first (ties: the lower
    chosen, then rejected, sample index), so the best–worst pair always stays; ``null`` = no cap. Continuous scores
    (ArmoRM) make C(n, 2) pairs of n samples; ``num_pairs_uncapped`` in the stage's metrics counts them before."""


class SelfInstructConfig(Knobs):
    """How the policy writes its own instructions for the distillation (``distill.self_instruct_prompts``;
    Self-Instruct, Wang et al. 2023, §2.2: ``foresight.self_instruct``)."""

    shots: int = Field(3, ge=1)
    """Instructions of the general set's training part shown, drawn at random, in each prompt that asks for a new
    one (Self-Instruct: 8 on a 175B model; a 135M policy copies long lists)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the new instructions: variety, not quality, is what a drafter needs of its prompts."""
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    """Nucleus sampling threshold of the new instructions."""
    min_tokens: int = Field(4, ge=1)
    """Shortest instruction kept, in tokens."""
    max_tokens: int = Field(48, ge=2)
    """Longest instruction kept, in tokens (a reply is sampled to one token more, so a cut-off one is dropped)."""
    max_overlap: float = Field(0.7, gt=0.0, le=1.0)
    """An instruction is dropped when its word-set Jaccard similarity to any training or held-out instruction of
    the general set, or to one kept before it, reaches this (Self-Instruct's ROUGE-L threshold: 0.7)."""
    batch_size: int = Field(40, ge=1)
    """Instructions sampled per round (one ``generate`` batch); rounds run until enough are kept, at most
    4 × ceil(self_instruct_prompts / batch_size)."""
    seed: int = 0
    """Seeds the shots drawn and the sampling (round r: seed + r)."""


class DistillConfig(Knobs):
    """Self-distillation data (stage ``distill``): the policy's own responses that Medusa's heads, RLMedusa, COrAL
    and the MTP module learn from, and their one train / held-out split."""

    data: Literal["greedy", "samples"] = "greedy"
    """Self-distillation data: ``greedy`` = the policy's own greedy responses to the training prompts, generated
    in this stage (the text the heads will draft for under greedy verification); ``samples`` = the
    generate stage's sampled responses."""
    task_prompts: int = Field(384, ge=1)
    """``data: greedy``: how many task prompts the heads learn from — all the training prompts, then (up to this
    many in all) further prompts of the same source that are neither training nor held-out prompts
    (:func:`foresight.prompts.further_prompts`: the arithmetic source makes them, a dataset or file source gives
    its unused rows). Those further responses are for the heads alone: the MTP module, COrAL and RLMedusa learn
    from the training prompts' responses. 384 raised the heads' held-out top-1 on task text from 0.66 / 0.53 /
    0.45 / 0.41 (the 96 training prompts) to 0.73 / 0.59 / 0.52 / 0.44 (docs/medusa.md#more-task-prompts)."""
    general_prompts: int = Field(64, ge=0)
    """The first instructions of the project's general instruction set's training part (≤ 112;
    ``foresight.prompts.general_instructions``) whose greedy responses join the distillation data, so the heads
    (and the MTP module and COrAL, which train on the same responses) draft for general text too, not only for
    the task prompts; 0 = the task prompts only."""
    self_instruct_prompts: int = Field(0, ge=0)
    """How many instructions the policy writes itself (``self_instruct``; Self-Instruct §2.2,
    ``foresight.self_instruct``) whose greedy responses join the distillation data as ``prompt_set: general``
    (column ``self_instruct``), all for training: the held-out responses stay those of the task prompts and the
    hand-written instructions. 0 = none."""
    self_instruct: SelfInstructConfig = Field(default_factory=SelfInstructConfig)
    """How the policy writes those instructions: shots, sampling, the length and overlap filter, the seed."""
    max_new_tokens: int = Field(64, ge=2)
    """Longest greedy response (``data: greedy``)."""
    samples_per_prompt: int = Field(5, ge=1)
    """``data: samples``: how many of each prompt's samples to learn from (one frozen forward per sample)."""
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Share of prompts whose responses are held out for head accuracies, among the training prompts and general
    instructions (responses to further task prompts all train). COrAL and the MTP module learning from these
    responses take the same split: every drafter is measured on the same held-out sequences."""
    batch_size: int = Field(40, ge=1)
    """Prompts per batch of the greedy generation (40: 19 s per 80 prompts; 16: 29 s)."""
    seed: int = 0
    """Seed of the train / held-out split by prompt."""


class LaunchConfig(Knobs):
    """How the training stages' and generation's processes are started (section ``launch``; docs/gpu.md)."""

    num_processes: int = Field(1, ge=1)
    """1: each stage runs in its own process. > 1: every training stage, and the generate stage, runs under
    ``accelerate launch --num_processes N`` (data parallel, one process per GPU); only the first process writes
    outputs and the flow's process does the Prefect and MLflow bookkeeping. Training results depend on it (the data
    order; generation's do not), so DVC re-runs those stages when it changes."""
    accelerate_config: Path | None = None
    """An ``accelerate config`` file (YAML or JSON) for the launch, e.g. DDP over several machines; ``None``:
    accelerate's defaults for ``num_processes`` processes on this machine. Its ``distributed_type`` must be one of
    ``ACCELERATE_DISTRIBUTED_TYPES`` (data parallel: every process holds whole parameters). FSDP, DeepSpeed and the
    other sharding back-ends are refused when the config is read (:func:`check_accelerate_config`): the stages merge
    LoRA adapters, take state dicts and evaluate on whole parameters, which those back-ends shard."""


RegisteredModelName = Literal["reward-channel", "reward-channel-dpo", "medusa-heads", "mtp-module", "dpo-policy"]
"""What a run registers in the MLflow model registry (``tracking.register_models``)."""


class TrackingConfig(Knobs):
    """MLflow tracking."""

    mlflow_uri: str = "sqlite:///mlflow.db"
    """Tracking store. A relative sqlite path is resolved against the params file's folder."""
    experiment: str = "foresight"
    """MLflow experiment name."""
    preview_rows: int = Field(50, ge=0)
    """Rows of each table logged as a preview artifact."""
    register_models: list[RegisteredModelName] = Field(default_factory=lambda: list(get_args(RegisteredModelName)))
    """Trained artifacts logged as MLflow models and registered (``<experiment>-<name>``, a new version per run):
    ``reward-channel`` (and ``reward-channel-dpo``), ``medusa-heads``, ``mtp-module``, ``dpo-policy`` (a whole
    policy: 0.5 GB for the embedded model, 16 GB for an 8B one: under ``large_files: manifest`` only its manifest
    and small files are stored)."""
    large_files: Literal["manifest", "copy"] = "manifest"
    """What MLflow stores of the files over ``large_file_mb`` in every folder it logs (registered models, attached
    model folders, reports): ``manifest``: only their entries in the folder's ``dvc-manifest.json`` (path in the
    repository, size, md5 — the name of the file's object in DVC's cache — and the folder's DVC hash, as
    ``dvc.lock`` records it), so a version names its weights exactly and ``dvc checkout``/``dvc pull`` brings them
    back, without a second copy of every model (16 GB per 8B policy) beside DVC's; ``copy``: the files themselves
    too (the registry then works without the DVC repository). Smaller files are always copied."""
    large_file_mb: float = Field(64.0, gt=0)
    """Size (MB) above which a logged file is large (``large_files``). 64: every adapter, head, tokenizer and config
    of the default run is copied, its 0.5 GB policies are not; at 8B the heads (0.1–0.5 GB) are not either."""
    system_metrics: bool = True
    """MLflow's system metrics on every stage run (CPU, memory, disk, network; GPU utilisation and memory where
    ``nvidia-ml-py`` is installed)."""


SECTIONS: dict[str, str] = {
    "paths": "foresight.params:PathsConfig",
    "policy": "models.engine.config:PolicyConfig",
    "prompts": "foresight.params:PromptsConfig",
    "generate": "models.engine.config:GenerateConfig",
    "label": "models.labeling.config:LabelConfig",
    "validate": "foresight.params:ValidateConfig",
    "distill": "foresight.params:DistillConfig",
    "reward": "models.sla.config:RewardConfig",
    "dpo": "models.sla.config:DPOConfig",
    "sla": "models.sla.config:SLAConfig",
    "sla_benchmark": "models.sla.config:SLABenchmarkConfig",
    "medusa": "models.medusa.config:MedusaConfig",
    "rlmedusa": "models.medusa.config:RLMedusaConfig",
    "medusa_benchmark": "models.medusa.config:MedusaBenchmarkConfig",
    "coral": "models.coral.config:CoralConfig",
    "coral_benchmark": "models.coral.config:CoralBenchmarkConfig",
    "mtp": "models.mtp.config:MTPConfig",
    "mtp_rl": "models.mtp.config:MTPRLConfig",
    "launch": "foresight.params:LaunchConfig",
    "tracking": "foresight.params:TrackingConfig",
}
"""Every section of ``params.yaml``, in the file's order, and its class (``module:Class``), imported only when a
config with that section is built: a stage process imports the configs of its own sections alone."""

CROSS_CHECKS: dict[tuple[str, ...], str] = {
    ("medusa_benchmark", "medusa"): "models.medusa.config:tree_fits_the_heads",
    ("coral_benchmark", "coral"): "models.coral.config:decodes_what_it_learned",
}
"""Checks that relate two sections (``module:function`` taking the sections in this order, raising ValueError),
run wherever a config holds all of them whole."""

ORCHESTRATION_SECTIONS = ("paths", "launch", "tracking")
"""Sections every stage process holds whole: where its inputs and outputs lie, how it is launched, where it logs."""

ATTRIBUTE_NAMES = {"validate": "validate_"}
"""Sections whose name is a pydantic method: the config's attribute gets a trailing underscore."""


def load_reference(reference: str):
    """The object a ``module:name`` reference names (a section class, a cross check, a stage's task), imported."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def section_class(name: str) -> type[BaseModel]:
    """The class of section ``name`` (imports its module)."""
    if name not in SECTIONS:
        raise ConfigError(f"unknown params section '{name}': the sections are {', '.join(SECTIONS)}")
    return load_reference(SECTIONS[name])


class UndeclaredKeyError(AttributeError):
    """A stage read a key its stage table entry does not declare: DVC would not re-run it when the key changes."""


class Params(BaseModel):
    """A validated params file, or the sections of it one stage reads (:func:`load_params`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              populate_by_name=True)

    root: Path = Field(default=Path("."), exclude=True)
    """Folder that relative paths are resolved against (set by :func:`parse_params`, not read from YAML)."""

    def __getattr__(self, name: str) -> Any:
        section = next((key for key, attribute in ATTRIBUTE_NAMES.items() if attribute == name), name)
        if section in SECTIONS:  # a section this config was not built with: a stage's undeclared section
            raise UndeclaredKeyError(f"section {section} is not among this stage's params: declare it (or the keys "
                                     f"read) in its entry of the stage table (foresight/stages.py), so that DVC "
                                     f"re-runs the stage when it changes")
        return super().__getattr__(name)

    def path(self, relative: Path) -> Path:
        """Resolve a configured path against the params file's folder."""
        return relative if relative.is_absolute() else (self.root / relative)

    def mlflow_uri(self) -> str:
        """The tracking URI, with a relative sqlite path made absolute (against :attr:`tracking_root`)."""
        uri = self.tracking.mlflow_uri
        prefix = "sqlite:///"
        if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
            return prefix + str((self.tracking_root / uri[len(prefix):]).resolve())
        return uri

    @property
    def tracking_root(self) -> Path:
        """What relative tracking paths (the sqlite store, ``mlruns/``) resolve against: the params file's folder,
        or, in a stage of ``dvc exp run --temp`` / ``--queue`` (``DVC_EXP_NAME`` set), that folder in the repository
        the experiment came from (``DVC_ROOT``), not in the executor's temporary copy, which DVC deletes: every
        experiment's runs land in the one store. DVC runs a stage in its repository's root, the working folder."""
        dvc_root = os.environ.get("DVC_ROOT")
        if not (os.environ.get("DVC_EXP_NAME") and dvc_root):
            return self.root
        try:
            inside = self.root.resolve().relative_to(Path.cwd().resolve())
        except ValueError:  # a params file outside the repository: nothing to map
            return self.root
        return Path(dvc_root) / inside


@functools.cache
def config_class(names: tuple[str, ...]) -> type[Params]:
    """A :class:`Params` class holding the sections ``names`` (each defaulting to its class's defaults)."""
    fields: dict[str, Any] = {}
    for name in names:
        cls = section_class(name)
        attribute = ATTRIBUTE_NAMES.get(name, name)
        fields[attribute] = (cls, Field(default_factory=cls, alias=name if attribute != name else None,
                                        description=(cls.__doc__ or "").strip().split("\n")[0]))
    name = "Config" if set(names) == set(SECTIONS) else "StageConfig"
    return create_model(name, __base__=Params, __module__=__name__, **fields)


class DeclaredKeys(BaseModel):
    """The keys of one section that a stage declares (``rlmedusa.inits``), and nothing else: reading another key
    fails where it happens (:class:`UndeclaredKeyError`), naming the key and where to declare it."""

    model_config = ConfigDict(frozen=True)
    section: ClassVar[str] = ""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            return super().__getattr__(name)
        raise UndeclaredKeyError(f"{self.section}.{name} is not among this stage's params: declare it in its entry "
                                 f"of the stage table (foresight/stages.py), so that DVC re-runs the stage when it "
                                 f"changes")


@functools.cache
def _declared_class(section: str, keys: tuple[str, ...]) -> type[DeclaredKeys]:
    cls = section_class(section)
    fields = {key: (cls.model_fields[key].annotation, copy.copy(cls.model_fields[key])) for key in keys}
    view = create_model(f"{cls.__name__}Keys", __base__=DeclaredKeys, __module__=__name__, **fields)
    view.section = section
    return view


def declared_keys(section: str, value: BaseModel, keys: Iterable[str]) -> DeclaredKeys:
    """``value`` (a validated section) reduced to ``keys``."""
    keys = tuple(sorted(set(keys)))
    unknown = [key for key in keys if key not in type(value).model_fields]
    if unknown:
        raise ConfigError(f"{', '.join(f'{section}.{key}' for key in unknown)}: no such key in section '{section}'")
    return _declared_class(section, keys).model_construct(**{key: getattr(value, key) for key in keys})


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
            lines.append(f"  {key}: {e['msg']}{got}")
    return "\n".join(lines)


def _unknown_key_hints(data: dict, model: type[BaseModel], prefix: str = "") -> list[str]:
    """For every unknown key, the keys allowed at that level (pydantic's message does not list them)."""
    hints = []
    for key, value in data.items():
        field = model.model_fields.get(key) or next(
            (f for f in model.model_fields.values() if f.alias == key), None
        )
        where = f"{prefix}{key}"
        if field is None:
            allowed = sorted(f.alias or n for n, f in model.model_fields.items() if n != "root")
            hints.append(f"  {where}: allowed keys here are {', '.join(allowed)}")
        elif isinstance(value, dict) and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            hints += _unknown_key_hints(value, field.annotation, where + ".")
        elif isinstance(value, dict):  # Optional[Section]
            for arg in getattr(field.annotation, "__args__", ()):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    hints += _unknown_key_hints(value, arg, where + ".")
    return hints


def apply_overrides(data: dict, overrides: dict[str, Any] | None) -> dict:
    """Set dotted keys (``{"generate.num_samples": 3}``) on a copy of a params dict."""
    data = copy.deepcopy(data)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node[leaf] = value
    return data


ACCELERATE_DISTRIBUTED_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU")
"""The ``distributed_type`` values of an accelerate config file that the stages support: one process, or DDP (one
whole copy of the model per process, on one machine or several)."""

SHARDING_SECTIONS = ("fsdp_config", "deepspeed_config", "megatron_lm_config", "parallelism_config")
"""Sections of an accelerate config file that shard parameters (accelerate's ``ClusterConfig``); ``accelerate
config`` writes them empty for a DDP setup, so only a non-empty one is refused."""


def check_accelerate_config(cfg: Params) -> None:
    """Refuse an accelerate config file whose launch would shard parameters (FSDP, DeepSpeed ZeRO, Megatron-LM,
    tensor/context parallelism) or that does not exist: a LoRA merge (PEFT ``merge_and_unload``), a state dict taken
    for saving and every evaluation between updates would run on shards. Read the way ``accelerate launch`` reads it
    (accelerate/commands/config/config_args.py: JSON by a ``.json`` suffix, YAML otherwise)."""
    if cfg.launch.accelerate_config is None:
        return
    path = cfg.path(cfg.launch.accelerate_config)
    key = "launch.accelerate_config"
    supported = (f"supported: one process (launch.num_processes 1), DDP over launch.num_processes GPUs or CPU "
                 f"processes, or an accelerate config file whose distributed_type is one of "
                 f"{', '.join(ACCELERATE_DISTRIBUTED_TYPES)} (e.g. DDP over several machines)")
    if not path.is_file():
        raise ConfigError(f"{key}: accelerate config file {path} does not exist ({supported})")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"{key}: {path} is not a valid accelerate config file: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} is not a valid accelerate config file (expected a mapping of keys)")
    distributed = data.get("distributed_type")
    if distributed not in ACCELERATE_DISTRIBUTED_TYPES:
        raise ConfigError(f"{key}: {path} sets distributed_type {distributed!r}, which this pipeline does not "
                          f"support: LoRA merges, state dicts and evaluations need whole parameters, and FSDP / "
                          f"DeepSpeed shard them; {supported}")
    for section in SHARDING_SECTIONS:
        if data.get(section):
            raise ConfigError(f"{key}: {path} has a non-empty {section} (parameters sharded): LoRA merges, state "
                              f"dicts and evaluations need whole parameters; {supported}")


def _sections_of(keys: Iterable[str]) -> dict[str, set[str] | None]:
    """Section → the keys of it named (None: the whole section), from sections and dotted keys
    (``prompts.file.path`` names ``prompts.file``)."""
    named: dict[str, set[str] | None] = {}
    for entry in keys:
        section, _, rest = entry.partition(".")
        if not rest:
            named[section] = None
        elif named.get(section, set()) is not None:
            named.setdefault(section, set()).add(rest.split(".")[0])
    return named


def parse_params(data: dict | None, root: Path = Path("."), source: str = "params",
                 keys: Iterable[str] | None = None) -> Params:
    """Validate a params dict; raise :class:`ConfigError` naming every bad key.

    ``keys`` None: the whole file (:class:`foresight.config.Config`: unknown sections are errors). Else only the
    sections those keys name are read (imported, validated), plus :data:`ORCHESTRATION_SECTIONS`; a section named
    only by dotted keys (``rlmedusa.inits``) holds just those keys (:class:`DeclaredKeys`), and so does ``paths``
    when ``paths.X`` keys are named. Other sections of ``data`` are not looked at."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level, got {type(data).__name__}")
    named = None if keys is None else _sections_of(keys)
    names = tuple(SECTIONS) if named is None else tuple(
        name for name in SECTIONS if name in named or name in ORCHESTRATION_SECTIONS)
    unknown = [name for name in named or () if name not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown params section(s) {', '.join(unknown)}: the sections are {', '.join(SECTIONS)}")
    cls = config_class(names)
    selected = data if named is None else {key: value for key, value in data.items() if key in names}
    try:
        cfg = cls.model_validate(selected)
    except ValidationError as err:
        hints = _unknown_key_hints(selected, cls)
        msg = f"{source} is invalid:\n{_format_errors(err)}"
        if hints:
            msg += "\n" + "\n".join(hints)
        raise ConfigError(msg) from None
    for sections, check in CROSS_CHECKS.items():
        if all(name in names and (named is None or named.get(name, "") is None) for name in sections):
            try:
                load_reference(check)(*(getattr(cfg, ATTRIBUTE_NAMES.get(name, name)) for name in sections))
            except ValueError as err:
                raise ConfigError(f"{source} is invalid: {err}") from None
    cfg.root = root.resolve()
    check_accelerate_config(cfg)
    for name, section_keys in (named or {}).items():
        if section_keys is not None:
            attribute = ATTRIBUTE_NAMES.get(name, name)
            setattr(cfg, attribute, declared_keys(name, getattr(cfg, attribute), section_keys))
    return cfg


def read_params(path: str | Path) -> dict:
    """The params file at ``path`` as a dict (not validated); :class:`ConfigError` when missing or not YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"params file not found: {path.resolve()}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None,
                keys: Iterable[str] | None = None) -> Params:
    """Read ``params.yaml`` (plus dotted-key overrides) into a validated config: the whole file, or the sections
    ``keys`` name (:func:`parse_params`)."""
    path = Path(path)
    return parse_params(apply_overrides(read_params(path), overrides), root=path.parent, source=str(path), keys=keys)


def study_overrides(study: str | Path, params: str | Path) -> dict[str, Any]:
    """The values a study file (whole or partial params) sets that differ from the workspace's ``params``, as dotted
    keys → validated values (``foresight run --params study.yaml`` runs them as ``dvc exp run --set-param``).

    A key ``study`` has that ``params`` does not is an error; the keys ``study`` lacks keep ``params``' values; a
    section's key is descended into where both files hold a mapping there, else it is set whole (``prompts.file``
    given where ``params`` has ``null``). ``params`` with ``study``'s values is validated as the run will read it:
    relative paths resolve against ``params``' folder."""
    study, params = Path(study), Path(params)
    base = read_params(params)
    dotted: dict[str, Any] = {}

    def walk(node: dict, base_node: dict, prefix: str) -> None:
        for key, value in node.items():
            where = f"{prefix}{key}"
            if key not in base_node:
                raise ConfigError(f"{study}: {where} is not a key of {params} (foresight params-yaml lists them all; "
                                  f"--params FILE sets values of keys the workspace's params.yaml has)")
            if isinstance(value, dict) and isinstance(base_node[key], dict):
                walk(value, base_node[key], where + ".")
            else:
                dotted[where] = value

    walk(read_params(study), base, "")
    source = f"{study} (its values set on {params})"
    before = parse_params(base, root=params.parent, source=str(params)).model_dump(mode="json", by_alias=True)
    after = parse_params(apply_overrides(base, dotted), root=params.parent, source=source).model_dump(
        mode="json", by_alias=True)

    def at(dump: dict, key: str) -> Any:
        for part in key.split("."):
            dump = dump[part]
        return dump

    # the validated value ("1e-4" in YAML 1.1 is a string; the knob's float is what runs), and only where it changes
    return {key: at(after, key) for key in dotted if at(after, key) != at(before, key)}


PARAMS_HEADER = """\
# Foresight parameters: one section per stage or method. Generated by `foresight params-yaml > params.yaml` from
# the classes that declare each knob once (foresight/params.py lists them: models/<method>/config.py for a
# method's sections), with their defaults; a comment is the first sentence of the knob's docstring (`foresight
# check` prints them whole). tests/test_config.py fails when this file differs from the generated one: change a
# default in its class, not here. Experiments change it freely (`dvc exp run -S key=value`, or edit and
# `dvc repro`): DVC tracks each stage's own sections, so a change re-runs only the stages that read it.
"""

COMMENT_COLUMN = 33
"""Where the generated params.yaml's comments start (after a key and its value)."""
LINE_LIMIT = 120
"""The generated params.yaml's lines end by this column: a longer comment is cut at a word, with an ellipsis."""


def _first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split()).replace("``", "`")
    match = re.search(r"(?<=[^.][a-z0-9)`'\"]\.)\s(?=[A-Z(`])", text)
    return text[: match.start()] if match else text


def _yaml_value(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True)
    elif isinstance(value, Path):
        value = str(value)
    elif isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True).strip().removesuffix(
        "\n...").removesuffix("...").strip()


def _commented(line: str, comment: str) -> str:
    if not comment:
        return line
    line = line.ljust(COMMENT_COLUMN - 1) + " # "
    room = LINE_LIMIT - len(line)
    if len(comment) > room:
        comment = comment[: max(room - 1, 0)].rsplit(" ", 1)[0].rstrip(",;:") + "…"
    return (line + comment).rstrip()


def _section_lines(section: type[BaseModel], value: BaseModel, indent: str) -> list[str]:
    lines = []
    for name, field in type(value).model_fields.items():
        if field.exclude:
            continue
        key, item = field.alias or name, getattr(value, name)
        annotation_models = [arg for arg in (field.annotation, *getattr(field.annotation, "__args__", ()))
                             if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if isinstance(item, BaseModel) and annotation_models:
            lines.append(_commented(f"{indent}{key}:", _first_sentence(field.description)))
            lines += _section_lines(type(item), item, indent + "  ")
        else:
            lines.append(_commented(f"{indent}{key}: {_yaml_value(item)}", _first_sentence(field.description)))
    return lines


def render_params_yaml() -> str:
    """``params.yaml`` with every section's defaults (:data:`foresight.params.SECTIONS`' classes), each key
    commented with the first sentence of its docstring."""
    blocks = []
    for name in SECTIONS:
        cls = section_class(name)
        lines = [_commented(f"{name}:", _first_sentence(cls.__doc__))]
        blocks.append("\n".join(lines + _section_lines(cls, cls(), "  ")) + "\n")
    return PARAMS_HEADER + "\n" + "\n".join(blocks)
