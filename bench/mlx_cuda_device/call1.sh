# device call 1: keep the first chunk of the payload; look at the machine
cp .cuda/c1/c1.bin /tmp/c1.bin && ls -la /tmp/c1.bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
SP=$(python3 -c "import site;print(site.getsitepackages()[0])"); echo SP=$SP
ls -d $SP/nvidia/*/lib; ls -d /usr/local/cuda* 2>/dev/null; command -v nvcc; python3 -m pip show nvidia-cublas nvidia-cudnn-cu13 nvidia-nccl-cu13 2>/dev/null | grep -E "^(Name|Version)"
df -h /tmp | tail -1
