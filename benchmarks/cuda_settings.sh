#!/bin/bash
# The device kernels' two settings not yet the default (pp_compress.ops.triton_int.SIGN_TABLE_ROWS and BUTTERFLY),
# timed where the choice is made, for a GPU machine lent for a few minutes (about 3 minutes on an H200):
#   bash benchmarks/cuda_settings.sh [OUT_DIR]      (default results/bench/cuda)
# 1. benchmarks/train_step.py: SmolLM2-135M training steps with `safe` and `aggressive` under each setting, side by
#    side in one run, device-bound (16x2048 tokens) and at the study's micro-batch (8x1024);
# 2. benchmarks/ops.py: the rotated codecs under each setting at message sizes between an inference message and a
#    Megatron-sized one (64 to 2048 rows of 2048), where the sign table's extra launch and its shorter kernels cross.
# benchmarks/cuda_check.sh runs first on a fresh machine (its tests compile every kernel); each step here has its own
# time limit and writes its file as it finishes (cuda_steps.sh).
source "$(dirname "$0")/cuda_steps.sh" "$@"
table="--sign-table-rows off --sign-table-rows 0"
step 100 python3 benchmarks/train_step.py --device cuda --dtype bf16 --rounds 15 --batch 16 --seq 2048 --spec none \
    --spec safe --spec aggressive $table --out "$out/train_step_settings_bf16_b16s2048.md"
step 80 python3 benchmarks/train_step.py --device cuda --dtype bf16 --rounds 20 --spec none --spec safe \
    --spec aggressive $table --out "$out/train_step_settings_bf16.md"
step 60 python3 benchmarks/ops.py --device cuda --spec int8:rot --spec int4:rot --spec vq:4 --shape 1x64x2048 \
    --shape 1x256x2048 --shape 1x1024x2048 --shape 2x1024x2048 --dtype bf16 --reps 20 $table \
    --out "$out/ops_sign_table_sizes"
exit $rc
