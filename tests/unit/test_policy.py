"""The boundary policy's accounting: a compressing spec that compresses nothing warns once and says why."""
import warnings

import pytest
import torch

import pp_compress as ppc
from pp_compress.pipe import StageCompression
from pp_compress.policy import NOOP_WARN_AFTER
from pp_compress.stats import format_table


def _send(stage: StageCompression, tensors, step: int = 0, mb: int = 0) -> None:
    stage.send(tensors, 0, "act", step=step, micro_batch=mb, training=True, send_fn=lambda t: None)


def test_tensors_below_min_numel_warn_once_naming_size_and_setting():
    stage = StageCompression(ppc.parse_spec("act=int8,grad=topk:0.1+ef"), 0, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for mb in range(3 * NOOP_WARN_AFTER):
            _send(stage, [torch.randn(8, 64), torch.arange(8)], mb=mb)
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1
    assert "512 elements" in msgs[0] and "(8, 64)" in msgs[0] and "min_numel=1024" in msgs[0]
    assert "'act=int8,grad=topk:0.1+ef,min_numel=0'" in msgs[0] and '"min_numel": 0' in msgs[0]
    s = stage.stats["b0.act"]
    assert s.noop and s.skipped == 3 * NOOP_WARN_AFTER and s.compressed == 0
    assert s.as_dict()["note"] == "skipped (below min_numel)"
    table = format_table(stage.stats)
    assert "skipped (below min_numel)" in table and "nan" not in table and "1.00" not in table


def test_a_boundary_with_no_float_tensors_warns_too():
    stage = StageCompression(ppc.parse_spec("int8"), 0, 2)
    with pytest.warns(RuntimeWarning, match="no tensor it sends is floating point"):
        for mb in range(NOOP_WARN_AFTER):
            _send(stage, [torch.arange(4096)], mb=mb)
    assert stage.stats["b0.act"].skip_reason == "no floating-point tensors"


@pytest.mark.parametrize("spec", ["none", "int8,warmup=100", "int8,min_numel=0"])
def test_identity_warmup_and_compressed_traffic_never_warn(spec):
    stage = StageCompression(ppc.parse_spec(spec), 0, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mb in range(2 * NOOP_WARN_AFTER):
            _send(stage, [torch.randn(8, 64)], mb=mb)
    s = stage.stats["b0.act"]
    assert not s.noop and s.as_dict()["note"] == ""
    assert s.compressed == (2 * NOOP_WARN_AFTER if spec.endswith("min_numel=0") else 0)


def test_some_compressed_messages_mean_no_warning():
    stage = StageCompression(ppc.parse_spec("int8"), 0, 2)
    _send(stage, [torch.randn(64, 64)])  # compressed once: the setting does something here
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mb in range(2 * NOOP_WARN_AFTER):
            _send(stage, [torch.randn(8, 64)], mb=mb + 1)
    s = stage.stats["b0.act"]
    assert s.as_dict()["note"] == "" and not s.noop and s.skipped == 2 * NOOP_WARN_AFTER and s.compressed == 1


def test_in_process_boundary_counts_the_same_way():
    b = ppc.CompressionBoundary("int8")
    with pytest.warns(RuntimeWarning, match="below min_numel"):
        for _ in range(NOOP_WARN_AFTER):
            b(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert b.stats["act"].noop and b.stats["grad"].noop and b.stats["act"].compressed == 0


def test_spec_of_the_account_is_the_one_that_applies():
    stage = StageCompression(ppc.parse_spec("act=none,grad=int8"), 0, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # activations are identity: nothing was asked, nothing to warn about
        for mb in range(NOOP_WARN_AFTER):
            _send(stage, [torch.randn(2, 2)], mb=mb)
    assert stage.stats["b0.act"].skipped == 0
