"""What the device kernels' tests share: importing the kernels under Triton's interpreter (TRITON_INTERPRET=1) to run
them on CPU tensors, the comparison with the eager reference, the non-finite errors of both paths side by side, and
compiling the kernels for a Hopper GPU without one."""
import importlib
import os
import subprocess
import sys
from typing import Callable

import pytest
import torch

import pp_compress as ppc
from tests.integration.launch import HANG_S
from pp_compress.ops.base import Compressor, layout_nbytes
from pp_compress.ops.deferred import Deferred


def import_kernels(*names: str) -> None:
    """Import pp_compress.ops.<name> for each name with the interpreter on, the environment restored afterwards; skip
    the calling test module where this process already compiled the kernels for a device."""
    from pp_compress.ops import triton_launch

    loaded = sys.modules.get("pp_compress.ops._triton_int_kernels")  # every kernel module imports its helpers
    if loaded is not None and not triton_launch.interpreting(loaded.encode):
        pytest.skip("the kernels were compiled for a device in this process; the interpreter cannot take them over",
                    allow_module_level=True)
    lang = sys.modules.get("triton.language")  # its library functions (tl.max, ...) are made when it is imported
    assert lang is None or triton_launch.interpreting(lang.max), (
        "triton was imported in this process without TRITON_INTERPRET=1 before the interpreter tests, so its library "
        "functions cannot run under the interpreter: import it in a subprocess, or after these tests")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, as their modules are imported
    try:
        for name in names:
            importlib.import_module(f"pp_compress.ops.{name}")
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Triton's interpreter reads the variable when a kernel runs too; other tests do not see it (import this fixture
    into a test module to apply it there)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_matches_reference(op: Compressor, eager: Compressor, x: torch.Tensor, ctx: ppc.Context) -> None:
    """op's payload (dtypes, the layout's bytes, every tensor) and reconstruction are eager's, bitwise."""
    want, got = eager.compress(x, ctx), op.compress(x, ctx)
    assert [t.dtype for t in got.tensors] == [t.dtype for t in want.tensors]
    assert got.nbytes == layout_nbytes(op.layout(tuple(x.shape), x.dtype, ctx))
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors)), (op.spec, tuple(x.shape))
    y = op.decompress(got, ctx)
    assert y.dtype == x.dtype and torch.equal(y, eager.decompress(want, ctx)), (op.spec, tuple(x.shape))


def errors(specs: tuple[str, ...], call: Callable[[Compressor, ppc.Context], object], deferred: bool = False,
           nonfinite: str = "raise", step: int = 2) -> list[str]:
    """The FloatingPointError each spec's operator raises in `call` (with the step's checks deferred and read after
    it, if `deferred`), ':kernel=eager' taken out of the messages."""
    out = []
    for spec in specs:
        op = ppc.parse_spec(spec).spec_for(0, "act").build(nonfinite)
        ctx = ppc.Context(step=step, deferred=Deferred() if deferred else None)
        with pytest.raises(FloatingPointError) as e:
            call(op, ctx)
            if deferred:
                ctx.deferred.raise_pending()
        out.append(str(e.value).replace(":kernel=eager", ""))
    return out


def allowed_outcomes(specs: tuple[str, ...], x: torch.Tensor) -> list[tuple]:
    """What each spec's operator does with x under nonfinite="allow": ("ok", the output's NaN positions, the output
    with NaN as 0) or ("raised", the error, ':kernel=eager' and the reference's detail taken out)."""
    outcomes: list[tuple] = []
    for spec in specs:
        op = ppc.parse_spec(spec).spec_for(0, "act").build("allow")
        try:
            y = op.decompress(op.compress(x, ppc.Context()), ppc.Context())
            outcomes.append(("ok", y.isnan().nonzero().tolist(), y.nan_to_num().tolist()))
        except FloatingPointError as e:
            outcomes.append(("raised", str(e).replace(":kernel=eager", "").split(" (max")[0]))
    return outcomes


def hopper_ptx(fn, sig: dict[str, str], consts: dict, warps: int) -> str:
    """The PTX of the kernel `fn` compiled for sm_90 (`pp_lab.bench.ptxas.sm90_ptx`: no GPU needed, no contracted
    multiply-adds); asserts that it holds no contracted or approximate fp32 arithmetic."""
    from pp_lab.bench.ptxas import sm90_ptx

    ptx = sm90_ptx(fn, sig, consts, warps)
    for approx in ("fma.rn.f32", "div.full", "sqrt.approx"):  # the reference's IEEE roundings
        assert approx not in ptx, (fn, sig, approx)
    return ptx


def compiles_for_hopper(script: str) -> None:
    """Run `script` (which prints 'compiled' at its end; it may use `hopper_ptx`) without the interpreter: the device
    compiler's front end and PTX back end run without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
