"""pp_compress.torchtitan in torchtitan's own trainer (`torchtitan.train.main`, its llama3 debug model) on two CPU
processes with gloo, against stock torchtitan. torchtitan needs Python >= 3.11 and a newer torch than the main test
environment's: `make test` runs these in its second environment (torch 2.14.1, torchtitan 0.3.0)."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan runs in make test's second environment (.venv-torch-next)")

from pp_lab.torchtitan_cpu import make_assets  # noqa: E402

from tests.integration.launch import HANG_S, ROOT, run_job  # noqa: E402

WORKER = ROOT / "recipes" / "torchtitan_cpu.py"
FIXTURE = Path(__file__).parents[1] / "fixtures" / "shakespeare"
SMALL = ["--training.seq_len", "128", "--training.local_batch_size", "4", "--debug.seed", "42",
         "--training.disable_cuda_graphs", "--validator.no-enable", "--comm.init_timeout_seconds", "300"]
"""The debug model (6 layers, width 256) on 4 micro-batches of 128 tokens: seconds per step on CPU."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> list[str]:
    tokenizer, data, _ = make_assets(tmp_path_factory.mktemp("torchtitan_assets"), sorted(FIXTURE.glob("*.txt")))
    return ["--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(data)]


def train(out: Path, assets: list[str], module: str, *args: str, steps: int = 3) -> list[dict]:
    """torchtitan on 2 ranks (pipeline degree 2); returns the last stage's logged steps (exact loss and grad norm)."""
    out.mkdir(parents=True, exist_ok=True)
    rc, log = run_job(WORKER, 2, "--module", module, "--config", "llama3_debugmodel", *assets, *SMALL,
                      "--parallelism.pipeline_parallel_degree", "2", "--training.steps", str(steps),
                      "--dump_folder", str(out), *args,  # last: tyro's subcommands end the options
                      env={"TT_METRICS": str(out / "metrics")})
    assert rc == 0, log[-4000:]
    (out / "log.txt").write_text(log)
    (metrics,) = out.glob("metrics.rank*.jsonl")  # the last stage's rank logs the loss
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble",
                                      "ZBVZeroBubble", "DualPipeV"])
def test_identity_is_bitwise_stock_torchtitan(tmp_path, assets, schedule):
    args = ["--parallelism.pipeline_parallel_schedule", schedule, "--checkpoint.no-enable"]
    split = "Zero" in schedule or schedule == "DualPipeV"  # torchtitan's recomputation refuses a split backward
    last = ["activation-checkpoint:none"] if split else []
    stock = train(tmp_path / "stock", assets, "llama3", *args, *last)
    ident = train(tmp_path / "ident", assets, "pp_compress.torchtitan", *args, "--pp_compress.compression", "none",
                  *last)
    assert len(stock) == 3 and stock == ident  # losses and gradient norms, to the last bit
    log = (tmp_path / "ident" / "log.txt").read_text()
    assert "pp_compress step 3: b0.act 1.00x" in log  # identity counts the bytes it passes on


def test_safe_trains_and_reports_its_ratio_and_error_to_torchtitans_metrics(tmp_path, assets):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = train(tmp_path, assets, "pp_compress.torchtitan", "--parallelism.pipeline_parallel_schedule", "1F1B",
                  "--checkpoint.no-enable", "--metrics.enable_tensorboard", "--pp_compress.compression", "safe",
                  steps=4)
    losses = [float(s["loss"]) for s in steps]
    assert losses[-1] < losses[0] - 0.3  # it trains
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}  # the metrics rank's
    tb = EventAccumulator(str(events))
    tb.Reload()
    tags = tb.Tags()["scalars"]
    assert {"pp_compress/b0.act/ratio", "pp_compress/b0.grad/rel_error", "pp_compress/wire_MB"} <= set(tags)
    ratios = [e.value for e in tb.Scalars("pp_compress/b0.act/ratio")]
    assert len(ratios) == 4 and all(1.9 < r < 2.0 for r in ratios)  # int8 from the stages' bf16 activations
    errors = [e.value for e in tb.Scalars("pp_compress/b0.grad/rel_error")]
    assert all(0 < e < 0.02 for e in errors)
    assert "pp_compress step 4: b0.act 1.98x err 0.00" in (tmp_path / "log.txt").read_text()


def test_a_checkpoint_resumes_bitwise_with_two_stages_per_rank(tmp_path, assets):
    # DualPipeV: a V schedule, two stages per rank, so each rank's checkpoint entry holds two stages' error feedback
    args = ["--parallelism.pipeline_parallel_schedule", "DualPipeV", "--checkpoint.enable", "--checkpoint.interval",
            "2", "--pp_compress.compression", "int4+ef",
            "activation-checkpoint:none"]  # torchtitan's recomputation refuses a backward split in two
    whole = train(tmp_path / "whole", assets, "pp_compress.torchtitan", *args, steps=4)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    (tmp_path / "whole" / "checkpoint" / "step-2").rename(resumed / "checkpoint" / "step-2")
    tail = train(resumed, assets, "pp_compress.torchtitan", *args, steps=4)
    assert "Loading the checkpoint from" in (resumed / "log.txt").read_text()
    assert [s["step"] for s in tail] == [3, 4] and tail == whole[2:]


def test_compression_turned_on_at_a_restart_resumes_a_stock_checkpoint(tmp_path, assets):
    args = ["--parallelism.pipeline_parallel_schedule", "1F1B", "--checkpoint.enable", "--checkpoint.interval", "2"]
    stock = train(tmp_path / "stock", assets, "llama3", *args)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    (tmp_path / "stock" / "checkpoint" / "step-2").rename(resumed / "checkpoint" / "step-2")
    tail = train(resumed, assets, "pp_compress.torchtitan", *args, "--pp_compress.compression", "none")
    assert "this checkpoint holds no compression state" in (resumed / "log.txt").read_text()
    assert [s["step"] for s in tail] == [3] and tail == stock[2:]  # identity: stock's own step 3, to the bit


def test_a_bad_spec_stops_the_job_at_start_with_one_line(tmp_path, assets):
    import subprocess

    proc = subprocess.run([sys.executable, str(WORKER), "--module", "pp_compress.torchtitan", "--config",
                           "llama3_debugmodel", *assets, "--dump_folder", str(tmp_path), "--pp_compress.compression",
                           "int9"], capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["error: pp_compress: unsupported bit width in 'int9'; accepted: int1 .. int8"]
