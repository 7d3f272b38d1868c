#!/bin/bash
# The checks that need a CUDA device, in one go, for a GPU machine lent for a few minutes:
#   bash benchmarks/cuda_check.sh [OUT_DIR]      (default results/bench)
# 1. tests/unit/ops/test_cuda.py and tests/unit/test_cuda.py: every preset operator keeps its payload on the device
#    with the layout's bytes and reconstructs as on CPU; error-feedback state stays on the device, the same on both
#    sides; payloads cross through device buffers; the in-process boundary trains;
# 2. benchmarks/ops.py on the device: each preset codec's throughput next to memcpy (clone and copy_), fused next to
#    eager, at a Megatron-sized activation in fp32 and bf16;
# 3. benchmarks/codec_profile.py: where each preset codec's time goes there (kernels, launches, host syncs).
# Needs only torch (and pytest, hypothesis, scipy for the tests); DeepSpeed is not used. The device machine has no
# editable install of this checkout, so the library and the lab are put on the path here.
set -o pipefail
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
out=${1:-results/bench}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
python3 -m pytest -q -p no:cacheprovider tests/unit/ops/test_cuda.py tests/unit/test_cuda.py tests/unit/test_boundary.py -k "cuda or CUDA" 2>&1 | tee "$out/cuda_tests.log"
tests_rc=$?
python3 benchmarks/ops.py --device cuda --presets --spec bf16 --spec fp8 --spec int8:compile --spec topk:0.1 \
    --shape 4x1024x1024 --shape 8x1024x2048 --dtype fp32 --dtype bf16 --out "$out/ops_cuda" || exit 1
specs="--spec bf16 --spec int8 --spec int8:rot --spec nf6 --spec int3:stoch --spec topk:0.1 --spec tile:3.5 --spec vq:4 --spec vq:3"
for dtype in fp32 bf16; do
    python3 benchmarks/codec_profile.py --device cuda $specs --shape 8x1024x2048 --dtype $dtype \
        --out "$out/codec_profile_cuda_$dtype.md" 2>&1 | grep -v "^USDT\|UserWarning\|_warn_once" || exit 1
done
exit $tests_rc
