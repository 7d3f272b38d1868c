"""Engine version guards: an adapter that patches an engine's private internals runs only on the versions it was
tested with, unless the user accepts the risk.

Each engine adapter declares its tested range (an `EngineRange`) and calls `check` when it is enabled. Outside the
range it stops with one message that names the installed version, the tested ones and the override,
`PP_COMPRESS_ALLOW_UNTESTED_ENGINE=1`: a silent mismatch with a moved internal is the worst outcome, a run that
trains wrongly or slowly.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

OVERRIDE = "PP_COMPRESS_ALLOW_UNTESTED_ENGINE"
"""Set to 1 to run an adapter on an engine version outside its tested range (with a warning instead of an error)."""


def release(version: str) -> tuple[int, int, int]:
    """The (major, minor, patch) of a version string such as '0.19.8', '2.11.0+cu130' or '2.13.0a0+git123'."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"cannot read a release number from the version {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class EngineRange:
    """The versions of one engine an adapter was tested with."""

    engine: str
    """The engine's name as users know it ('DeepSpeed', 'torch.distributed.pipelining')."""
    lowest: str
    """The lowest tested release (inclusive)."""
    highest: str
    """The highest tested release (inclusive, by major.minor.patch: local builds such as +cu130 count as it)."""
    tested: tuple[str, ...]
    """The releases the tests actually ran on."""
    extra: str
    """How to install a tested version, for the message."""

    def __post_init__(self) -> None:
        if release(self.lowest) > release(self.highest):
            raise ValueError(f"{self.engine}: lowest {self.lowest} is above highest {self.highest}")

    def contains(self, version: str) -> bool:
        return release(self.lowest) <= release(version) <= release(self.highest)

    def check(self, version: str) -> None:
        """Raise (or, with the override set, warn) when `version` lies outside the tested range."""
        if self.contains(version):
            return
        found = (f"pp_compress's {self.engine} adapter patches {self.engine} internals and was tested with "
                 f"{self.engine} {self.lowest} to {self.highest} (runs on {', '.join(self.tested)}); this is {version}")
        if os.environ.get(OVERRIDE) == "1":
            warnings.warn(f"{found}: running anyway, since {OVERRIDE}=1", RuntimeWarning, stacklevel=3)
            return
        raise RuntimeError(f"{found}. Install a tested version ({self.extra}), or set {OVERRIDE}=1 to run anyway at "
                           "your own risk")
