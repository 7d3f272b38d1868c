import sys
import warnings

import pytest
import torch

from tests.integration.launch import ROOT

sys.path.insert(0, str(ROOT))
from recipes.train import warn_if_slow_bf16  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about CPUs")
def test_bf16_on_a_cpu_without_bf16_units_warns_and_names_the_fix():
    with pytest.warns(RuntimeWarning, match="drop --bf16"):
        warn_if_slow_bf16(True, cpuinfo="flags : fpu sse2 avx2 fma")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_slow_bf16(True, cpuinfo="flags : avx2 avx512f avx512_bf16")
        warn_if_slow_bf16(True, cpuinfo="flags : avx2 amx_bf16 amx_tile")
        warn_if_slow_bf16(False, cpuinfo="flags : fpu sse2")
