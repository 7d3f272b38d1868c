# Sourced by the device scripts (cuda_check.sh, cuda_settings.sh): the library and the lab on the path (the device
# machine has no editable install of this checkout; a folder named by $EXTRA_PYTHONPATH goes on it too), the output
# folder ($1, default results/bench/cuda) as $out, and `step`, which runs one measurement under its own time limit.
set -o pipefail
export PYTHONPATH="$PWD:$PWD/lab${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}${PYTHONPATH:+:$PYTHONPATH}"
out=${1:-results/bench/cuda}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
rc=0
step() {  # step SECONDS COMMAND...: run it under a time limit, note a failure or a timeout (in rc) and go on
    local limit=$1; shift
    local t0=$SECONDS
    timeout "$limit" "$@"; local s=$?
    echo "== $((SECONDS - t0)) s, exit $s: $*" | cut -c1-200
    [ $s -eq 0 ] || rc=1
}
