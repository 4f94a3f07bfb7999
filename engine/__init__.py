"""The real MLX engine: models, the batched KV caches, and the backend that runs plans.

Importing this package first loads OpenBLAS into the process's global symbol scope (see
``engine.blas``), which must happen before anything imports mlx. Nothing in this
``__init__`` imports mlx; import ``engine.models`` / ``engine.backend`` for that.
"""

from . import blas as _blas

_blas.ensure_loaded()

from .errors import EngineError  # noqa: E402

__all__ = ["EngineError"]
