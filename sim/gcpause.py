"""Pause Python's cyclic garbage collector while a simulation makes millions of small objects.

A simulated hour keeps millions of token times, log rows and tuples alive; every few thousand
allocations the collector walks them all again (a third of the run's time on the Azure hour),
though the loop makes almost no reference cycles. Paused only where the work is the
simulator's own (a simulated run, its summary, writing its files); real runs keep the
collector unless asked (the engine's ``--noise gc-off``), and it is restored afterwards.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gc_paused(pause: bool = True) -> Iterator[None]:
    was = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
