"""The KV cache's argument and output name across transformers releases (models/engine/kv_cache.py), and the test
configuration that fails a test passing or reading it by its pre-5.24 name (pyproject.toml, tests/conftest.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from transformers import DynamicCache, MistralForCausalLM

from models.common.lora import with_lora
from models.engine.kv_cache import cache_kwargs, returned_cache
from tests.tiny import sliding_model

RENAMED = "cache" in inspect.signature(MistralForCausalLM.forward).parameters  # transformers ≥ 5.24


@pytest.mark.parametrize("kind", ["mistral", "mixed", "lora"])
@torch.no_grad()
def test_a_forward_continued_from_the_returned_cache_equals_one_forward(kind):
    """Mistral (sliding window in every layer), Qwen2 (mixed) and a LoRA-wrapped one (peft's forward takes
    ``**kwargs``): the cache a forward returns, handed back under the shim's name, carries the prefix (a cache passed
    under a name the model ignores would leave the logits wrong)."""
    model = (with_lora(sliding_model("mistral"), rank=2) if kind == "lora" else sliding_model(kind)).eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    full = model(ids).logits
    cache = returned_cache(model(ids[:, :7], use_cache=True))
    rest = model(ids[:, 7:], **cache_kwargs(model, cache), use_cache=True).logits
    assert cache.get_seq_length() == 10
    torch.testing.assert_close(rest, full[:, 7:], rtol=0, atol=1e-5)
    out = model.generate(ids[:, :7], **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=2,
                         do_sample=False, return_dict_in_generate=True)
    assert returned_cache(out).get_seq_length() == 8  # all but the last token drawn


def test_a_forward_written_for_older_releases_gets_the_old_name():
    """Remote code (``trust_remote_code``) still taking ``past_key_values`` would drop ``cache`` into ``**kwargs``."""

    class OldStyle(nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    cache = DynamicCache()
    assert OldStyle()(None, **cache_kwargs(OldStyle(), cache)) is cache


@pytest.mark.skipif(not RENAMED, reason="transformers < 5.24 knows the KV cache as past_key_values only")
@torch.no_grad()
def test_the_old_name_fails_a_test():
    """Passing the cache as ``past_key_values`` (a FutureWarning from ``deprecate_kwarg``) or reading it off an output
    (logged by transformers, raised as a warning by tests/conftest.py) is an error under the project's pytest config."""
    model = sliding_model("mistral").eval()
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(FutureWarning, match="`past_key_values` is deprecated"):
        model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    out = model(ids, use_cache=True)
    for _ in range(2):  # transformers logs it once per process; raised, it is not marked as logged
        with pytest.raises(FutureWarning, match="`past_key_values`/`cache_params` are deprecated"):
            out.past_key_values  # noqa: B018
