"""Engine version guards: an adapter runs on the engine versions it was tested with, and outside them stops with one
message that names them and the override (or warns, with the override set)."""
import pytest
import torch

from pp_compress.versions import OVERRIDE, EngineRange, release

RANGE = EngineRange("DeepSpeed", "0.18.9", "0.19.8", ("0.18.9", "0.19.8"), "pip install 'pp_compress[deepspeed]'")


def test_release_reads_local_and_pre_release_versions():
    assert release("0.19.8") == (0, 19, 8) and release("2.11.0+cu130") == (2, 11, 0)
    assert release("2.13.0a0+git1234") == (2, 13, 0) and release("2.4") == (2, 4, 0)
    with pytest.raises(ValueError, match="cannot read a release number from the version 'dev'"):
        release("dev")


def test_inside_the_range_passes_and_outside_it_stops_with_one_message(monkeypatch):
    monkeypatch.delenv(OVERRIDE, raising=False)
    for version in ("0.18.9", "0.19.0", "0.19.8+local"):
        RANGE.check(version)
    for version in ("0.18.8", "0.20.0"):
        with pytest.raises(RuntimeError, match=rf"tested with DeepSpeed 0.18.9 to 0.19.8 \(runs on 0.18.9, 0.19.8\); "
                                               rf"this is {version}\. Install a tested version \(pip install "
                                               rf"'pp_compress\[deepspeed\]'\), or set {OVERRIDE}=1"):
            RANGE.check(version)


def test_the_override_turns_the_stop_into_a_warning(monkeypatch):
    monkeypatch.setenv(OVERRIDE, "1")
    with pytest.warns(RuntimeWarning, match=f"this is 0.20.0: running anyway, since {OVERRIDE}=1"):
        RANGE.check("0.20.0")
    with pytest.raises(ValueError, match="lowest 0.2.0 is above highest 0.1.0"):
        EngineRange("x", "0.2.0", "0.1.0", (), "")


def test_the_installed_engines_are_in_their_adapters_ranges():
    from pp_compress.torch_pipelining import TESTED as TORCH

    assert TORCH.contains(torch.__version__)
    deepspeed = pytest.importorskip("deepspeed")
    from pp_compress.integrations.deepspeed import TESTED as DS

    assert DS.contains(deepspeed.__version__)


def test_enabling_the_deepspeed_adapter_on_an_untested_release_stops_before_anything(monkeypatch):
    deepspeed = pytest.importorskip("deepspeed")
    import pp_compress.deepspeed as ppd

    monkeypatch.delenv(OVERRIDE, raising=False)
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    stock = deepspeed.initialize
    with pytest.raises(RuntimeError, match="this is 0.20.1"):
        ppd.enable()
    assert deepspeed.initialize is stock  # nothing was patched
