#!/bin/bash
# Messages as untrusted input, with the C++ kernels under AddressSanitizer: builds them instrumented
# (PP_COMPRESS_KERNELS=asan, -fsanitize=address), preloads the compiler's libasan, and runs benchmarks/fuzz.py, which
# decodes malformed messages of every registered operator. An out-of-bounds read or write in a kernel aborts the
# run with AddressSanitizer's report; the table of outcomes lands in results/bench/fuzz_asan.md.
#   bash benchmarks/sanitize.sh [--buffers N]          (default 10,000 per spec; about N / 10,000 x 40 min on one core)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PY:-.venv/bin/python}
export PP_COMPRESS_KERNELS=asan ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 OMP_NUM_THREADS=1
# libstdc++ too: without it ASan cannot find the real __cxa_throw, and the first C++ exception (torch raising a
# Python error) aborts with "CHECK failed: asan_interceptors.cpp"
export LD_PRELOAD="$(${CXX:-c++} -print-file-name=libasan.so) $(${CXX:-c++} -print-file-name=libstdc++.so)"
export FUZZ_PREFIX="PP_COMPRESS_KERNELS=asan LD_PRELOAD=libasan.so "
test -f "${LD_PRELOAD%% *}" || { echo "no libasan.so next to ${CXX:-c++}: AddressSanitizer is not installed" >&2; exit 1; }
"$py" -m pp_compress.kernels
"$py" benchmarks/fuzz.py --out results/bench/fuzz_asan.md "$@"
