"""Native ArmoRM (models/labeling/armorm.py) against the published forward of ``LlamaForRewardModelWithGating``
(RLHFlow/ArmoRM-Llama3-8B-v0.1, ``modeling_custom.py``), transcribed from raw checkpoint tensors in tests/helpers.py.

The tiny checkpoint (tests.tiny.build_tiny_armorm) has the real key names, two safetensors shards, a Llama-3 chat
template, and gating temperature, logit scale and transform that are not their identity values.
"""

from __future__ import annotations

import ast
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from models.labeling import armorm as armorm_module
from models.labeling.armorm import (
    ArmoRMError,
    encode_conversations,
    gating_pattern,
    gating_positions,
    load_armorm,
)
from tests.helpers import REFERENCE_PATTERN_TEXT, find_token_for_gating, read_checkpoint, reference_armorm_forward
from tests.tiny import build_tokenizer

# four conversations of clearly different lengths (19 to 135 tokens), one with paragraphs in the response
QUESTIONS = [
    "How many?",
    "Ben has 4 apples. Ava gives Ben 2 more apples. How many apples does Ben have now?",
    "Ivy has 3 cookies and gives 1 of them to Omar. How many are left?",
    "Ben has 4 bags of marbles and 2 bags of stickers. Ava has 3 bags. How many bags in total?",
]
RESPONSES = [
    "6",
    "Ben has 4 apples and Ava gives Ben 2 more apples, so Ben has 4 + 2 = 6 apples now. The answer is 6.",
    "The answer is 2.",
    "Ben has 4 + 2 = 6 bags.\n\nAva has 3 bags.\n\n6 + 3 = 9 bags in total. The answer is 9.",
]
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def armorm(tiny_armorm):
    return load_armorm(tiny_armorm, dtype=torch.float32, device="cpu")


def native(model, tokenizer, questions=QUESTIONS, responses=RESPONSES):
    enc, _ = encode_conversations(tokenizer, questions, responses, MAX_LENGTH, gating_pattern(tokenizer))
    with torch.no_grad():
        return enc, model(**enc)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_gating_pattern_comes_from_the_chat_template(armorm, tmp_path):
    _, tokenizer = armorm
    pattern = gating_pattern(tokenizer)
    assert pattern == tokenizer.encode(REFERENCE_PATTERN_TEXT, add_special_tokens=False)
    assert tokenizer.decode(pattern) == REFERENCE_PATTERN_TEXT
    # a ChatML template yields its own end-of-user-turn + assistant header: nothing is hard-coded
    chatml = build_tokenizer(tmp_path)
    assert gating_pattern(chatml) == chatml.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert chatml.decode(gating_pattern(chatml)) == "<|im_end|>\n<|im_start|>assistant\n"


def test_gating_positions_match_the_published_search(armorm):
    """The last occurrence within each row's real tokens, also in a multi-turn conversation and in padded rows."""
    _, tokenizer = armorm
    pattern = gating_pattern(tokenizer)
    turns = [{"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": RESPONSES[1]},
             {"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": RESPONSES[2]}]
    multi = tokenizer.encode(tokenizer.apply_chat_template(turns, tokenize=False), add_special_tokens=False)
    enc, _ = encode_conversations(tokenizer, QUESTIONS, RESPONSES, MAX_LENGTH, pattern)
    rows = [multi] + [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    expected = [find_token_for_gating(row, pattern) for row in rows]
    assert gating_positions(input_ids, attention_mask, pattern).tolist() == expected
    assert expected[0] > len(multi) // 2  # the second turn's header, not the first's
    assert enc["gating_positions"].tolist() == expected[1:]


def test_native_forward_matches_the_published_one(armorm, tiny_armorm):
    model, tokenizer = armorm
    enc, out = native(model, tokenizer)
    lengths = enc["attention_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) == len(QUESTIONS) and max(lengths) > 3 * min(lengths)  # really mixed lengths
    ref = reference_armorm_forward(tiny_armorm, enc["input_ids"], enc["attention_mask"], tokenizer.pad_token_id)
    assert out.score.shape == (4,) and out.rewards.shape == out.gating.shape == (4, 5)
    assert max_diff(out.score, ref["score"]) < 1e-5
    assert max_diff(out.rewards, ref["rewards"]) < 1e-5
    assert max_diff(out.gating, ref["gating"]) < 1e-5
    assert torch.allclose(out.gating.sum(dim=1), torch.tensor(1.7))  # softmax * logit_scale
    assert out.score.max() - out.score.min() > 0.1  # the rows really score differently
    for i in range(len(QUESTIONS)):  # batch-1, as the model card scores
        one, single = native(model, tokenizer, QUESTIONS[i:i + 1], RESPONSES[i:i + 1])
        ref_one = reference_armorm_forward(tiny_armorm, one["input_ids"], one["attention_mask"],
                                           tokenizer.pad_token_id)
        assert max_diff(single.score, out.score[i:i + 1]) < 1e-5
        assert max_diff(single.rewards, out.rewards[i:i + 1]) < 1e-5
        assert max_diff(single.score, ref_one["score"]) < 1e-5


def test_the_parity_check_discriminates(armorm, tiny_armorm):
    """Negative controls: the reference with the transform transposed, or at temperature 1, must not match."""
    model, tokenizer = armorm
    enc, out = native(model, tokenizer)
    args = (tiny_armorm, enc["input_ids"], enc["attention_mask"], tokenizer.pad_token_id)
    assert max_diff(out.score, reference_armorm_forward(*args, transform_transposed=True)["score"]) > 1e-3
    assert max_diff(out.score, reference_armorm_forward(*args, temperature=1.0)["score"]) > 1e-3


def test_pad_equal_to_the_end_token_still_reads_the_last_token(armorm, tiny_armorm):
    """Llama-3 has no pad token and is often padded with <|eot_id|>, which its template emits after every turn."""
    model, tokenizer = armorm
    eot_padded = copy.deepcopy(tokenizer)
    eot_padded.pad_token = "<|eot_id|>"
    assert eot_padded.pad_token_id == tokenizer.eos_token_id != tokenizer.pad_token_id
    enc, out = native(model, tokenizer)
    enc_eot, out_eot = native(model, eot_padded)
    padded = enc["attention_mask"] == 0
    assert padded.any() and (enc_eot["input_ids"][padded] == eot_padded.pad_token_id).all()
    assert max_diff(out_eot.score, out.score) < 1e-6
    # the published pooling reads the token before the first <|eot_id|> (the end of the question) instead
    ref_eot = reference_armorm_forward(tiny_armorm, enc_eot["input_ids"], enc_eot["attention_mask"],
                                       eot_padded.pad_token_id)
    assert max_diff(ref_eot["score"], out.score) > 1e-3


def test_a_tokenizer_without_pad_token_pads_with_the_end_token(armorm, tiny_armorm, tmp_path):
    """Meta's Llama-3 tokenizer defines no pad token: the loader pads with <|eot_id|>, scores unchanged."""
    folder = tmp_path / "armorm"
    shutil.copytree(tiny_armorm, folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    del tokenizer_config["pad_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert AutoTokenizer.from_pretrained(folder).pad_token is None
    model, tokenizer = load_armorm(folder)
    assert tokenizer.pad_token == "<|eot_id|>"
    assert max_diff(native(model, tokenizer)[1].score, native(*armorm)[1].score) < 1e-6


def test_loading_reads_every_tensor_of_both_shards(armorm, tiny_armorm):
    model, _ = armorm
    weight_map = json.loads((tiny_armorm / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2
    assert {"regression_layer.weight", "gating.logit_scale", "reward_transform_matrix"} <= {
        k for k, shard in weight_map.items() if shard == "model-00002-of-00002.safetensors"}
    state = model.state_dict()
    tensors = read_checkpoint(tiny_armorm)
    assert state.keys() == tensors.keys()
    assert all(torch.equal(state[key], value) for key, value in tensors.items())
    assert not torch.equal(model.reward_transform_matrix, torch.eye(5))  # the file's, not the init's identity
    assert not model.reward_transform_matrix.requires_grad
    assert model.gating.temperature == 2.5
    # rotary frequencies (non-persistent, rebuilt after a meta-device load) from config.json's rope_theta = 5e5
    head_dim = 32 // 4
    expected = 1.0 / (5e5 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)


def test_no_remote_code_is_needed_or_allowed(tiny_armorm):
    config = json.loads((tiny_armorm / "config.json").read_text())
    assert config["auto_map"]["AutoModelForSequenceClassification"].startswith("modeling_custom.")
    assert not (tiny_armorm / "modeling_custom.py").exists()  # the code the config names was never written
    source = Path(armorm_module.__file__).read_text()
    keywords = {kw.arg for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) for kw in node.keywords}
    assert "trust_remote_code" not in keywords


def test_an_ordinary_classifier_is_not_an_armorm(tiny_classifier):
    with pytest.raises(ArmoRMError, match=r"not an ArmoRM-layout checkpoint.*unexpected \['score\.weight'\].*"
                                          r"label\.labeler: hf-classifier"):
        load_armorm(tiny_classifier)


def test_heads_that_disagree_with_the_config_are_named(tiny_armorm, tmp_path):
    folder = tmp_path / "armorm"
    shutil.copytree(tiny_armorm, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_objectives": 7}))
    with pytest.raises(ArmoRMError, match=r"regression_layer\.weight is \[5, 32\] in the checkpoint, \[7, 32\]"):
        load_armorm(folder)


def test_missing_checkpoints_are_named(tmp_path):
    with pytest.raises(ArmoRMError, match=f"{tmp_path / 'absent'}.*no such folder"):
        load_armorm(tmp_path / "absent")
    with pytest.raises(ArmoRMError, match=r"(?s)'RLHFlow/ArmoRM-Llama3-8B-v0\.1'.*looked up as a hub id.*cache"):
        load_armorm("RLHFlow/ArmoRM-Llama3-8B-v0.1")  # HF_HUB_OFFLINE (conftest) and not in any cache here


def test_a_tokenizer_without_chat_template_is_refused(tiny_armorm, tmp_path):
    folder = tmp_path / "armorm"
    shutil.copytree(tiny_armorm, folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ArmoRMError, match="has no chat template"):
        load_armorm(folder)


def test_prompts_without_room_and_left_padding_are_refused(armorm):
    model, tokenizer = armorm
    # 40 tokens hold the first row's prompt (its pattern ends at token 17) but not the others' (43 or more): the
    # response is cut, never the prompt, so such a prompt is an error naming the knob that drops it
    with pytest.raises(ArmoRMError, match=r"a prompt of \d+ tokens.*max_length = 40.*prompts\.max_prompt_tokens"):
        encode_conversations(tokenizer, QUESTIONS, RESPONSES, 40, gating_pattern(tokenizer))
    enc, _ = encode_conversations(tokenizer, QUESTIONS, RESPONSES, MAX_LENGTH, gating_pattern(tokenizer))
    with pytest.raises(ArmoRMError, match="right-padded"):
        model(enc["input_ids"], enc["attention_mask"].flip(dims=[1]), enc["gating_positions"])


@pytest.mark.cuda
def test_bf16_on_cuda_matches_fp32_on_cpu(armorm, tiny_armorm):
    model, tokenizer = armorm
    _, out = native(model, tokenizer)
    gpu_model, _ = load_armorm(tiny_armorm, dtype=torch.bfloat16, device="cuda")
    assert next(gpu_model.parameters()).dtype == torch.bfloat16
    enc, _ = encode_conversations(tokenizer, QUESTIONS, RESPONSES, MAX_LENGTH, gating_pattern(tokenizer))
    with torch.no_grad():
        gpu = gpu_model(**{k: v.cuda() for k, v in enc.items()})
    # bf16 on this spiky tiny model moves scores by ~0.08 (measured on CPU); they span ~4.7 across the rows
    assert max_diff(gpu.score.float().cpu(), out.score) < 0.25
