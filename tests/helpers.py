"""Helpers several test files share: this module is the only place tests import them from (a test module never
imports another's), beside tests/tiny.py, which builds the tiny random models.

- the environment of the CLI, DVC and git processes a test starts in a repository of its own;
- speculative decoding: a hand-built draft tree, HF greedy decoding as the lossless reference, a bf16 tolerance
  for near-ties, Pearson's chi-square test against exact distributions, a perturbed MTP module (drafts sometimes
  right), random prompts and a drafter wrapper that records every draft;
- training data: hand-made DPO pairs, a response of an exact token length, distinct COrAL sequences;
- ArmoRM's published forward (RLHFlow/ArmoRM-Llama3-8B-v0.1, ``modeling_custom.py``), transcribed from raw
  checkpoint tensors: the reference the native loader is checked against;
- pipeline runs: a params dict for a fast, complete pipeline on a tiny model, a committed git + DVC repository
  with this project's code, and the ``train_mtp_rl`` stage with what it reads in place.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
import yaml
from safetensors.torch import load_file
from scipy.stats import chisquare
from transformers import AutoTokenizer, LlamaConfig, LlamaModel

from foresight.pairs import PAIR_COLUMNS
from models.engine.generation import chat_prompts
from models.mtp.module import MTPModule, MTPModuleConfig
from models.sla.config import DPOTraining
from tests.tiny import load_spiky_tiny_llama

# ---------------------------------------------------------------------------------------------------------
# processes a test starts


def subprocess_env(**settings: str) -> dict[str, str]:
    """The environment of the CLI, DVC and git processes a test starts: this process's — where tests/conftest.py
    set the offline and telemetry-off variables (``HF_HUB_OFFLINE``, ``DO_NOT_TRACK``, ``DVC_NO_ANALYTICS`` …)
    before anything was imported — with the venv's ``bin`` first on ``PATH`` (DVC runs each stage's command through
    a shell, whose ``python`` and ``dvc`` must be this venv's), a git identity for the commits, no parent MLflow run
    (``FORESIGHT_MLFLOW_PARENT_RUN_ID``: an earlier in-process run would become the parent of the processes'
    runs) and no Prefect API (``PREFECT_API_*``: a test names its own in ``settings``, else each process starts a
    temporary one), then ``settings``."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PREFECT_API_") and key != "FORESIGHT_MLFLOW_PARENT_RUN_ID"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               GIT_AUTHOR_NAME="test", GIT_AUTHOR_EMAIL="test@example.com", GIT_COMMITTER_NAME="test",
               GIT_COMMITTER_EMAIL="test@example.com")
    env.update(settings)
    return env


# ---------------------------------------------------------------------------------------------------------
# speculative decoding

# root ─┬─ (0,) ─┬─ (0,0) ── (0,0,0)
#       │        └─ (0,1)
#       └─ (1,) ── (1,0)
CHOICES = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def hf_greedy(model, ids: torch.Tensor, max_new_tokens: int, eos: set[int]) -> list[int]:
    """HF greedy ``generate``'s new tokens for one prompt (1, L), up to the first end token included."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(eos) or None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    return out[: next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


def assert_agrees_up_to_ties(model, ids: torch.Tensor, tokens: list[int], reference: list[int]) -> None:
    """Equal to greedy, or first differing where greedy's own logits nearly tie the two tokens: in bf16 a tree
    forward and a one-token forward round differently, so a near-tie may break the other way."""
    if tokens == reference:
        return
    i = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    common = torch.tensor(reference[:i], dtype=torch.long, device=ids.device)  # long even when empty
    logits = model(input_ids=torch.cat([ids[0], common])[None]).logits[0, -1]
    logits = logits.float()
    assert logits[tokens[i]] >= logits.max() - 0.02 * logits.abs().max(), (i, tokens[i], reference[i])


def bf16_tiny(tiny_llama: Path, device: str):
    """The spiky tiny Llama (:func:`tests.tiny.load_spiky_tiny_llama`) in bf16 on ``device``."""
    return load_spiky_tiny_llama(tiny_llama, dtype=torch.bfloat16).to(device)


def chi_square_p(counts: dict, expected: dict, draws: int) -> float:
    """Pearson's test of observed counts against exact probabilities, rare outcomes pooled into one cell."""
    keys = [k for k, p in expected.items() if p * draws >= 5]
    observed = [counts.get(k, 0) for k in keys] + [draws - sum(counts.get(k, 0) for k in keys)]
    wanted = [expected[k] * draws for k in keys] + [draws * (1 - sum(expected[k] for k in keys))]
    if wanted[-1] < 1e-9:
        observed, wanted = observed[:-1], wanted[:-1]
    scale = sum(observed) / sum(wanted)
    return float(chisquare(observed, [w * scale for w in wanted]).pvalue)


def perturbed_module(model, num_depths: int, scale: float = 0.3, seed: int = 0) -> MTPModule:
    """A module whose drafts are sometimes right, sometimes wrong (a fresh copy of the last layer would mostly
    repeat the model's own guesses)."""
    module = MTPModule(model, MTPModuleConfig(num_depths=num_depths)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))
    return module.requires_grad_(False)


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` random prompts of 2 to 19 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 20, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class RecordingBatchDrafter:
    """Wraps a batch drafter and records every row's draft tokens per cycle, by prompt."""

    def __init__(self, inner):
        self.inner, self.tree = inner, inner.tree

    def start(self, prompts, hidden, roots):
        self.rows, self.drafts = list(range(len(prompts))), [[] for _ in prompts]
        self.inner.start(prompts, hidden, roots)

    def propose(self, roots):
        tokens, probs = self.inner.propose(roots)
        for row, prompt in enumerate(self.rows):
            self.drafts[prompt].append(tokens[row, 1:].tolist())
        return tokens, probs

    def accept(self, hidden, tokens):
        self.inner.accept(hidden, tokens)

    def keep(self, rows):
        self.rows = [self.rows[i] for i in rows.tolist()]
        self.inner.keep(rows)


# ---------------------------------------------------------------------------------------------------------
# training data

# A learning rate far above the real one, so a handful of steps visibly moves the tiny model.
DPO_FAST = DPOTraining(learning_rate=1e-3, epochs=2, batch_size=2, max_length=128, seed=0)


def make_pairs(tokenizer, n: int) -> pd.DataFrame:
    """``n`` hand-made pairs in the pipeline's format: templated prompt, right vs wrong answer."""
    questions = [f"Ben has {i} apples. Ava gives Ben 2 more apples. How many apples does Ben have now?"
                 for i in range(1, n + 1)]
    rows = [{
        "prompt_id": f"p{i}", "question": q, "prompt": prompt, "answer": str(i + 2),
        "chosen": f"Ben has {i} + 2 = {i + 2} apples. The answer is {i + 2}.", "rejected": f"The answer is {i}.",
        "chosen_score": 1.0, "rejected_score": 0.0, "score_gap": 1.0,
        "chosen_sample_id": f"p{i}/0", "rejected_sample_id": f"p{i}/1", "best_worst": True,
    } for i, (q, prompt) in enumerate(zip(questions, chat_prompts(tokenizer, questions)), start=1)]
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def long_response(tokenizer, tokens: int) -> str:
    """A response of exactly ``tokens`` tokens (without its end token) in ``tokenizer``."""
    base = len(tokenizer("Ben has", add_special_tokens=False)["input_ids"])
    text = "Ben has" + " apples" * (tokens - base)
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == tokens
    return text


def distinct_sequences(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``count`` sequences of 4 prompt + 10 response tokens, distinct within each sequence (tiny vocabulary ids
    3 … 252): a 1-token patch replaced by another position's token always changes, so with corruption ratio 1
    every sequence has as many reconstruction targets as any other."""
    generator = torch.Generator().manual_seed(seed)
    return [((torch.randperm(250, generator=generator)[:14] + 3).tolist(), [0] * 4 + [1] * 10) for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------
# ArmoRM's published forward (LlamaForRewardModelWithGating, RLHFlow/ArmoRM-Llama3-8B-v0.1, modeling_custom.py)

# modeling_custom.py: token_pattern = tokenizer.encode("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
# add_special_tokens=False) = [128009, 128006, 78191, 128007, 271] with Llama-3's tokenizer
REFERENCE_PATTERN_TEXT = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded checkpoint, read shard by shard through its index."""
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(load_file(folder / shard))
    assert tensors.keys() == weight_map.keys()
    return tensors


def find_token_for_gating(lst: list[int], token_pattern: list[int]) -> int:
    """modeling_custom.find_token_for_gating (the pattern is a module global there)."""
    token_pattern_len = len(token_pattern)
    for j in range(len(lst) - token_pattern_len, -1, -1):
        if lst[j:j + token_pattern_len] == token_pattern:
            return j
    raise ValueError("Token pattern not found in the list.")


def reference_armorm_forward(folder: Path, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             pad_token_id: int, transform_transposed: bool = False,
                             temperature: float | None = None) -> dict[str, torch.Tensor]:
    """LlamaForRewardModelWithGating.forward, op by op, on a plain LlamaModel and the raw head tensors.

    ``transform_transposed`` / ``temperature`` are the negative controls: a wrong transform or temperature.
    """
    tensors = read_checkpoint(folder)
    config_dict = json.loads((folder / "config.json").read_text())
    backbone = LlamaModel(LlamaConfig.from_pretrained(folder, attn_implementation="eager")).eval()
    backbone.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")},
                             strict=True)
    token_pattern = AutoTokenizer.from_pretrained(folder).encode(REFERENCE_PATTERN_TEXT, add_special_tokens=False)
    with torch.no_grad():
        tokens_hidden_states = backbone(input_ids, attention_mask=attention_mask)[0]
        # pooling exactly as published: the token before the first pad id (mod T when there is none)
        sequence_lengths = torch.eq(input_ids, pad_token_id).int().argmax(-1) - 1
        sequence_lengths = sequence_lengths % input_ids.shape[-1]
        dummy_iterator = torch.arange(input_ids.shape[0])
        hidden_states = tokens_hidden_states[dummy_iterator, sequence_lengths]
        rewards = hidden_states @ tensors["regression_layer.weight"].T  # (B, K)
        gating_token_positions = [find_token_for_gating(ids.tolist(), token_pattern) for ids in input_ids]
        x = tokens_hidden_states[dummy_iterator, gating_token_positions, :]
        n_layers = config_dict["gating_n_hidden"] + 1
        for i in range(n_layers):
            x = x @ tensors[f"gating.layers.{i}.weight"].T + tensors[f"gating.layers.{i}.bias"]
            x = torch.relu(x) if i < n_layers - 1 else x
        x = torch.softmax(x / (temperature or config_dict["gating_temperature"]), dim=1)
        gating_output = x * tensors["gating.logit_scale"][0]
        transform = tensors["reward_transform_matrix"]
        rewards_adjusted = rewards @ (transform.T if transform_transposed else transform)
        score = torch.sum(gating_output * rewards_adjusted, dim=1)
    return {"score": score, "rewards": rewards, "gating": gating_output}


# ---------------------------------------------------------------------------------------------------------
# pipeline runs: a tiny params dict, a committed git + DVC repository, the train_mtp_rl stage in place
# (the project's config, stage and task modules are imported where they are used: files that only decode or
# train a module, most of those importing this one, need not load the pipeline)

REPO = Path(__file__).resolve().parent.parent


def tiny_params(root: Path, model: Path, **sections) -> dict:
    """A params dict for a fast run on the tiny model under ``root`` (a small, complete pipeline)."""
    params = {
        # float32: the tests prove exact token-for-token identity with greedy, a float32 property (bf16 rounds a
        # multi-token forward differently from a one-token one); the default run's bf16 is measured by its benchmarks
        "policy": {"model": str(model), "device": "cpu", "dtype": "float32"},
        "label": {"dtype": "float32"},
        "prompts": {"num_train": 6, "num_eval": 2, "seed": 0},
        "generate": {"num_samples": 3, "max_new_tokens": 12, "batch_size": 4, "seed": 0},
        "tracking": {"mlflow_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "test"},
        "reward": {"hidden_size": 16, "epochs": 1, "batch_size": 2, "max_length": 256, "learning_rate": 1e-3},
        "dpo": {"epochs": 1, "batch_size": 2, "max_length": 256},
        "sla": {"depth": 2, "width": 2, "step": 3},
        "sla_benchmark": {"num_prompts": 2, "speed_prompts": 2, "max_new_tokens": 8, "overhead_repeats": 4},
        "distill": {"task_prompts": 8, "general_prompts": 2, "batch_size": 4},
        "medusa": {"num_heads": 2, "epochs": 1, "batch_size": 16, "distill_batch_size": 4, "mixed_precision": "no"},
        "rlmedusa": {"trajectory_tokens": 4, "top_pool": 10, "reward_width": 16, "reward_epochs": 1,
                     "num_actions": 4, "batch_size": 8},
        "medusa_benchmark": {"tree": [[0], [1], [0, 0]], "num_prompts": 2, "speed_prompts": 2, "general_prompts": 2,
                             "max_new_tokens": 8, "curve_batch_sizes": [1, 2], "curve_batches": 2,
                             "decoders": ["greedy", "prompt_lookup", "medusa_supervised", "medusa_rl"]},
        "coral": {"stage1_epochs": 1, "stage2_epochs": 1, "batch_size": 4, "max_length": 256, "mixed_precision": "no"},
        "coral_benchmark": {"block_size": 6, "num_prompts": 2, "speed_prompts": 2, "max_new_tokens": 8,
                            "ablations": ["no_verifier", "no_multi_forward"], "ablation_block_sizes": [3],
                            "ablation_forward_windows": [2]},
        "mtp": {"num_depths": 2, "ce_weights": [0.6, 0.4], "epochs": 1, "batch_size": 4, "max_length": 256,
                "ablation_depths": [1], "mixed_precision": "no"},
        "mtp_rl": {"steps": 1, "group_size": 2, "max_new_tokens": 6, "eval_prompts": 2,
                   "variants": ["vanilla", "mtp_rl", "frozen_mtp", "ce_only", "no_backprop"],
                   "curve_batch_sizes": [1, 2], "curve_batches": 2},
    }
    for name, values in sections.items():
        params.setdefault(name, {}).update(values)
    return params


def project_cache_type() -> str:
    """``cache.type`` of this project's ``.dvc/config`` (how DVC links outputs to its cache)."""
    config = configparser.ConfigParser()
    config.read(REPO / ".dvc" / "config")
    return config.get("cache", "type", fallback="reflink,copy")  # DVC's default


def make_dvc_repo(repo: Path, params: dict, env: dict, remote: Path | None = None) -> None:
    """A committed git + DVC repository at ``repo`` with this project's code, ``dvc.yaml`` and ``params`` (written
    resolved: DVC reads params.yaml itself, and the config's defaults are invisible to it) and this project's DVC
    cache links (``cache.type`` of ``.dvc/config``); ``remote``: a local DVC remote. ``env``: the environment of its
    git and dvc commands (:func:`subprocess_env`'s: a git identity included)."""
    from foresight.config import parse_config
    from foresight.stages import render_dvc_yaml

    repo.mkdir(parents=True, exist_ok=True)
    for package in ("foresight", "models", "tasks", "flows"):
        shutil.copytree(REPO / package, repo / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cfg = parse_config(params, root=repo)
    (repo / "dvc.yaml").write_text(render_dvc_yaml(cfg))  # with the local files these params name (tiny models)
    (repo / "params.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False))
    (repo / ".gitignore").write_text("__pycache__/\nmlflow.db\nmlflow.db.lock\nmlruns/\n*.log\n")
    dvc = [sys.executable, "-m", "dvc"]
    commands = [["git", "init", "-q"], ["git", "config", "user.name", "test"],
                ["git", "config", "user.email", "test@example.com"], [*dvc, "init", "-q"],
                [*dvc, "config", "cache.type", project_cache_type()],
                *([[*dvc, "remote", "add", "-d", "local", str(remote)]] if remote else []),
                ["git", "add", "-A"], ["git", "commit", "-q", "-m", "tiny pipeline"]]
    for command in commands:
        subprocess.run(command, cwd=repo, env=env, check=True, capture_output=True)


def rl_stage(root, tiny_llama, train: dict[str, str | None], held_out: dict[str, str | None],
             scores: dict[str, list[float]] | None = None, **sections):
    """A config for the ``train_mtp_rl`` task with what it reads in place: the prepared policy, an (untrained) MTP
    module, the prompt splits (question → answer, None: none) and the label stage's scores of the training
    prompts' samples (question → scores; default: 1 and 0 for every prompt, so ``prompt_filter: spread`` keeps
    them all)."""
    from foresight.config import parse_config
    from foresight.prompts import PROMPT_COLUMNS
    from foresight.storage import write_table
    from models.engine.policy import load_pretrained, prepare_policy

    cfg = parse_config(tiny_params(root, tiny_llama, **sections), root=root)
    prepare_policy(cfg.policy, cfg.path(cfg.paths.policy_dir))
    model = load_pretrained(tiny_llama, cfg.policy).model
    MTPModule(model, MTPModuleConfig(2)).save(cfg.path(cfg.paths.mtp_dir) / "module")
    for split, prompts in (("train", train), ("eval", held_out)):
        table = pd.DataFrame({"prompt_id": [f"{split}{i}" for i in range(len(prompts))], "question": list(prompts),
                              "answer": list(prompts.values()), "source": "file"})
        write_table(table[PROMPT_COLUMNS], cfg.path(cfg.paths.prompts_dir) / f"{split}.jsonl")
    write_table(scores_table({f"train{i}": values for i, values in enumerate(
        (scores or {}).get(question, [1.0, 0.0]) for question in train)}), cfg.path(cfg.paths.scores))
    return cfg


def scores_table(scores: dict[str, list[float]]):
    """A label stage's table: one row per sample of each prompt id, its score and (for 0 / 1 scores) correctness."""
    rows = [(prompt_id, score) for prompt_id, values in scores.items() for score in values]
    table = pd.DataFrame(rows, columns=["prompt_id", "score"])
    table["correct"] = pd.array([score == 1.0 if score in (0.0, 1.0) else None for _, score in rows], dtype="boolean")
    return table


def run_rl_stage(cfg):
    """The ``train_mtp_rl`` task on ``cfg`` (:func:`rl_stage`), without a Prefect run; returns its result."""
    from prefect.logging import disable_run_logger

    from tasks.mtp import train_mtp_rl_task

    with disable_run_logger():
        return train_mtp_rl_task.fn(cfg)
