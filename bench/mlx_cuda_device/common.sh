# sourced by the device scripts: environment for MLX's CUDA backend in the image's torch venv
SP=$(python3 -c "import site;print(site.getsitepackages()[0])")
LIBS=$(ls -d $SP/nvidia/*/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH=${LIBS}${LD_LIBRARY_PATH:-}
for d in /usr/local/cuda /usr/local/cuda-13* $(dirname $(dirname $(command -v nvcc 2>/dev/null || echo /x/x/x))) $SP/nvidia/cu13; do
  if [ -f "$d/include/cuda_runtime.h" ] || [ -f "$d/include/cuda_fp16.h" ]; then export CUDA_PATH=$d CUDA_HOME=$d; break; fi
done
export SCHEDLAB_BLAS=none PYTHONPATH=.cuda/src:. PYTHONUNBUFFERED=1 MPLBACKEND=Agg
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
START=$(date +%s); DEADLINE=$((START + ${BUDGET_S:-540}))
B="python3 .cuda/src/bench/mlx_cuda.py"
CLI="python3 .cuda/src/bench/mlx_cuda_device/cli.py"
# step NAME MAX_S CMD...: runs CMD under the smaller of MAX_S and what is left before DEADLINE
step() { local name=$1 max=$2; shift 2; local left=$((DEADLINE - $(date +%s) - 15)); local t=$(( max < left ? max : left ))
  if [ $t -lt 20 ]; then echo "=== SKIP $name (no time left)"; echo "$name skipped" >> $R/steps.txt; return; fi
  echo "=== $name (limit ${t}s) $(date +%T)"; local t0=$(date +%s)
  timeout -k 5 $t "$@"; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; echo "$name rc=$rc s=$(( $(date +%s) - t0 ))" >> $R/steps.txt; }
pack() { tar -C /tmp -czf $O/results$1.tgz res; ls -la $O; }
