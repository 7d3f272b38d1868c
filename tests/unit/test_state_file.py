"""The per-rank compression state file (pp_compress.runtime): untrusted input that never runs code, written
atomically, and checked on load with one error that names the file."""
import os
import pickle

import pytest
import torch

import pp_compress as ppc
from pp_compress import runtime
from pp_compress.policy import BoundaryPolicy
from tests.unit.state import state_tensors


def trained_policy(spec: str = "topk:0.1+ef") -> BoundaryPolicy:
    policy = BoundaryPolicy(ppc.parse_spec(spec))
    op = policy.op(0, "act", True)
    op.compress(torch.randn(4, 64), ppc.Context(direction="act"))  # error feedback now holds a residual
    return policy


def test_the_state_round_trips_and_carries_its_format(tmp_path):
    saved = trained_policy()
    runtime.save_state(saved, str(tmp_path), 3)
    assert os.listdir(tmp_path) == ["pp_compress_rank00003.pt"]  # no temporary file left behind
    assert torch.load(tmp_path / "pp_compress_rank00003.pt", weights_only=True)["format"] == runtime.STATE_FORMAT
    loaded = BoundaryPolicy(ppc.parse_spec("topk:0.1+ef"))
    runtime.load_state(loaded, str(tmp_path), 3)
    a, b = list(state_tensors(saved.state_dict())), list(state_tensors(loaded.state_dict()))
    assert a and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert loaded.state_dict()["config"] == saved.state_dict()["config"]


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_file_that_pickles_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    evil = _Payload()
    evil.marker = marker
    (tmp_path / "pp_compress_rank00000.pt").write_bytes(pickle.dumps({"config": "x", "ops": {}, "x": evil}))
    with pytest.raises(ValueError, match=r"pp_compress_rank00000.pt: not a pp_compress state file that can be read "
                                         r"safely .*it may be corrupt, truncated or hold code"):
        runtime.load_state(trained_policy(), str(tmp_path), 0)
    assert not marker.exists()


def test_a_truncated_file_a_foreign_file_and_another_config_each_name_the_file(tmp_path):
    runtime.save_state(trained_policy(), str(tmp_path), 0)
    path = tmp_path / "pp_compress_rank00000.pt"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="pp_compress_rank00000.pt: not a pp_compress state file that can be read"):
        runtime.load_state(trained_policy(), str(tmp_path), 0)
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=r"expected a dict with 'config' and 'ops'\); got dict with keys \['weights'\]"):
        runtime.load_state(trained_policy(), str(tmp_path), 0)
    torch.save({"format": 99, "config": "x", "ops": {}}, path)
    with pytest.raises(ValueError, match="state format 99; this pp_compress reads format 1"):
        runtime.load_state(trained_policy(), str(tmp_path), 0)
    path.write_bytes(whole)
    with pytest.raises(ValueError, match="pp_compress_rank00000.pt: this state was saved with config"):
        runtime.load_state(trained_policy("int4+ef"), str(tmp_path), 0)


def test_a_crash_while_writing_leaves_the_previous_file(tmp_path, monkeypatch):
    runtime.save_state(trained_policy(), str(tmp_path), 0)
    before = (tmp_path / "pp_compress_rank00000.pt").read_bytes()

    def crash(obj, f):
        with open(f, "wb") as out:
            out.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        runtime.save_state(trained_policy(), str(tmp_path), 0)
    assert (tmp_path / "pp_compress_rank00000.pt").read_bytes() == before
    assert os.listdir(tmp_path) == ["pp_compress_rank00000.pt"]
