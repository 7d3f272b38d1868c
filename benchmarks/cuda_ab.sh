#!/bin/bash
# GPU codec speed side by side with an earlier commit, for a GPU machine lent for a few minutes (about 4 minutes on an
# H100), where there is no git: prepare the earlier tree here first, inside the checkout so that it travels with it:
#   git archive REV pp_compress lab | (mkdir -p ab_old && tar -x -C ab_old)     (ab_old/ is left uncommitted)
#   bash benchmarks/cuda_ab.sh ab_old [OUT_DIR]                                  (on the GPU machine)
# In turns (old, new, old, new) so that a drift of the machine spreads over both:
# - benchmarks/host_overhead.py: the host's µs per call and back-to-back rounds (this tree's benchmark, run on each);
# - benchmarks/ops.py: encode and decode time from an idle device next to copy_, and the break-even bandwidth;
# - benchmarks/train_step.py (old, new): the codec's share of a SmolLM2-135M training step;
# then the CUDA tests of this tree. Each run writes OUT_DIR/<what>_<old|new>_<round>.md with its command.
set -uo pipefail
old=${1:?usage: bash benchmarks/cuda_ab.sh OLD_TREE [OUT_DIR]}
out=${2:-results/bench/cuda_ab}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
old=$(cd "$old" && pwd)
cp lab/pp_lab/bench/host_overhead.py "$old/lab/pp_lab/bench/"  # one benchmark for both trees
nvidia-smi -L
rc=0
tree_path() { if [ "$1" = old ]; then echo "$old:$old/lab"; else echo "$PWD:$PWD/lab"; fi; }
for round in 1 2; do
  for tree in old new; do
    PYTHONPATH=$(tree_path $tree) python3 benchmarks/host_overhead.py --device cuda --spec identity --spec bf16 \
        --spec int8 --spec int8:rot --spec int3:stoch --calls 300 --rounds 50 \
        --out "$out/host_${tree}_$round.md" 2>&1 | grep -v "Warn\|warn" | sed "s/^/$tree $round /" || rc=1
    PYTHONPATH=$(tree_path $tree) python3 benchmarks/ops.py --device cuda --spec bf16 --spec int8 --spec int8:rot \
        --spec int4:rot --spec int3:stoch --shape 8x1024x2048 --dtype fp32 --dtype bf16 --reps 20 \
        --out "$out/ops_${tree}_$round" 2>&1 | grep " enc " | sed "s/^/$tree $round /" || rc=1
  done
done
for tree in old new; do
  PYTHONPATH=$(tree_path $tree) python3 benchmarks/train_step.py --device cuda --dtype bf16 --rounds 15 \
      --spec none --spec identity --spec int8 --spec safe --out "$out/train_step_${tree}.md" 2>&1 \
      | grep "^|" | sed "s/^/$tree /" || rc=1
done
PYTHONPATH="$PWD:$PWD/lab" python3 -m pytest -q -p no:cacheprovider tests/unit/ops/test_cuda.py tests/unit/test_cuda.py \
    2>&1 | tee "$out/cuda_tests.log" | tail -2 || rc=1
exit $rc
