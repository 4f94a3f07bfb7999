# On the device: install the CPU stack carried in .dev/ (wheels, Debian OpenBLAS), copy the
# repository to /tmp/repo (a later call re-sends the working tree; the bench runs from the copy)
# and print the machine. Run from the repository root: bash bench/gpuhost/setup.sh
set -x
date; python3 -V; nproc; lscpu | sed -n 1,25p
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
mkdir -p /tmp/deb /tmp/res; for f in .dev/deb/*.deb; do dpkg -x "$f" /tmp/deb; done
rm -rf /tmp/repo; cp -a . /tmp/repo; rm -rf /tmp/repo/.dev
. "$(dirname "$0")/env.sh"
cd /tmp/repo && python3 -c "
import engine, mlx.core as mx, simpy, mlx_lm
from engine import blas
print('mlx', mx.__version__, mx.default_device(), blas.info())"
