"""Load the optimized BLAS before anything imports mlx (engine/__init__ does it first), and
keep calibrations made by the tests (run-real and validate calibrate a model with no matching
profile first) in a cache of this test session, shared by the commands the tests start."""

import os
import tempfile

os.environ.setdefault("SCHEDLAB_CACHE_DIR", tempfile.mkdtemp(prefix="schedlab-test-cache-"))

try:
    from schedlab import engine  # noqa: F401
except ImportError:  # pragma: no cover - the engine needs mlx; sim tests don't
    pass
