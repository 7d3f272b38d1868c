"""CompressedTrainer's checks before anything is built, its section, its metrics and its stage builder's patch."""
import json

import pytest

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan runs in make test's second environment")

from torchtitan.distributed import pipeline_parallel  # noqa: E402

from pp_compress.config import parse_spec  # noqa: E402
from pp_compress.torchtitan import TESTED, CompressedTrainer, PPCompress, config_registry  # noqa: E402
from pp_compress.torchtitan.trainer import _compressing, metric_rows  # noqa: E402
from pp_compress.versions import OVERRIDE  # noqa: E402


def config(**parallelism):
    cfg = config_registry.llama3_debugmodel()
    for k, v in parallelism.items():
        setattr(cfg.parallelism, k, v)
    return cfg


def test_the_installed_torchtitan_is_in_the_tested_range():
    assert TESTED.contains(torchtitan.__version__)


def test_what_cannot_be_served_is_refused_before_anything_is_built(monkeypatch):
    with pytest.raises(ValueError, match="--parallelism.pipeline_parallel_degree is 1: set it to 2 or more"):
        CompressedTrainer(config())
    with pytest.raises(NotImplementedError, match="'tensor_parallel_degree': 2.*pipeline and data parallelism only"):
        CompressedTrainer(config(pipeline_parallel_degree=2, tensor_parallel_degree=2))
    monkeypatch.delenv(OVERRIDE, raising=False)
    monkeypatch.setattr(torchtitan, "__version__", "0.4.0")
    with pytest.raises(RuntimeError, match="tested with torchtitan 0.3.0 to 0.3.0 .*this is 0.4.0"):
        CompressedTrainer(config(pipeline_parallel_degree=2))


def test_the_section_reads_a_spec_or_a_file_and_a_bad_one_stops_with_one_line(tmp_path, capsys, monkeypatch):
    assert str(PPCompress().resolve()) == str(PPCompress(compression="none").resolve())
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"pp_compress": {"activations": "int8", "gradients": "int4:stoch"}}))
    assert str(PPCompress(config_file=str(f)).resolve()) == "act=int8,grad=int4:stoch"
    assert PPCompress(compression="safe", config_file=str(f)).resolve() == parse_spec("safe")  # the option wins
    monkeypatch.setenv("RANK", "0")
    for bad, says in [({"compression": "int9"}, "unsupported bit width in 'int9'"),
                      ({"config_file": str(tmp_path / "missing.json")}, "No such file")]:
        with pytest.raises(SystemExit) as e:
            PPCompress(**bad)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: pp_compress") and says in err


def test_metric_rows_are_cumulative_ratios_errors_and_megabytes():
    rows = {"b0.act": {"ratio": 4.0, "rel_error": 0.01, "ref_sq": 1.0, "raw_bytes": 4e6, "wire_bytes": 1e6},
            "b0.grad": {"ratio": 2.0, "rel_error": float("nan"), "ref_sq": 0.0, "raw_bytes": 2e6, "wire_bytes": 1e6}}
    assert metric_rows(rows) == {"pp_compress/b0.act/ratio": 4.0, "pp_compress/b0.act/rel_error": 0.01,
                                 "pp_compress/b0.grad/ratio": 2.0, "pp_compress/raw_MB": 6.0,
                                 "pp_compress/wire_MB": 2.0}


def test_the_stage_class_is_swapped_for_the_builders_call_only():
    stock = pipeline_parallel.PipelineStage
    seen = []

    def build(*args, **kwargs):
        seen.append(pipeline_parallel.PipelineStage)
        raise RuntimeError("the builder failed")

    with pytest.raises(RuntimeError, match="the builder failed"):
        _compressing(build, PPCompress().resolve(), [])()
    assert seen and seen[0] is not stock and pipeline_parallel.PipelineStage is stock
