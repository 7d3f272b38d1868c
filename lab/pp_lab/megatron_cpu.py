"""Megatron-Core on a machine without CUDA: the few places where it assumes a GPU, mapped to the CPU.

    from pp_lab import megatron_cpu
    megatron_cpu.install()          # before megatron.core is imported; does nothing where CUDA is available

For this lab's CPU/gloo runs and tests only (a GPU job never calls it, and the library never imports it):
- `torch.cuda.current_device()` returns the CPU device: p2p_communication.py allocates its receive buffers and shape
  tensors there;
- `torch.cuda.synchronize()` does nothing (called when `batch_p2p_comm and batch_p2p_sync`, and in
  `_communicate_shapes`);
- factory calls with `device="cuda..."` make CPU tensors (schedules.py's `total_num_tokens`, the first failure);
- the "CUDA" random state that `model_parallel_cuda_manual_seed` and `get_cuda_rng_tracker().fork()` save and
  restore is the CPU's: with dropout 0 nothing draws from it, and forking leaves the CPU's stream as it was.
"""
from __future__ import annotations

import torch


class _CpuFactories(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


_INSTALLED: list[_CpuFactories] = []


def install() -> bool:
    """Map Megatron-Core's CUDA calls to the CPU, once per process; False (and nothing done) where CUDA is there."""
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed) and None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    mode = _CpuFactories()
    mode.__enter__()
    _INSTALLED.append(mode)
    return True
