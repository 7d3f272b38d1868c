#!/bin/bash
# The checks that need a CUDA device, in one go, for a GPU machine lent for a few minutes (about 6 minutes on an H200):
#   bash benchmarks/cuda_check.sh [OUT_DIR]      (default results/bench/cuda)
# 1. the CUDA tests (tests/unit/ops/test_cuda.py, tests/unit/test_cuda.py): payloads on the device with the layout's
#    bytes, the device kernels bitwise the eager reference, no host synchronization per message; first, since they
#    compile every kernel (in parallel when pytest-xdist is importable) into Triton's cache for the benchmarks;
# 2. benchmarks/ops.py: each preset codec's encode and decode time (CUDA events) next to copy_, its break-even link
#    bandwidth, at a Megatron-sized activation (8x1024x2048) and an inference message (16 tokens x 576), fp32 and bf16;
#    the device kernels (ops/triton_int.py, triton_nf.py, triton_vq.py, triton_pivoted.py) next to the eager
#    reference (:kernel=eager);
#    the rotated int and vq kernels under the kernel settings not yet the default (pp_lab.bench.kernel_settings): the
#    rotation's signs hashed in every program or read from a table made once per message (triton_int.SIGN_TABLE_ROWS),
#    the butterfly split or as sums (triton_int.BUTTERFLY); the table's extra launch at the inference size too;
# 3. benchmarks/vq_search.py: vq's device encoder with its pruned search next to the exhaustive one, and its parts;
#    benchmarks/codec_profile.py: kernels launched and host synchronizations per encode + decode round, and the kernel
#    time of the rotated specs under each of those settings;
# 4. benchmarks/host_overhead.py: the host's µs per encode / decode call, back-to-back rounds next to copy_, and a
#    training micro-batch through an in-process boundary; and cProfile's view of `safe`'s host time there;
# 5. benchmarks/train_step.py: the codec's share of a SmolLM2-135M training step with boundaries at the study's three
#    cuts, the host's time to queue a step, and whether a steady-state step synchronizes the host (sync debug mode
#    'error'); at the study's micro-batch and at one 4x larger.
# Each step has its own time limit and writes its file as it finishes, so a run cut short keeps what it measured.
# Needs torch and Triton (and pytest, hypothesis, scipy for the tests); DeepSpeed is not used. The device machine has no
# editable install of this checkout, so the library and the lab are put on the path here; a folder named by
# $EXTRA_PYTHONPATH goes on it too: with the device tool, `pip install --target .cache/devpkgs --no-deps pytest-xdist
# execnet` here, carry .cache/devpkgs, and run `EXTRA_PYTHONPATH=$PWD/.cache/devpkgs bash benchmarks/cuda_check.sh`.
source "$(dirname "$0")/cuda_steps.sh" "$@"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
step 180 bash -c "set -o pipefail; python3 -m pytest -q -p no:cacheprovider $parallel --durations=10 tests/unit/ops/test_cuda.py \
    tests/unit/test_cuda.py 2>&1 | tee '$out/cuda_tests.log'"
step 100 python3 benchmarks/ops.py --device cuda --spec bf16 --spec int8 --spec int8:kernel=eager --spec int8:rot \
    --spec int8:rot:kernel=eager --spec int4:rot --spec int3:stoch --spec nf6 --spec nf6:kernel=eager --spec vq:4 \
    --spec vq:4:kernel=eager --spec vq:3 --spec tile:3.5 --spec tile:3.5:kernel=eager --spec int4:per=block64 \
    --spec int4:per=block64:kernel=eager --shape 8x1024x2048 \
    --shape 1x16x576 --dtype fp32 --dtype bf16 --reps 20 \
    --out "$out/ops_cuda"
settings="--sign-table-rows off --sign-table-rows 0 --butterfly split --butterfly sum"
step 90 python3 benchmarks/ops.py --device cuda --spec int8:rot --spec int4:rot --spec vq:4 --shape 8x1024x2048 \
    --dtype fp32 --dtype bf16 --reps 20 $settings --out "$out/ops_kernel_settings"
step 30 python3 benchmarks/ops.py --device cuda --spec int8:rot --spec vq:4 --shape 1x16x576 --dtype bf16 --reps 20 \
    --sign-table-rows off --sign-table-rows 0 --out "$out/ops_sign_table_small"
step 45 python3 benchmarks/vq_search.py --parts --spec vq:4 --spec vq:3 --shape 8x1024x2048 --shape 16x576 --reps 10 \
    --out "$out/vq_search_cuda.md"
specs="--spec bf16 --spec int8 --spec int8:rot --spec int4:rot --spec int3:stoch --spec nf6 --spec vq:4 --spec vq:3"
specs="$specs --spec tile:3.5"
for dtype in fp32 bf16; do
    step 30 bash -c "set -o pipefail; python3 benchmarks/codec_profile.py --device cuda $specs --shape 8x1024x2048 --dtype $dtype \
        --out '$out/codec_profile_cuda_$dtype.md' 2>&1 | grep -v '^USDT\|UserWarning\|_warn_once'"
    step 45 bash -c "set -o pipefail; python3 benchmarks/codec_profile.py --device cuda --spec int8:rot \
        --spec int4:rot --spec vq:4 --shape 8x1024x2048 --dtype $dtype $settings \
        --out '$out/codec_profile_kernel_settings_$dtype.md' 2>&1 | grep -v '^USDT\|UserWarning\|_warn_once'"
done
step 35 python3 benchmarks/host_overhead.py --device cuda --spec identity --spec int8 --spec int8:rot --spec nf6 \
    --spec vq:4 --boundary --out "$out/host_cuda.md"
step 30 python3 benchmarks/host_overhead.py --device cuda --spec int8:rot --dtype bf16 --boundary --profile \
    --out "$out/host_cuda_profile.md"
step 80 python3 benchmarks/train_step.py --device cuda --dtype bf16 --rounds 20 --sync-check --spec none \
    --spec identity --spec safe --spec aggressive --out "$out/train_step_cuda_bf16.md"
step 80 python3 benchmarks/train_step.py --device cuda --dtype bf16 --rounds 15 --batch 16 --seq 2048 --spec none \
    --spec identity --spec safe --spec aggressive --out "$out/train_step_cuda_bf16_b16s2048.md"
exit $rc
