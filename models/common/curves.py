"""Live training curves: where a training loop sends each step's numbers while it runs.

The loops (the shared :func:`models.common.training.train`, MTP-RL's GRPO loop in :mod:`models.mtp.rl`, DPO's TRL
trainer through :class:`models.sla.dpo.CurveCallback`) call :func:`log_step` once per optimizer step on the main
process, with the loop's step number (counted from 1; a resumed loop goes on from its checkpoint's step); whoever
runs the loop decides where the numbers go by setting a sink around it with :func:`curve_sink`
(the stage's MLflow run: :func:`tasks.common.live_curves`). Without a sink :func:`log_step` does nothing, so model
code stays free of any tracking library. The sink lives in a context variable: it follows the code that set it,
not a global that a concurrent test or thread could see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar

CurveSink = Callable[[Mapping[str, float], int], None]
"""Takes one optimizer step's numbers (name → value) and the loop's step number; called once per step, in order."""

_SINK: ContextVar[CurveSink | None] = ContextVar("curve_sink", default=None)


@contextlib.contextmanager
def curve_sink(sink: CurveSink) -> Iterator[None]:
    """Send the steps of the loops run inside the block to ``sink``."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def log_step(values: Mapping[str, float], step: int) -> None:
    """Optimizer step ``step``'s numbers, to the sink set around the running loop (none: dropped)."""
    sink = _SINK.get()
    if sink is not None:
        sink(values, step)
