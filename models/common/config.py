"""The frozen configs of the shared training loop's precision setting.

Plain dataclasses and names with no heavy imports: the pipeline's typed params (``foresight/config.py``) take
their defaults from here, so loading the params never loads model code.
"""

from __future__ import annotations

from typing import Literal

MixedPrecision = Literal["no", "bf16"]
"""accelerate's ``mixed_precision`` for a stage's forward passes: bfloat16 autocast, or none."""
