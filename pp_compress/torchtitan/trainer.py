"""torchtitan's Trainer with compressed pipeline-parallel traffic (see the package docstring for the command line).

What it changes, and nothing else:
- the stages: the model spec's `pipelining_fn` (torchtitan's `pipeline_llm` for its language models) runs with
  `torchtitan.distributed.pipeline_parallel.PipelineStage` bound to `CompressedPipelineStage` for the length of that
  call. That module-level name is the one torchtitan internal this adapter touches: its stage builder
  (`_pipeline_module_split`) constructs stages by it, and no public option chooses the stage class;
- after each step: the non-finite check of the step's messages, and on torchtitan's log steps the compression
  statistics of every stage, gathered over the pipeline group and logged by the metrics rank (console, and
  TensorBoard / W&B through torchtitan's metric logger) under `pp_compress/...`;
- the train state in checkpoints: each rank's compression state (error feedback, `auto`'s choices, the step) as one
  entry keyed by its global rank, so a resumed run continues bitwise (resuming needs the same ranks and stages); a
  checkpoint without these entries (written by stock torchtitan) loads with a fresh compression state.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

try:
    import torchtitan
except ImportError as e:
    raise ImportError("pp_compress.torchtitan extends torchtitan, which is not installed here: pip install "
                      f"'pp_compress[torchtitan]' (tested: torchtitan 0.3.0, Python >= 3.11) ({e})") from e
from torchtitan.distributed import pipeline_parallel
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..config import CompressionConfig
from ..runtime import check_args, load_state_bytes, state_bytes
from ..stats import merge_rows
from ..torch_pipelining import CompressedPipelineStage
from ..versions import EngineRange

TESTED = EngineRange("torchtitan", "0.3.0", "0.3.0", ("0.3.0 (torch 2.14.1, Python 3.11) on CPU with gloo",),
                     "pip install 'pp_compress[torchtitan]'")
"""The torchtitan releases whose Trainer and stage builder this adapter was tested against."""


@dataclass(kw_only=True, slots=True)
class PPCompress:
    """The `pp_compress` section of the job config (`--pp_compress.compression safe`)."""

    compression: str = ""
    """A spec: a preset (`safe`, `aggressive`, `auto`) or a codec per direction (`act=int8,grad=int3:stoch`); empty:
    `config_file`'s section, else `none` (identity: stock torchtitan's numbers, with the bytes counted)."""
    config_file: str = ""
    """A JSON or YAML file whose "pp_compress" section is the compression (per-boundary settings and the rest of the
    section's keys); `compression` wins over it."""

    def __post_init__(self) -> None:
        self.resolve()  # a bad spec or file stops the job as the command line is parsed, with one line

    def resolve(self) -> CompressionConfig:
        """The CompressionConfig this section asks for."""
        return check_args(argparse.Namespace(pp_compress=self.compression or None), self.config_file or None)


class CompressedTrainer(Trainer):
    """torchtitan's Trainer whose pipeline stages send compressed activations and activation-gradients."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pp_compress: PPCompress = field(default_factory=PPCompress)
        """What crosses between pipeline stages, and how (`PPCompress`)."""

        @classmethod
        def of(cls, stock: Trainer.Config) -> CompressedTrainer.Config:
            """`stock` (a config of torchtitan's Trainer) with a `pp_compress` section."""
            if type(stock) is not Trainer.Config:
                raise TypeError(f"pp_compress.torchtitan wraps configs of torchtitan's Trainer; this one is a "
                                f"{type(stock).__qualname__} (its trainer is another class)")
            return cls(**{f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)})

    def __init__(self, config: Config) -> None:
        TESTED.check(torchtitan.__version__)
        par = config.parallelism
        if par.pipeline_parallel_degree <= 1:
            raise ValueError("pp_compress.torchtitan compresses what pipeline stages send each other, and "
                             f"--parallelism.pipeline_parallel_degree is {par.pipeline_parallel_degree}: set it to 2 "
                             "or more, or drop --module pp_compress.torchtitan")
        others = {"tensor_parallel_degree": par.tensor_parallel_degree,
                  "context_parallel_degree": par.context_parallel_degree}
        if any(v > 1 for v in others.values()):
            raise NotImplementedError(f"pp_compress.torchtitan with {others}: stages then exchange DTensor shards, "
                                      "which this adapter was not tested with; pipeline and data parallelism only")
        spec = config.model_spec
        if spec is None or spec.pipelining_fn is None:
            raise ValueError(f"model {getattr(spec, 'name', None)!r} has no pipelining_fn: torchtitan cannot pipeline "
                             "it")
        self.pp_stages: list[CompressedPipelineStage] = []
        """This rank's stages (two per rank under interleaved and V schedules)."""
        config.model_spec = dataclasses.replace(
            spec, pipelining_fn=_compressing(spec.pipelining_fn, config.pp_compress.resolve(), self.pp_stages))
        super().__init__(config)
        if not self.pp_stages:
            raise RuntimeError(f"{spec.name}'s pipelining_fn ({spec.pipelining_fn.__qualname__}) built its stages "
                               "without torchtitan.distributed.pipeline_parallel.PipelineStage, so nothing would be "
                               "compressed")
        self._stats_group = self.parallel_dims.get_mesh("pp").get_group()
        self._state_in_checkpoint = True
        """Whether checkpoints hold this rank's compression state (False only while a checkpoint written without it
        loads)."""
        self.checkpointer.load = self._loading(self.checkpointer.load)

    def train_step(self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
        super().train_step(data_iterator)
        for stage in self.pp_stages:
            stage.pp_compress_check()
        if self.metrics_processor.should_log(self.step):
            self._log_stats()

    def pp_compress_stats(self) -> dict[str, dict[str, Any]]:
        """Every stage's counters in this pipeline group, one row per boundary and direction ("b0.act", "b0.grad",
        "b0.act_eval"; summed over the stages that count them). A collective over the pipeline group."""
        mine = merge_rows([s.pp_compress_stats() for s in self.pp_stages])
        every: list[Any] = [None] * dist.get_world_size(self._stats_group)
        dist.all_gather_object(every, mine, group=self._stats_group)
        return merge_rows(every)

    def _log_stats(self) -> None:
        rows = {k: r for k, r in self.pp_compress_stats().items() if r["calls"]}
        metrics = metric_rows(rows)
        self.metrics_processor.logger.log(metrics, self.step)  # a no-op logger on all but the metrics rank
        parts = [f"{k} {r['ratio']:.2f}x" + (f" err {r['rel_error']:.4f}" if r["ref_sq"] else "")  # err: if measured
                 for k, r in sorted(rows.items())]
        logger.info(f"pp_compress step {self.step}: {' | '.join(parts)} | wire {metrics['pp_compress/wire_MB']:.3f} MB "
                    f"of {metrics['pp_compress/raw_MB']:.3f} MB")

    # --- checkpoints: torchtitan saves the trainer as "train_state" ----------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self._state_in_checkpoint:
            return super().state_dict()
        return {**super().state_dict(), self._state_key(): state_bytes(_Stages(self.pp_stages))}

    def _loading(self, load: Callable[[int], bool]) -> Callable[[int], bool]:
        """The checkpointer's `load`, which also resumes a checkpoint written without pp_compress (compression turned on
        at a restart): the rest loads, and the compression state starts afresh, with a warning. torchtitan's checkpoint
        loader refuses a checkpoint that lacks an entry of the train state before it reads anything, so the second try
        starts from where the first did."""
        def checked(step: int = -1) -> bool:
            try:
                return load(step)
            except (RuntimeError, CheckpointException) as e:  # the latter, where ranks gather their failures
                if "train_state.pp_compress_rank" not in str(e):
                    raise
            logger.warning("pp_compress: this checkpoint holds no compression state (written without "
                           "pp_compress.torchtitan, or by other ranks): the rest loads, and error feedback and auto's "
                           "choices start afresh")
            self._state_in_checkpoint = False
            try:
                return load(step)
            finally:
                self._state_in_checkpoint = True
        return checked

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._state_in_checkpoint:
            key = self._state_key()
            load_state_bytes(_Stages(self.pp_stages), state_dict[key], f"checkpoint entry train_state.{key}")

    @staticmethod
    def _state_key() -> str:
        """Per global rank: entries that ranks share a key for are written once (data-parallel replicas of a stage
        hold different error feedback)."""
        return f"pp_compress_rank{dist.get_rank():05d}"


class _Stages:
    """A rank's stages' compression state as one state (runtime.state_bytes / load_state_bytes)."""

    def __init__(self, stages: list[CompressedPipelineStage]) -> None:
        self.stages = stages

    def state_dict(self) -> dict[str, Any]:
        states = {s.stage_index: s.pp_compress_state_dict() for s in self.stages}
        return {"config": str(self.stages[0].pp_compress.cfg), "ops": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # each stage's policy checks the config
        saved = sorted(state["ops"])
        if saved != sorted(s.stage_index for s in self.stages):
            raise ValueError(f"this state holds stages {saved}; this rank runs stages "
                             f"{sorted(s.stage_index for s in self.stages)} (resume with the same ranks and schedule)")
        for s in self.stages:
            s.load_pp_compress_state_dict(state["ops"][s.stage_index])


def metric_rows(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Scalars for torchtitan's metric logger from merged stats rows (cumulative since the run started)."""
    out: dict[str, float] = {}
    for key, r in sorted(rows.items()):
        out[f"pp_compress/{key}/ratio"] = r["ratio"]
        if r["ref_sq"]:
            out[f"pp_compress/{key}/rel_error"] = r["rel_error"]
    out["pp_compress/raw_MB"] = sum(r["raw_bytes"] for r in rows.values()) / 1e6
    out["pp_compress/wire_MB"] = sum(r["wire_bytes"] for r in rows.values()) / 1e6
    return out


def _compressing(build: Callable[..., Any], cfg: CompressionConfig,
                 built: list[CompressedPipelineStage]) -> Callable[..., Any]:
    """`build` (a model spec's pipelining_fn) building CompressedPipelineStage where it builds PipelineStage; the stages
    it builds are appended to `built`."""
    def pipelining_fn(*args: Any, **kwargs: Any) -> Any:
        def stage(*a: Any, **kw: Any) -> CompressedPipelineStage:
            built.append(CompressedPipelineStage(*a, compression=cfg, **kw))
            return built[-1]

        stock = pipeline_parallel.PipelineStage
        pipeline_parallel.PipelineStage = stage
        try:
            return build(*args, **kwargs)
        finally:
            pipeline_parallel.PipelineStage = stock
    return pipelining_fn
