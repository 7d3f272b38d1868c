"""Launching this package's Triton kernels at a small host cost.

`kernel[grid](...)` re-derives the kernel's specialization from every argument on every call (Triton's
`JITFunction.run`); per message that host time is larger than the kernel's own on a small tensor, and on a large one
it decides whether the host keeps ahead of the device. `launch` keeps each compiled kernel under a key built from the
same facts Triton specializes on, and calls the compiled kernel's launcher directly after the first call.

The kernels launched here take their arguments in three groups, in this order: tensors (pointers), runtime integers
(each listed in the kernel's `do_not_specialize`, so only their integer type is specialized), then constexprs.
The key is (kernel, device, options, constexprs, each tensor's dtype and 16-byte alignment, each integer's type):
exactly what Triton specializes these arguments on (checked against Triton's own specialization in the tests).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

_COMPILED: dict[tuple, Any] = {}
_INTERPRETED: dict[Any, bool] = {}


@functools.cache
def _triton() -> tuple[Any, Any]:
    from triton import knobs
    from triton.runtime import driver

    return driver, knobs


def interpreting(kernel: Any) -> bool:
    """Whether Triton's interpreter runs `kernel` (TRITON_INTERPRET=1 when it was defined): then nothing compiles."""
    interpreted = _INTERPRETED.get(kernel)
    if interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        interpreted = _INTERPRETED[kernel] = isinstance(kernel, InterpretedFunction)
    return interpreted


def int_type(v: int) -> str:
    """The integer type Triton gives a runtime int argument."""
    return "i32" if -(1 << 31) <= v < (1 << 31) else ("u64" if v >= 1 << 63 else "i64")


def key(kernel: Any, device: int, num_warps: int, tensors: tuple[Tensor, ...], ints: tuple[int, ...],
        consts: tuple[Any, ...]) -> tuple:
    """The cache key of a launch: what Triton's specialization of these arguments depends on."""
    return (kernel, device, num_warps, consts, tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors]),
            tuple([int_type(v) for v in ints]))


def launch(kernel: Any, grid: int, tensors: tuple[Tensor, ...], ints: tuple[int, ...], consts: tuple[Any, ...],
           num_warps: int) -> None:
    """kernel[(grid,)](*tensors, *ints, *consts, num_warps=num_warps, enable_fp_fusion=False) on the current device's
    current stream, as Triton launches it, through the compiled kernel's launcher once it is compiled."""
    args = tensors + ints + consts
    if interpreting(kernel):
        kernel[(grid,)](*args, num_warps=num_warps, enable_fp_fusion=False)
        return
    driver, knobs = _triton()
    device = driver.active.get_current_device()
    k = key(kernel, device, num_warps, tensors, ints, consts)
    compiled = _COMPILED.get(k)
    if compiled is None:  # the first launch of this specialization: Triton compiles (or loads) it, and launches it
        _COMPILED[k] = kernel.run(*args, grid=(grid,), warmup=False, num_warps=num_warps, enable_fp_fusion=False)
        return
    stream = driver.active.get_current_stream(device)
    enter = knobs.runtime.launch_enter_hook  # profilers' hooks see these launches as they see Triton's
    meta = compiled.launch_metadata((grid,), stream, *args) if enter is not None else None
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, enter,
                 knobs.runtime.launch_exit_hook, *args)
