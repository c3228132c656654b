"""The whole ``params.yaml``: every section, validated together (``foresight check``, the pipeline's start).

A stage process never imports this module: it reads its own sections alone (:func:`foresight.params.load_params`
with the stage's keys), so that a method's config module is a code dependency of that method's stages only. The
sections and their classes are listed once, in :data:`foresight.params.SECTIONS`; each knob is declared once, in
its class (``models/<method>/config.py`` for a method's, ``foresight/params.py`` for the pipeline's own), and
``params.yaml`` is generated from them (:func:`foresight.params.render_params_yaml`). Unknown keys, wrong types and
out-of-range values fail with :class:`ConfigError`, whose message names the offending key (as a dotted path) and
what is allowed, before any stage writes anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foresight.params import SECTIONS, ConfigError, config_class, load_params, parse_params

__all__ = ["Config", "ConfigError", "load_config", "parse_config"]

Config = config_class(tuple(SECTIONS))
"""The whole params file: one field per section of :data:`foresight.params.SECTIONS` (``validate`` as
``validate_``), each defaulting to its class's defaults, plus ``root`` and the path helpers of
:class:`foresight.params.Params`."""


def parse_config(data: dict | None, root: Path = Path("."), source: str = "params") -> Config:
    """Validate a whole params dict; raise :class:`ConfigError` naming every bad key."""
    return parse_params(data, root, source)


def load_config(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Config:
    """Read the whole ``params.yaml`` (plus dotted-key overrides) into a validated :class:`Config`."""
    return load_params(path, overrides)
