import importlib.util
import subprocess
import sys

import pytest


def test_import_is_light():
    code = "import sys, pp_compress; bad = [m for m in ('deepspeed', 'transformers') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_public_api_names():
    import pp_compress as ppc

    for name in ["build", "parse_spec", "CompressionConfig", "CompressionBoundary", "insert_boundaries", "Payload", "Context"]:
        assert name in ppc.__all__ and hasattr(ppc, name)


def test_the_torchtitan_package_names_its_extra_where_torchtitan_is_missing():
    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan is installed in this environment")
    with pytest.raises(ImportError, match=r"not installed here: pip install 'pp_compress\[torchtitan\]'"):
        import pp_compress.torchtitan  # noqa: F401
