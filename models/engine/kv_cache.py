"""The KV cache's argument and output name across transformers releases.

transformers 5.24 renamed a model's KV cache from ``past_key_values`` to ``cache``: the argument of every forward
(``@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")`` on ``LlamaForCausalLM.forward`` and its
model and layers, transformers/models/llama/modeling_llama.py), of ``generate`` (removed in 6.0) and the
``ModelOutput`` field (transformers/utils/generic.py: ``outputs.past_key_values`` is a property that logs
"`past_key_values`/`cache_params` are deprecated"). 5.23, which the pins allow, knows only ``past_key_values``.

The name is read from the model's own ``forward`` signature rather than from the transformers version: a model that
ships its own code (``trust_remote_code``) written for older releases still takes ``past_key_values``, and handed
``cache`` it would drop it into ``**kwargs`` and silently decode without a cache. A peft ``PeftModel`` is read through
to the model it wraps; a wrapper whose forward names neither (torch's DDP, passing ``**kwargs`` on) gets the installed
transformers' name. ``generate`` takes whichever its model's forward takes: the two agree for transformers' own
models, and a remote-code model's old name still works there (with transformers' deprecation warning) until 6.0.
"""

from __future__ import annotations

import inspect
from dataclasses import fields
from functools import cache as memoized

from torch import nn
from transformers import LlamaForCausalLM

# the name the installed transformers' own models take, Llama's as any
INSTALLED_NAME = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@memoized
def _cache_argument(forward) -> str:
    """The name a ``forward`` function takes its KV cache by (inspect follows ``deprecate_kwarg``'s ``wraps``)."""
    parameters = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return INSTALLED_NAME


def cache_kwargs(module: nn.Module, kv_cache) -> dict:
    """``{name: kv_cache}`` for a call of ``module`` (a model, its decoder or a decoder layer) or its ``generate``:
    ``cache`` where its forward takes that (transformers ≥ 5.24), ``past_key_values`` where it takes that."""
    get_base_model = getattr(module, "get_base_model", None)  # peft: the model its forward hands ``**kwargs`` to
    receiver = get_base_model() if callable(get_base_model) else module
    return {_cache_argument(type(receiver).forward): kv_cache}


def returned_cache(outputs):
    """The KV cache a forward or ``generate`` returned: the output's ``cache`` field (transformers ≥ 5.24, also for
    remote-code outputs built with the old name) or its ``past_key_values`` (before)."""
    names = {field.name for field in fields(outputs)}
    return outputs.cache if "cache" in names else outputs.past_key_values
