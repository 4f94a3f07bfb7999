# device call 2: assemble and install MLX (CUDA 13), run the preset workload
source .cuda/src/bench/mlx_cuda_device/common.sh
exec > >(tee -a $O/log2.txt) 2>&1
echo "SP=$SP CUDA_PATH=${CUDA_PATH:-unset}"
MLXSIZE=$(cat .cuda/src/bench/mlx_cuda_device/mlxsize)
cat /tmp/c1.bin .cuda/c2/c2.bin > /tmp/blob.bin && rm -f /tmp/c1.bin
head -c $MLXSIZE /tmp/blob.bin > /tmp/mlx.tar.xz; tail -c +$((MLXSIZE+1)) /tmp/blob.bin > /tmp/gguf.part; rm /tmp/blob.bin
sha256sum /tmp/mlx.tar.xz; cat .cuda/src/bench/mlx_cuda_device/mlx.sha256
python3 -m pip install -q --no-index --no-deps --no-compile .cuda/whl/*.whl 2>&1 | tail -3
python3 -c "import tarfile; tarfile.open('/tmp/mlx.tar.xz').extractall('$SP')" && rm /tmp/mlx.tar.xz
python3 -m pip list 2>/dev/null | grep -i -E "^mlx|simpy"
python3 -c "import mlx.core as mx; print(mx.default_device(), mx.cuda.is_available()); a=mx.ones((256,256)); print((a@a).sum())" || { echo MLX-IMPORT-FAILED; ldd $SP/mlx/lib/libmlx.so | grep -i "not found"; }
step env 60 $B env $R/env.json
step greedy_small_f32 60 $B greedy $R/greedy_small_float32.json --model small --dtype float32
step greedy_1b_bf16 90 $B greedy $R/greedy_llama-1b_bfloat16.json --model llama-1b --dtype bfloat16
step checkpoint_1b 90 $B checkpoint /tmp/ckpt1b --preset llama-1b --dtype bfloat16
cp /tmp/ckpt1b/made.json $R/checkpoint_1b.json 2>/dev/null
step calibrate_1b 150 $CLI calibrate --quick --model /tmp/ckpt1b --dtype bfloat16 --out $R/profile_llama-1b_bf16.json
step validate_1b 150 $CLI validate --policy all --trace real-smoke --model /tmp/ckpt1b --dtype bfloat16 --profile $R/profile_llama-1b_bf16.json --out $R/validate_llama-1b
step passes_8b 150 $B passes $R/passes_llama-8b_bfloat16.json --model llama-8b --dtype bfloat16
step greedy_small_bf16 60 $B greedy $R/greedy_small_bfloat16.json --model small --dtype bfloat16
step greedy_1b_f32 90 $B greedy $R/greedy_llama-1b_float32.json --model llama-1b --dtype float32
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/nvidia_smi_end.txt 2>&1
pack 2
