"""``foresight plan``: each stage's estimated peak GPU memory, from the models' configs alone (no weights loaded).

The policy's config (the prepared weights' folder, a local folder, the HF cache or the embedded GGUF) is built
on the meta device (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``) to count parameters:
total, the embedding, the LM head (0 when tied) and, for LoRA, Σ (in + out) over the decoder's linear layers
(PEFT's ``all-linear``: r · (in + out) parameters per layer). Per stage, per GPU (assumptions, printed too):

- weights in the policy's dtype (``auto`` = bf16: the plan is for CUDA);
- trained parameters add fp32 master weights (4 B, none when the weights are fp32 already), fp32 gradients
  (4 B) and AdamW's two moments (8 B);
- full fine-tuning with a frozen reference adds a second copy of the weights (DPO without LoRA, GRPO with
  ``kl_beta`` > 0 without LoRA); with LoRA the reference is the base with its adapters disabled;
- activations ≈ sequences × tokens × hidden × layers × 34 B in 16-bit without checkpointing, 2 B with it
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.1: 34·sbh per
  layer, the 5·as²b attention-score term dropped since SDPA / flash attention never stores the scores;
  with full recomputation only each layer's 2·sbh input stays); twice that in fp32;
- full-vocabulary logits sequences × tokens × V × 4 B where a stage materialises them (training losses over
  the vocabulary; generation keeps the last position only);
- the KV cache of generation: rows × tokens × layers × 2 × kv_heads × head_dim × dtype bytes, prompts assumed
  ``prompts.max_prompt_tokens`` long (the longest kept), ``PROMPT_TOKENS`` when that is unset; the generate stage's
  batches at most ``generate.max_batch_tokens`` tokens when set (rows × (longest prompt + new tokens));
- a forward without gradients holds one layer's working set: sequences × tokens × (2 hidden + 2 intermediate)
  × dtype bytes;
- the labeler (``label.model``) counted from its config when it is on disk (ArmoRM as its native module: the Llama
  backbone and its heads, no LM head), else assumed the policy's size, where a stage runs it: ``label``,
  ``benchmark_sla``, and ``train_mtp_rl`` (its reward, beside the policy);
- under ``launch.num_processes`` N data-parallel processes each process holds a full replica and its own
  ``batch_size`` (accelerate's default ``split_batches=False``): more processes add no memory per GPU unless
  they outnumber the GPUs, and save none either. Inference stages run in one process on one GPU.

Hidden states a forward returns besides its logits: every layer's (``output_hidden_states=True``, L + 1 tensors
of sequences × tokens × hidden) only where the SLA reward channel reads them — ``train_reward``,
``train_reward_dpo`` and the SLA prefill of ``benchmark_sla``; the last layer's elsewhere (the engine's, Medusa's and
MTP's prefills: ``models.engine.speculative.last_hidden_forward``, ``base_model(...).last_hidden_state``). A training
forward's returned states are the layer inputs its backward keeps anyway (counted in its activations).

Small modules (reward channels, Medusa heads, MTP module) are counted from their configured shapes. An
estimate, not a measurement: CUDA context, allocator fragmentation and temporary buffers add a few GiB, so a
stage is flagged from ``HEADROOM`` of the GPU's memory up.

Disk, per stage (its ``disk`` function in the stage table, :attr:`foresight.stages.Stage.disk`): what the stage leaves on disk — its DVC outputs (the model folders:
the DPO policy and the COrAL model in full, the reward heads, Medusa heads and their self-distillation cache of
final hidden states, the MTP module; the tables), the Hugging Face cache's copy of a hub policy
(``prepare_policy``) and of the labeler (``label``) — and its scratch, removed when it ends (``train_mtp``'s
frozen final hidden states, in ``$TMPDIR``). Hidden states are stored in the policy's dtype; a table takes at most
``TEXT_BYTES_PER_TOKEN`` per token of its texts. Each artifact is counted once: DVC's cache *links* the
workspace's files (``cache.type`` hardlink / symlink), MLflow registers a manifest of a large file instead of a
copy, and nothing is pushed to a DVC remote in the checkout. A run's total is every stage's outputs plus the
largest scratch, compared against the free space of the checkout's filesystem (``foresight plan --disk`` sets
another budget).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from foresight.params import apply_overrides
from foresight.stages import STAGES

GIB = 2**30
PROMPT_TOKENS = 256
"""Assumed prompt length (chat template included) of the generation stages."""
HEADROOM = 0.9
"""Share of a GPU's memory a stage's estimate may take (the rest: CUDA context, fragmentation)."""
FULL_ACTIVATION_BYTES, CHECKPOINTED_ACTIVATION_BYTES = 34, 2
"""Bytes per token per hidden unit per layer in 16-bit, without and with activation checkpointing."""
TRAINED_BYTES = {"fp32 grads": 4, "AdamW moments": 8}
"""Bytes per trained parameter besides its weight and fp32 master copy."""
LORA_RANK = 16
"""The rank ``plan`` proposes when full fine-tuning does not fit."""
TEXT_BYTES_PER_TOKEN = 4
"""Bytes a table holds per token of text (about 4 characters of English per token, UTF-8, before parquet's
compression): a bound on the tables' size."""


def prompt_tokens(cfg) -> int:
    """Assumed prompt length (chat template included): ``prompts.max_prompt_tokens`` (every longer prompt is dropped
    by ``prepare_prompts``), else :data:`PROMPT_TOKENS`."""
    return cfg.prompts.max_prompt_tokens or PROMPT_TOKENS


@dataclass(frozen=True)
class ModelShape:
    """What the estimates read of a causal LM: parameter counts and the sizes of its caches and activations."""

    parameters: int
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    lora_in_out: int  # Σ (in + out) over the decoder's linear layers: LoRA rank r trains r × this
    layer_parameters: int  # one decoder layer
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_heads: int
    head_dim: int
    note: str = ""  # where the shape came from, when not from the model's own config
    checkpoint_bytes: int | None = None  # per weight in its checkpoint (config.json's dtype); None: not said


CHECKPOINT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per weight of a checkpoint by the dtype its config.json names."""


def _checkpoint_bytes(config) -> int | None:
    """Bytes per weight of the checkpoint ``config`` describes (``dtype``; ``torch_dtype`` in older files)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return CHECKPOINT_BYTES.get(str(dtype).removeprefix("torch.")) if dtype is not None else None


def model_shape(config, note: str = "", backbone_only: bool = False) -> ModelShape:
    """Count ``config``'s parameters on the meta device (no memory, no weights). ``backbone_only``: the decoder
    stack without an LM head (a reward model's backbone)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        model = (AutoModel if backbone_only else AutoModelForCausalLM).from_config(config)
    text = config.get_text_config(decoder=True)
    embedding = model.get_input_embeddings().weight
    head = embedding if backbone_only else model.get_output_embeddings().weight
    decoder_layers = model.get_decoder().layers
    lora_in_out = sum(m.in_features + m.out_features for m in decoder_layers.modules()
                      if isinstance(m, torch.nn.Linear))
    heads = text.num_attention_heads
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),  # a tied head is one parameter, counted once
        embedding=embedding.numel(),
        lm_head=0 if head is embedding else head.numel(),
        lora_in_out=lora_in_out,
        layer_parameters=sum(p.numel() for p in decoder_layers[-1].parameters()),
        hidden=text.hidden_size, intermediate=text.intermediate_size, layers=text.num_hidden_layers,
        vocab=text.vocab_size, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, note=note,
        checkpoint_bytes=_checkpoint_bytes(config))


def policy_config(cfg):
    """The policy's ``transformers`` config: the prepared weights' (manifest), a local folder's, the HF cache's
    (offline is fine once downloaded) or the embedded GGUF's."""
    from transformers import AutoConfig

    from models.engine.policy import EMBEDDED_MODELS, MANIFEST, embedded_gguf, policy_path

    spec = cfg.policy
    prepared = cfg.path(cfg.paths.policy_dir)
    manifest = prepared / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text()).get("model") == spec.model:  # not a stale one
        return AutoConfig.from_pretrained(policy_path(prepared), trust_remote_code=spec.trust_remote_code)
    if spec.model in EMBEDDED_MODELS:
        gguf = embedded_gguf(spec.model)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoConfig.from_pretrained(str(Path(spec.model).expanduser()) if Path(spec.model).expanduser().is_dir()
                                      else spec.model, revision=spec.revision,
                                      trust_remote_code=spec.trust_remote_code)


def armorm_heads(config) -> int:
    """Parameters of ArmoRM's heads over its Llama backbone, as :class:`models.labeling.armorm.ArmoRM` builds them
    from ``config`` (not imported: this module runs in every stage's process, which must not load other stages'
    code): the regression layer H → K (no bias), the frozen K × K reward transform, the gating network's
    ``gating_n_hidden`` layers H → D → … → D and its D → K output (with biases), and its logit scale."""
    objectives = getattr(config, "num_objectives", 19)
    width = getattr(config, "gating_hidden_dim", 1024)
    widths = [config.hidden_size] + [width] * getattr(config, "gating_n_hidden", 3) + [objectives]
    gating = sum(a * b + b for a, b in zip(widths, widths[1:])) + 1
    return config.hidden_size * objectives + objectives * objectives + gating


def labeler_shape(cfg, policy: ModelShape) -> ModelShape | None:
    """The labeler's shape: none for the verifiable labeler; from ``label.model``'s config when it is on disk;
    else the policy's, said so."""
    label = cfg.label
    if label.labeler == "verifiable" or not label.model:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(label.model, trust_remote_code=label.trust_remote_code)
        if label.labeler == "armorm":
            backbone = model_shape(config, backbone_only=True)
            return ModelShape(**{**backbone.__dict__, "parameters": backbone.parameters + armorm_heads(config)})
        return model_shape(config)
    except (OSError, ValueError, KeyError) as err:  # not downloaded, or no causal-LM class for its config
        assumed = f"label.model {label.model} not countable here ({type(err).__name__}): assumed the policy's size"
        return ModelShape(**{**policy.__dict__, "note": assumed})


# ---------------------------------------------------------------------------------------------------------
# the pieces of an estimate (bytes)


@dataclass
class Estimate:
    """One stage's peak: bytes by part, and the knobs that lower it, most effective first."""

    stage: str
    parts: dict[str, float] = field(default_factory=dict)
    knobs: tuple[Callable[[object], dict | None], ...] = ()  # cfg → dotted-key overrides to try, None: not useful
    note: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def dtype_bytes(name: str) -> int:
    """Bytes per weight of ``policy.dtype``; ``auto`` is bf16 on CUDA."""
    return {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}[name]


def weights(parameters: float, nbytes: int) -> float:
    return parameters * nbytes


def optimizer_state(trained: float, nbytes: int) -> float:
    """fp32 master weights (unless the weights are fp32 already), fp32 gradients and AdamW's moments."""
    return trained * ((4 if nbytes < 4 else 0) + sum(TRAINED_BYTES.values()))


def activations(shape: ModelShape, sequences: int, tokens: int, nbytes: int, checkpointing: bool,
                layers: int | None = None) -> float:
    """Korthikanti et al. 2022 §4.1: 34 B per token per hidden unit per layer in 16-bit; 2 B when checkpointed."""
    per_unit = CHECKPOINTED_ACTIVATION_BYTES if checkpointing else FULL_ACTIVATION_BYTES
    return sequences * tokens * shape.hidden * (shape.layers if layers is None else layers) * per_unit * nbytes / 2


def logits(shape: ModelShape, rows: int, tokens: int) -> float:
    """Full-vocabulary fp32 logits."""
    return rows * tokens * shape.vocab * 4


def kv_cache(shape: ModelShape, rows: int, tokens: int, nbytes: int) -> float:
    return rows * tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * nbytes


def forward_working_set(shape: ModelShape, sequences: int, tokens: int, nbytes: int) -> float:
    """One layer's transient tensors in a forward without gradients."""
    return sequences * tokens * (2 * shape.hidden + 2 * shape.intermediate) * nbytes


def all_layer_states(shape: ModelShape, sequences: int, tokens: int, nbytes: int) -> float:
    """``output_hidden_states=True``: the embeddings' output and every layer's, L + 1 tensors (what the SLA reward
    channel reads)."""
    return sequences * tokens * shape.hidden * (shape.layers + 1) * nbytes


def last_layer_states(shape: ModelShape, sequences: int, tokens: int, nbytes: int) -> float:
    """The final hidden states alone (what Medusa heads, the MTP module and the drafters read)."""
    return sequences * tokens * shape.hidden * nbytes


# ---------------------------------------------------------------------------------------------------------
# knobs: each proposes overrides from the current config (None where it cannot help any more)


def half_precision(cfg) -> dict | None:
    """fp32 policy weights → bf16 (``auto``), the standard on CUDA."""
    return {"policy.dtype": "auto"} if cfg.policy.dtype == "float32" else None


def lora(section: str) -> Callable:
    return lambda cfg: None if getattr(cfg, section).lora_rank else {f"{section}.lora_rank": LORA_RANK}


def checkpointing(section: str) -> Callable:
    return lambda cfg: (None if getattr(cfg, section).gradient_checkpointing
                        else {f"{section}.gradient_checkpointing": True})


def halve(key: str) -> Callable:
    """``section.key`` halved (down to 1)."""
    section, name = key.split(".")

    def propose(cfg):
        value = getattr(getattr(cfg, section), name)
        return {key: value // 2} if value > 1 else None
    return propose


# ---------------------------------------------------------------------------------------------------------
# the stages


@dataclass(frozen=True)
class Shapes:
    policy: ModelShape
    labeler: ModelShape | None


def _policy_training(cfg, shape: ModelShape, nbytes: int, section: str, sequences: int, tokens: int,
                     reference: bool, vocab_rows: int) -> dict[str, float]:
    """A policy trained in full or through LoRA (``section.lora_rank``), with or without a frozen reference."""
    knobs = getattr(cfg, section)
    trained = shape.lora_in_out * knobs.lora_rank if knobs.lora_rank else shape.parameters
    parts = {"weights": weights(shape.parameters, nbytes),
             ("LoRA" if knobs.lora_rank else "full") + " optimizer state": optimizer_state(trained, nbytes)}
    if reference and not knobs.lora_rank:
        parts["reference copy"] = weights(shape.parameters, nbytes)
    parts["activations" + (" (checkpointed)" if knobs.gradient_checkpointing else "")] = activations(
        shape, sequences, tokens, nbytes, knobs.gradient_checkpointing)
    parts["logits"] = logits(shape, vocab_rows, tokens)
    return parts


def _labeler_parts(cfg, shapes: Shapes) -> dict[str, float]:
    """A reward model's weights and one forward's working set (none for the verifiable labeler)."""
    if shapes.labeler is None:
        return {}
    nbytes = dtype_bytes(cfg.label.dtype)
    return {"labeler weights": weights(shapes.labeler.parameters, nbytes),
            "labeler forward": forward_working_set(shapes.labeler, cfg.label.batch_size, cfg.label.max_length, nbytes)}


def _labeler_note(shapes: Shapes) -> str:
    return shapes.labeler.note if shapes.labeler else ""


def no_gpu_memory(stage: str, cfg, shapes: Shapes, nbytes: int) -> Estimate:
    return Estimate(stage, note="no GPU")


def generate_memory(stage, cfg, shapes, nbytes):
    g, shape = cfg.generate, shapes.policy
    rows, prompt = g.batch_size * g.num_samples, prompt_tokens(cfg)
    full = rows * (prompt + g.max_new_tokens)  # a full batch's tokens: rows × (prompt + response)
    tokens = full
    if g.max_batch_tokens is not None and g.engine == "hf":
        # at most the budget, or one prompt's rows alone where they exceed it (models.engine.generation.batch_plan)
        tokens = min(full, max(g.max_batch_tokens, g.num_samples * (prompt + g.max_new_tokens)))
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "KV cache": kv_cache(shape, 1, tokens, nbytes),
                            "prefill": forward_working_set(shape, g.batch_size, prompt, nbytes) * tokens / full},
                    (halve("generate.batch_size"),))


def label_memory(stage, cfg, shapes, nbytes):
    if shapes.labeler is None:
        return Estimate(stage, note="verifiable labeler: no model")
    return Estimate(stage, _labeler_parts(cfg, shapes), (halve("label.batch_size"), halve("label.max_length")),
                    shapes.labeler.note)


def train_reward_memory(stage, cfg, shapes, nbytes):
    """The frozen policy's per-layer hidden states of both responses of each pair feed a small trained channel."""
    r, shape = cfg.reward, shapes.policy
    sequences = 2 * r.batch_size
    channel = _channel_parameters(shape, r)
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "forward": forward_working_set(shape, sequences, r.max_length, nbytes),
                            "hidden states (all layers)": all_layer_states(shape, sequences, r.max_length, nbytes),
                            "channel + optimizer": channel * 16},
                    (halve("reward.batch_size"), halve("reward.max_length")))


def dpo_memory(stage, cfg, shapes, nbytes):
    d = cfg.dpo
    parts = _policy_training(cfg, shapes.policy, nbytes, "dpo", 2 * d.batch_size, d.max_length, reference=True,
                             vocab_rows=2 * d.batch_size)
    # models.sla.dpo trains a copy and leaves the loaded policy untouched (the task evaluates both); in full
    # fine-tuning that copy is the float32 master weights the optimizer state counts, with LoRA a copy in the
    # policy's dtype
    if d.lora_rank:
        parts["training copy"] = weights(shapes.policy.parameters, nbytes)
    return Estimate(stage, parts, (lora("dpo"), checkpointing("dpo"), halve("dpo.batch_size")))


def benchmark_sla_memory(stage, cfg, shapes, nbytes):
    s, b, shape = cfg.sla, cfg.sla_benchmark, shapes.policy
    prompt = prompt_tokens(cfg)
    # untimed decoding: batch_size prompts at a time, each num_beams rows (beam search) or k^d (an SLA tree)
    rows = b.batch_size * max(b.num_beams, s.width ** max(s.depth, 1))
    # SLA's prefill runs the batch's prompts through the reward channel, which reads every layer's states
    # (models.sla.search.prefill); beam search prefills num_beams copies of each prompt
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "KV cache": kv_cache(shape, rows, prompt + b.max_new_tokens + s.step, nbytes),
                            "prefill": forward_working_set(shape, b.batch_size * b.num_beams, prompt, nbytes),
                            "hidden states (all layers)": all_layer_states(shape, b.batch_size, prompt, nbytes),
                            **_labeler_parts(cfg, shapes)},
                    (halve("sla_benchmark.batch_size"), halve("sla.width"), halve("label.batch_size")),
                    _labeler_note(shapes))


def distill_memory(stage, cfg, shapes, nbytes):
    """The greedy generation of the self-distillation data: a batch's KV cache and its prompts' prefill."""
    d, shape = cfg.distill, shapes.policy
    prompt = prompt_tokens(cfg)
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "KV cache": kv_cache(shape, d.batch_size, prompt + d.max_new_tokens, nbytes),
                            "prefill": forward_working_set(shape, d.batch_size, prompt, nbytes)},
                    (halve("distill.batch_size"),))


def train_medusa_memory(stage, cfg, shapes, nbytes):
    """Max of the frozen self-distillation pass and the heads' training on the frozen policy."""
    m, shape = cfg.medusa, shapes.policy
    heads = m.num_heads * (m.num_layers * (shape.hidden ** 2 + shape.hidden) + (shape.lm_head or shape.embedding)
                           * m.untie)
    distill = (kv_cache(shape, m.distill_batch_size, m.max_length, nbytes)
               + forward_working_set(shape, m.distill_batch_size, m.max_length, nbytes)
               + last_layer_states(shape, m.distill_batch_size, m.max_length, nbytes))
    training = heads * 16 + logits(shape, m.batch_size * m.num_heads, 1)  # fp32 heads, grads, AdamW
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes), "distillation or heads": max(
        distill, training)}, (halve("medusa.distill_batch_size"), halve("medusa.batch_size")))


def train_rlmedusa_memory(stage, cfg, shapes, nbytes):
    shape, r = shapes.policy, cfg.rlmedusa
    head = shape.hidden ** 2 + shape.hidden
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "head + optimizer": head * (2 + 16),
                            "logits": logits(shape, r.batch_size * r.num_actions, 1)}, (halve("rlmedusa.batch_size"),))


def benchmark_medusa_memory(stage, cfg, shapes, nbytes):
    b, m, shape = cfg.medusa_benchmark, cfg.medusa, shapes.policy
    heads = m.num_heads * m.num_layers * (shape.hidden ** 2 + shape.hidden)
    nodes = b.tree_size + 1 if b.tree == "auto" else len(b.tree) + 1
    prompt = prompt_tokens(cfg)
    # the greedy reference and the batched tree decoding hold a batch's cache, more than one tree at batch 1
    parts = {"weights": weights(shape.parameters, nbytes), "heads": heads * nbytes,
             "KV cache": kv_cache(shape, b.batch_size, prompt + b.max_new_tokens + nodes, nbytes),
             "prefill": forward_working_set(shape, b.batch_size, prompt, nbytes),
             "hidden states (last layer)": last_layer_states(shape, b.batch_size, prompt, nbytes),
             "batched tree logits": logits(shape, b.batch_size, nodes)}
    if {"mtp_chain", "mtp_tree"} & set(b.decoders):  # the MTP module, and its copy in the drafts' precision
        draft_bytes = 2 if b.draft_dtype == "bfloat16" else 4
        parts["MTP module"] = _mtp_module(shape) * (nbytes + (draft_bytes if draft_bytes != nbytes else 0))
    fixes = [halve("medusa_benchmark.batch_size"), halve("medusa_benchmark.tree_size")]
    if b.float32_recheck and nbytes < 4:  # a float32 copy of the policy scores the divergences from greedy
        parts["float32 recheck copy"] = weights(shape.parameters, 4)
        fixes.insert(0, lambda cfg: ({"medusa_benchmark.float32_recheck": False}
                                     if cfg.medusa_benchmark.float32_recheck else None))
    return Estimate(stage, parts, tuple(fixes))


def _coral_offsets(c) -> int:
    return c.backward_window + 1 + c.forward_window


CORAL_LOGIT_ROWS = 1024
"""Rows of vocabulary logits COrAL's training holds at once (``LOGIT_ROWS_PER_CHUNK`` of models/coral/target_aware.py;
not imported: this module runs in every stage's process, which must not load other stages' code)."""


def train_coral_memory(stage, cfg, shapes, nbytes):
    """Stage 2 (the trunk, in full or LoRA) holds the trunk's activations and the last layer's per-offset
    activations and logits; the optimizer state is the larger of stage 2's and stage 1's (the last layer)."""
    c, shape = cfg.coral, shapes.policy
    offsets = _coral_offsets(c)
    parts = _policy_training(cfg, shape, nbytes, "coral", c.batch_size, c.max_length, reference=False,
                             vocab_rows=0)
    # the per-offset losses take logits CORAL_LOGIT_ROWS rows at a time, recomputed in the backward pass
    # (models.coral.target_aware.row_cross_entropy): the chunk's logits and their gradient
    del parts["logits"]
    parts["logits (chunked)"] = 2 * logits(shape, min(CORAL_LOGIT_ROWS, c.batch_size * offsets * c.max_length), 1)
    parts["target-aware last layer"] = activations(shape, c.batch_size * offsets, c.max_length, nbytes, False,
                                                   layers=1)
    stage2 = parts.pop(next(k for k in parts if k.endswith("optimizer state")))
    parts["optimizer state (larger stage)"] = max(stage2, optimizer_state(shape.layer_parameters, nbytes))
    return Estimate(stage, parts, (lora("coral"), checkpointing("coral"), halve("coral.batch_size")))


def benchmark_coral_memory(stage, cfg, shapes, nbytes):
    b, c, shape = cfg.coral_benchmark, cfg.coral, shapes.policy
    nodes = b.block_size + b.tree_size + 1
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "KV cache": kv_cache(shape, 1, prompt_tokens(cfg) + b.max_new_tokens + nodes, nbytes),
                            "tree logits": logits(shape, nodes * _coral_offsets(c), 1)},
                    (halve("coral_benchmark.block_size"),))


def _mtp_module(shape: ModelShape) -> int:
    """One decoder layer, the 2H → H projection and two norms."""
    return shape.layer_parameters + 2 * shape.hidden * shape.hidden + 2 * shape.hidden


def train_mtp_memory(stage, cfg, shapes, nbytes):
    m, shape = cfg.mtp, shapes.policy
    module = _mtp_module(shape)
    return Estimate(stage, {"weights": weights(shape.parameters, nbytes),
                            "forward": forward_working_set(shape, m.batch_size, m.max_length, nbytes),
                            "hidden states (last layer)": last_layer_states(shape, m.batch_size, m.max_length, nbytes),
                            "module + optimizer": module * nbytes + optimizer_state(module, nbytes),
                            "module activations": activations(shape, m.batch_size * m.num_depths, m.max_length,
                                                              nbytes, False, layers=1),
                            "logits": logits(shape, m.batch_size * m.num_depths, m.max_length)},
                    (halve("mtp.batch_size"), halve("mtp.max_length")))


def _smaller_update_batches(cfg):
    """Half the rollouts of an update's micro-batch (null: a step's prompts × G in one)."""
    r = cfg.mtp_rl
    size = min(r.update_batch_size or r.prompts_per_step * r.group_size, r.prompts_per_step * r.group_size)
    return {"mtp_rl.update_batch_size": size // 2} if size > 1 else None


def _smaller_rollout_batches(cfg):
    """Half the rows of a rollout batch (null: a step's prompts × G in one)."""
    r = cfg.mtp_rl
    size = r.rollout_batch_size or r.prompts_per_step * r.group_size
    return {"mtp_rl.rollout_batch_size": size // 2} if size > 1 else None


def train_mtp_rl_memory(stage, cfg, shapes, nbytes):
    """GRPO's update over a step's rollouts (policy in full or LoRA; a reference only with kl_beta > 0), the MTP
    module and its draft copy, the KV cache of the rollouts (or of the held-out evaluation's batch), and the labeler
    scoring them when it is a reward model (held beside the policy for the whole stage)."""
    r, shape = cfg.mtp_rl, shapes.policy
    rows = r.prompts_per_step * r.group_size
    update_rows = min(r.update_batch_size or rows, rows)  # the update's micro-batch
    prompt = prompt_tokens(cfg)
    tokens = prompt + r.max_new_tokens
    parts = _policy_training(cfg, shape, nbytes, "mtp_rl", update_rows, tokens, reference=r.kl_beta > 0,
                             vocab_rows=update_rows)
    module = _mtp_module(shape)
    parts["MTP module + optimizer + draft copy"] = module * (nbytes + dtype_bytes(r.draft_dtype)) + optimizer_state(
        module, nbytes)
    # the largest batch decoded: a rollout batch, the held-out evaluation's (greedy, between the variants) or the
    # speed curves' largest; the batched speculative engine keeps rejected tree nodes as masked junk, up to half the
    # longest row (at least 64 columns) before it compacts, and appends a tree of K + 1 nodes per step
    decoded = max(r.rollout_batch_size or rows, r.eval_batch_size, max(r.curve_batch_sizes, default=0))
    parts["KV cache"] = kv_cache(shape, decoded, tokens + max(64, tokens // 2) + cfg.mtp.num_depths + 1, nbytes)
    # the batched speculative engine's prefill returns the final hidden states the MTP module drafts from
    parts["hidden states (last layer)"] = last_layer_states(shape, decoded, prompt, nbytes)
    parts |= _labeler_parts(cfg, shapes)
    knobs = (lora("mtp_rl"), checkpointing("mtp_rl"), _smaller_update_batches, halve("mtp_rl.eval_batch_size"),
             _smaller_rollout_batches, halve("mtp_rl.group_size"))
    return Estimate(stage, parts, knobs + ((halve("label.batch_size"),) if shapes.labeler else ()),
                    _labeler_note(shapes))


# ---------------------------------------------------------------------------------------------------------
# disk: what each stage leaves on disk, and its scratch


@dataclass
class Footprint:
    """One stage's disk: bytes it leaves (its outputs, a Hugging Face cache copy) and bytes of scratch it removes
    when it ends, by part."""

    stage: str
    writes: dict[str, float] = field(default_factory=dict)
    scratch: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def written(self) -> float:
        return sum(self.writes.values())

    @property
    def scratch_total(self) -> float:
        return sum(self.scratch.values())


def _text(rows: float, tokens: float) -> float:
    """A table of ``rows`` rows of ``tokens`` tokens of text each."""
    return rows * tokens * TEXT_BYTES_PER_TOKEN


def _local_folder(model: str) -> bool:
    return Path(model).expanduser().is_dir()


def _cache_copy(model: str, shape: ModelShape, fallback_bytes: int, what: str) -> tuple[dict[str, float], str]:
    """A hub model's weights in the Hugging Face cache (in its checkpoint's dtype); a local folder is read in place."""
    if _local_folder(model):
        return {}, f"{what} {model} is a local folder: read in place"
    return {f"HF cache copy of the {what}": shape.parameters * (shape.checkpoint_bytes or fallback_bytes)}, ""


def _pairs_per_prompt(cfg) -> int:
    """The most pairs ``validate`` builds per prompt: C(n, 2) with ``pairing: all`` (every score distinct), one with
    ``best_worst``, at most ``max_pairs_per_prompt``."""
    v, n = cfg.validate_, cfg.generate.num_samples
    most = 1 if v.pairing == "best_worst" else n * (n - 1) // 2
    return min(most, v.max_pairs_per_prompt or most)


def _distilled(cfg) -> tuple[int, int, int]:
    """The ``distill`` stage's self-distilled responses: their count, the further task prompts' among them (Medusa's
    heads' alone) and the longest response, in tokens (tasks/distill.py ``_distillation_data``)."""
    d, p = cfg.distill, cfg.prompts
    if d.data == "greedy":
        further = max(0, d.task_prompts - p.num_train)
        return p.num_train + further + d.general_prompts + d.self_instruct_prompts, further, d.max_new_tokens
    count = (p.num_train * min(d.samples_per_prompt, cfg.generate.num_samples) + d.general_prompts
             + d.self_instruct_prompts)
    return count, 0, max(cfg.generate.max_new_tokens, d.max_new_tokens)


def _channel_parameters(shape: ModelShape, r) -> int:
    """The SLA reward channel: the input projection, one (H + h) → h projection per layer and the head."""
    width = shape.hidden + r.hidden_size
    return shape.hidden * r.hidden_size + shape.layers * width * r.hidden_size + width


def _adapter_parameters(shape: ModelShape, r, layers: int) -> int:
    """models.sla.reward_transformer.FinalStateAdapter: ``layers`` − 1 SiLU layers H → h → … → h, then one
    to a scalar."""
    widths = [shape.hidden] + [r.hidden_size] * (layers - 1) + [1]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def _medusa_heads(cfg, shape: ModelShape) -> int:
    m = cfg.medusa
    return m.num_heads * (m.num_layers * (shape.hidden ** 2 + shape.hidden) + (shape.lm_head or shape.embedding)
                          * m.untie)


def prepare_policy_disk(stage, cfg, shapes, nbytes):
    from models.engine.policy import EMBEDDED_MODELS

    shape = shapes.policy
    if cfg.policy.model in EMBEDDED_MODELS:  # de-quantised once into the policy folder, in float32
        return Footprint(stage, {"float32 weights converted from the GGUF": shape.parameters * 4})
    writes, note = _cache_copy(cfg.policy.model, shape, nbytes, "policy")
    return Footprint(stage, writes, note=note)


def prepare_prompts_disk(stage, cfg, shapes, nbytes):
    p = cfg.prompts
    return Footprint(stage, {"prompt tables": _text(p.num_train + p.num_eval, 2 * prompt_tokens(cfg))})


def _sample_rows(cfg) -> tuple[int, int]:
    """The samples table: its rows and each row's tokens of text (question, prompt, response)."""
    g = cfg.generate
    return cfg.prompts.num_train * g.num_samples, 2 * prompt_tokens(cfg) + g.max_new_tokens


def generate_disk(stage, cfg, shapes, nbytes):
    return Footprint(stage, {"samples table": _text(*_sample_rows(cfg))})


def label_disk(stage, cfg, shapes, nbytes):
    writes = {"scores table": _text(*_sample_rows(cfg))}
    note = ""
    if shapes.labeler is not None:
        copy, note = _cache_copy(cfg.label.model, shapes.labeler, dtype_bytes(cfg.label.dtype), "labeler")
        writes |= copy
    return Footprint(stage, writes, note=note)


def validate_disk(stage, cfg, shapes, nbytes):
    pairs = cfg.prompts.num_train * _pairs_per_prompt(cfg)
    return Footprint(stage, {"pairs table": _text(pairs, 2 * prompt_tokens(cfg) + 2 * cfg.generate.max_new_tokens)})


def train_reward_disk(stage, cfg, shapes, nbytes):
    r, shape = cfg.reward, shapes.policy
    adapters = sum(_adapter_parameters(shape, r, layers) for layers in r.adapter_layers)
    return Footprint(stage, {"reward channel": _channel_parameters(shape, r) * nbytes,
                             "adapter baselines": adapters * nbytes})


def dpo_disk(stage, cfg, shapes, nbytes):
    # models.sla.dpo saves the whole trained policy (LoRA adapters merged), in the policy's dtype
    return Footprint(stage, {"DPO policy": shapes.policy.parameters * nbytes})


def _outputs(cfg, rows: int, new_tokens: int) -> dict[str, float]:
    """A benchmark's outputs table: ``rows`` decoded prompts (prompt and output text)."""
    return {"outputs tables": _text(rows, prompt_tokens(cfg) + new_tokens)}


def benchmark_sla_disk(stage, cfg, shapes, nbytes):
    b = cfg.sla_benchmark
    rows = b.num_prompts * (len(b.decoders) + len(b.dpo_decoders)) + b.tuning_prompts * len(b.tuning_grid)
    return Footprint(stage, _outputs(cfg, rows, b.max_new_tokens))


def distill_disk(stage, cfg, shapes, nbytes):
    responses, _, longest = _distilled(cfg)
    return Footprint(stage, {"responses table": _text(responses, 2 * prompt_tokens(cfg) + longest)})


def train_medusa_disk(stage, cfg, shapes, nbytes):
    m, shape = cfg.medusa, shapes.policy
    responses, _, longest = _distilled(cfg)
    positions = responses * longest  # response tokens, at most
    return Footprint(stage, {
        "Medusa heads": _medusa_heads(cfg, shape) * nbytes,
        "final hidden states (distillation cache)": last_layer_states(shape, positions, 1, nbytes),
        "targets": positions * (m.num_heads + 1) * 8})


def train_rlmedusa_disk(stage, cfg, shapes, nbytes):
    r, shape = cfg.rlmedusa, shapes.policy
    width = r.reward_width
    reward = (2 * shape.hidden) * width + width + width * width + width + width + 1 + 4 * shape.hidden  # + norms
    return Footprint(stage, {"RL heads": len(r.inits) * _medusa_heads(cfg, shape) * nbytes,
                             "reward model r(e, h) (float32)": reward * 4})


def benchmark_medusa_disk(stage, cfg, shapes, nbytes):
    b = cfg.medusa_benchmark
    return Footprint(stage, _outputs(cfg, (b.num_prompts + b.general_prompts) * len(b.decoders), b.max_new_tokens))


def train_coral_disk(stage, cfg, shapes, nbytes):
    # tasks/coral.py saves the whole model (stage 1's last layer, stage 2's adapters merged), in the policy's dtype
    return Footprint(stage, {"COrAL model": shapes.policy.parameters * nbytes})


def benchmark_coral_disk(stage, cfg, shapes, nbytes):
    b = cfg.coral_benchmark
    return Footprint(stage, _outputs(cfg, b.num_prompts * (2 + len(b.ablations)), b.max_new_tokens))


def train_mtp_disk(stage, cfg, shapes, nbytes):
    """The MTP module; the frozen policy's final hidden states of every training sequence (prompt and response,
    ``mtp.max_length`` at most), in a scratch folder of ``$TMPDIR`` removed when the stage ends (tasks/mtp.py)."""
    m, shape = cfg.mtp, shapes.policy
    if m.data == "distilled":
        responses, further, longest = _distilled(cfg)
        sequences = responses - (0 if m.further_prompts else further)
    else:  # the samples labeled correct, at most every sample
        sequences, longest = cfg.prompts.num_train * cfg.generate.num_samples, cfg.generate.max_new_tokens
    tokens = min(m.max_length, prompt_tokens(cfg) + longest)
    return Footprint(stage, {"MTP module": _mtp_module(shape) * nbytes},
                     {"final hidden states (in $TMPDIR)": last_layer_states(shape, sequences, tokens, nbytes)})


def train_mtp_rl_disk(stage, cfg, shapes, nbytes):
    return Footprint(stage, note="histories and tables only (no model is saved)")


@dataclass
class DiskPlan:
    """Every stage's footprint, the run's total (all outputs + the largest scratch) against a budget."""

    footprints: list[Footprint]
    budget: float  # bytes
    source: str  # where the budget came from

    @property
    def outputs(self) -> float:
        return sum(f.written for f in self.footprints)

    @property
    def largest_scratch(self) -> Footprint:
        return max(self.footprints, key=lambda f: f.scratch_total)

    @property
    def total(self) -> float:
        return self.outputs + self.largest_scratch.scratch_total

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def biggest(self, count: int = 3) -> list[Footprint]:
        return sorted(self.footprints, key=lambda f: f.written + f.scratch_total, reverse=True)[:count]


def disk_plan(cfg, shapes: Shapes, budget_gib: float | None = None, stages: Iterable | None = None) -> DiskPlan:
    """Each stage's disk footprint against ``budget_gib`` (default: the free space of the checkout's filesystem,
    the folder of the params file)."""
    footprints = []
    for stage in STAGES if stages is None else stages:
        footprints.append(globals()[stage.disk](stage.name, cfg, shapes, dtype_bytes(cfg.policy.dtype)))
    if budget_gib is not None:
        return DiskPlan(footprints, budget_gib * GIB, "--disk")
    return DiskPlan(footprints, shutil.disk_usage(cfg.root).free, f"free on the filesystem of {cfg.root}")


def render_disk(disk: DiskPlan) -> str:
    """The disk plan as a text table, the run's total and the verdict."""
    header = f"{'stage':<18} {'written':>8} {'scratch':>8}  breakdown (GiB)"
    lines = ["Disk (GiB), each artifact counted once: DVC's cache linked to the workspace (cache.type hardlink / "
             "symlink), MLflow registering a manifest of each large file instead of a copy, no push to a DVC remote "
             "in the checkout", header, "-" * len(header)]
    for f in disk.footprints:
        parts = {**f.writes, **f.scratch}
        breakdown = ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts.items())
        breakdown = "; ".join(part for part in (breakdown, f.note) if part)
        lines.append(f"{f.stage:<18} {f.written / GIB:>8.1f} {f.scratch_total / GIB:>8.1f}  {breakdown}")
    scratch = disk.largest_scratch
    verdict = "fits" if disk.fits else ("DOES NOT FIT; the biggest stages: " + ", ".join(
        f"{f.stage} {(f.written + f.scratch_total) / GIB:.1f}" for f in disk.biggest()))
    lines += ["", f"Run total: {disk.total / GIB:.1f} GiB (outputs {disk.outputs / GIB:.1f} + the largest scratch "
              f"{scratch.scratch_total / GIB:.1f}, {scratch.stage}) against {disk.budget / GIB:.1f} GiB "
              f"({disk.source}): {verdict}",
              f"Text tables at {TEXT_BYTES_PER_TOKEN} B per token; a re-run of a stage with other params keeps the "
              "old outputs in DVC's cache until `dvc gc`."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# the plan


@dataclass
class StagePlan:
    estimate: Estimate
    per_gpu: float  # bytes on each GPU (processes sharing a GPU counted together)
    fits: bool
    fix: dict | None  # overrides that make it fit, when it does not


def stage_estimate(stage, cfg, shapes: Shapes) -> Estimate:
    """The stage's GPU memory by its ``memory`` function in the stage table (:attr:`foresight.stages.Stage.memory`)."""
    return globals()[stage.memory](stage.name, cfg, shapes, dtype_bytes(cfg.policy.dtype))


def _per_gpu(stage, cfg, estimate: Estimate, gpus: int) -> float:
    """Data-parallel processes beyond the GPUs share them."""
    sharing = math.ceil(cfg.launch.num_processes / gpus) if stage.distributed else 1
    return estimate.total * sharing


def _with(cfg, overrides: dict):
    """``cfg`` with dotted-key overrides, validated again as the same class (a stage's config stays a stage's)."""
    dumped = {field.alias or name: getattr(cfg, name).model_dump(mode="json", by_alias=True)
              for name, field in type(cfg).model_fields.items() if not field.exclude}
    trial = type(cfg).model_validate(apply_overrides(dumped, overrides))
    trial.root = cfg.root
    return trial


def _fix(stage, cfg, shapes: Shapes, capacity: float, gpus: int) -> dict | None:
    """Overrides that make the stage fit: the knobs in order, each kept once tried (bf16 weights, LoRA, then
    checkpointing, then smaller batches), and ``launch.num_processes`` down to the GPUs."""
    overrides: dict = {}
    if stage.distributed and cfg.launch.num_processes > gpus:
        overrides["launch.num_processes"] = gpus
    trial = _with(cfg, overrides)
    for _ in range(32):
        estimate = stage_estimate(stage, trial, shapes)
        if _per_gpu(stage, trial, estimate, gpus) <= capacity:
            return overrides
        proposal = next((p for p in (knob(trial) for knob in (half_precision, *estimate.knobs)) if p), None)
        if proposal is None:
            return None
        overrides.update(proposal)
        trial = _with(cfg, overrides)
    return None


def plan(cfg, capacity_gib: float, gpus: int, stages: Iterable | None = None,
         shapes: Shapes | None = None) -> list[StagePlan]:
    """Every stage's estimate against ``capacity_gib`` per GPU (×``HEADROOM``) on ``gpus`` GPUs."""
    if shapes is None:
        policy = model_shape(policy_config(cfg))
        shapes = Shapes(policy, labeler_shape(cfg, policy))
    capacity = capacity_gib * GIB * HEADROOM
    plans = []
    for stage in STAGES if stages is None else stages:
        estimate = stage_estimate(stage, cfg, shapes)
        per_gpu = _per_gpu(stage, cfg, estimate, gpus)
        fits = per_gpu <= capacity
        plans.append(StagePlan(estimate, per_gpu, fits, None if fits else _fix(stage, cfg, shapes, capacity, gpus)))
    return plans


def _value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def render(plans: list[StagePlan], shape: ModelShape, cfg, capacity_gib: float, gpus: int, source: str) -> str:
    """The plan as a text table, its assumptions after it."""
    lines = [f"policy {cfg.policy.model}: {shape.parameters / 1e9:.2f} B parameters (embedding "
             f"{shape.embedding / 1e9:.2f} B, LM head {shape.lm_head / 1e9:.2f} B), {shape.layers} layers, hidden "
             f"{shape.hidden}, vocab {shape.vocab}; dtype {cfg.policy.dtype} ({dtype_bytes(cfg.policy.dtype)} B)",
             f"GPUs: {gpus} × {capacity_gib:.1f} GiB ({source}); a stage fits under {HEADROOM:.0%} of one; "
             f"launch.num_processes {cfg.launch.num_processes}", ""]
    header = f"{'stage':<18} {'GiB':>7}  {'fits':<4}  breakdown (GiB) / knob"
    lines += [header, "-" * len(header)]
    for p in plans:
        e = p.estimate
        breakdown = ", ".join(f"{name} {size / GIB:.1f}" for name, size in e.parts.items()) or e.note
        fits = "yes" if p.fits else "NO"
        lines.append(f"{e.stage:<18} {p.per_gpu / GIB:>7.1f}  {fits:<4}  {breakdown}")
        if e.note and e.parts:
            lines.append(f"{'':<33}note: {e.note}")
        if not p.fits:
            knob = (", ".join(f"{k}: {_value(v)}" for k, v in p.fix.items()) if p.fix
                    else "nothing configurable makes it fit: more GPU memory, or a smaller model")
            lines.append(f"{'':<33}-> {knob}")
    lines += ["", "Assumptions: weights in the policy dtype; trained parameters + fp32 master (4 B) + fp32 grads (4 B) "
              "+ AdamW (8 B); full-FT references a second copy (LoRA: adapters disabled); activations 34 B (2 B "
              "checkpointed) per token × hidden × layer (Korthikanti et al. 2022); fp32 vocabulary logits where "
              f"materialised; hidden states of every layer only where the SLA reward channel reads them, else the last "
              f"layer's; KV cache at {prompt_tokens(cfg)} prompt tokens (prompts.max_prompt_tokens, else "
              f"{PROMPT_TOKENS}) + new tokens; per-process batch = batch_size."]
    return "\n".join(lines)


def visible_gpus() -> list[float]:
    """Total memory (GiB) of each visible CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.mem_get_info(i)[1] / GIB for i in range(torch.cuda.device_count())]


class WillNotFitError(MemoryError):
    """A stage's estimated peak memory exceeds the GPU it would run on; the message names the knob."""


def preflight(stage, cfg, gpu_memory_gib: list[float]) -> None:
    """Before a stage starts: fail when its estimate does not fit the smallest of ``gpu_memory_gib`` (the visible
    GPUs; none: nothing to check), naming the knobs that would make it fit. A policy whose config cannot be read
    yet (``prepare_policy`` has not run) is not checked."""
    if not gpu_memory_gib:
        return
    try:
        policy = model_shape(policy_config(cfg))
    except (OSError, ValueError):
        return
    (stage_plan,) = plan(cfg, min(gpu_memory_gib), len(gpu_memory_gib), [stage],
                         Shapes(policy, labeler_shape(cfg, policy)))
    if stage_plan.fits:
        return
    knob = (", ".join(f"{k}: {_value(v)}" for k, v in stage_plan.fix.items()) if stage_plan.fix
            else "nothing configurable: more GPU memory or a smaller model")
    raise WillNotFitError(
        f"stage {stage.name} needs an estimated {stage_plan.per_gpu / GIB:.1f} GiB per GPU "
        f"({', '.join(f'{k} {v / GIB:.1f}' for k, v in stage_plan.estimate.parts.items())}), more than "
        f"{HEADROOM:.0%} of {min(gpu_memory_gib):.0f} GiB; set {knob} (`foresight plan` shows every stage)")
