#!/bin/bash
# The checks that need a CUDA device, in one go, for a GPU machine lent for a few minutes (about 3 minutes on an H100):
#   bash benchmarks/cuda_check.sh [OUT_DIR]      (default results/bench/cuda)
# 1. benchmarks/ops.py: each preset codec's encode and decode time (CUDA events) next to copy_, its break-even link
#    bandwidth, at a Megatron-sized activation (8x1024x2048) and an inference message (16 tokens x 576), fp32 and bf16;
#    the device kernels (ops/triton_int.py, ops/triton_vq.py) next to the eager reference (:kernel=eager);
# 2. benchmarks/vq_search.py: vq's device encoder with its pruned search next to the exhaustive one;
#    benchmarks/codec_profile.py: kernels launched and host synchronizations per encode + decode round;
# 3. benchmarks/host_overhead.py: the host's µs per encode / decode call, back-to-back rounds next to copy_, and a
#    training micro-batch through an in-process boundary;
# 4. benchmarks/train_step.py: the codec's share of a SmolLM2-135M training step with boundaries at the study's three
#    cuts, and whether a steady-state step synchronizes the host (sync debug mode 'error');
# 5. the CUDA tests (tests/unit/ops/test_cuda.py, tests/unit/test_cuda.py): payloads on the device with the layout's
#    bytes, the device kernels bitwise the eager reference, no host synchronization per message.
# Each step writes its file as it finishes, so a run cut short keeps what it measured. Needs torch and Triton (and
# pytest, hypothesis, scipy for the tests); DeepSpeed is not used. The device machine has no editable install of this
# checkout, so the library and the lab are put on the path here.
set -o pipefail
export PYTHONPATH="$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}"
out=${1:-results/bench/cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1
rc=0
python3 benchmarks/ops.py --device cuda --spec bf16 --spec int8 --spec int8:kernel=eager --spec int8:rot \
    --spec int8:rot:kernel=eager --spec int4:rot --spec int3:stoch --spec nf6 --spec vq:4 --spec vq:4:kernel=eager \
    --spec vq:3 \
    --shape 8x1024x2048 --shape 1x16x576 --dtype fp32 --dtype bf16 --reps 20 --out "$out/ops_cuda" || rc=1
python3 benchmarks/vq_search.py --shape 8x1024x2048 --shape 16x576 --out "$out/vq_search_cuda.md" || rc=1
specs="--spec bf16 --spec int8 --spec int8:rot --spec int4:rot --spec int3:stoch --spec nf6 --spec vq:4 --spec vq:3"
for dtype in fp32 bf16; do
    python3 benchmarks/codec_profile.py --device cuda $specs --shape 8x1024x2048 --dtype $dtype \
        --out "$out/codec_profile_cuda_$dtype.md" 2>&1 | grep -v "^USDT\|UserWarning\|_warn_once" || rc=1
done
python3 benchmarks/host_overhead.py --device cuda --spec identity --spec bf16 --spec int8 --spec int8:rot \
    --spec int4:rot --spec int3:stoch --spec vq:4 --boundary --profile --out "$out/host_cuda.md" || rc=1
python3 benchmarks/train_step.py --device cuda --dtype bf16 --sync-check --profile identity --profile safe --out "$out/train_step_cuda_bf16.md" || rc=1
python3 -m pytest -q -p no:cacheprovider tests/unit/ops/test_cuda.py tests/unit/test_cuda.py 2>&1 | tee "$out/cuda_tests.log" || rc=1
exit $rc
