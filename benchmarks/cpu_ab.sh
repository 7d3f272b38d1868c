#!/bin/bash
# CPU codec speed side by side with an earlier commit: benchmarks/ops.py from REV's tree and from this one, in turns
# (old, new, old, new), one thread each, so that a drift of the machine spreads over both.
#   bash benchmarks/cpu_ab.sh REV [OUT_DIR]          (default results/bench/cpu_ab; about 10 minutes on one core)
#   SPECS="--spec tile:3.5" bash benchmarks/cpu_ab.sh REV OUT_DIR    (other specs than the presets' and their parts)
# Each run writes OUT_DIR/<old|new>_<round>.md with its command; the lines printed are the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash benchmarks/cpu_ab.sh REV [OUT_DIR]}
out=${2:-results/bench/cpu_ab}
mkdir -p "$out"
old=$(mktemp -d)
git worktree add -f -q "$old" "$rev"
trap 'git worktree remove --force "$old"' EXIT
specs=${SPECS:-"--spec int8 --spec int8:rot --spec int4:rot --spec int3:stoch --spec nf6 --spec tile:3.5 --spec vq:4"}
for round in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then pp="$old:$old/lab"; else pp="$PWD:$PWD/lab"; fi
    # shellcheck disable=SC2086
    PYTHONPATH=$pp OMP_NUM_THREADS=1 .venv/bin/python -c "from pp_lab.bench.ops import main; main()" --device cpu \
        --shape 4x1024x1024 --dtype fp32 --reps 7 --out "$out/${tree}_${round}" $specs | grep " enc " | sed "s/^/$tree $round /"
  done
done
