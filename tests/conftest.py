"""Load the optimized BLAS before anything imports mlx (engine/__init__ does it first)."""

try:
    import engine  # noqa: F401
except ImportError:  # pragma: no cover - the engine needs mlx; sim tests don't
    pass
