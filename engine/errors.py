"""Engine errors. Imports nothing heavy (no mlx): the CLI imports this to classify errors."""

from __future__ import annotations


class EngineError(ValueError):
    """Bad engine input (model path, preset, dtype, a trace the model cannot hold).

    The message is one line for the user; schedlab.common prints it without a traceback.
    """
