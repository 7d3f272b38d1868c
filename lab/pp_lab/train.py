"""The training loop pretrain.py and finetune.py share: DeepSpeed pipeline + pp_compress, logs, checkpoints.

Every rank runs this. Rank 0 shows the progress bar and writes <out>/metrics.jsonl (one JSON object per
log step or evaluation: loss, lr, tokens/s, step time, wire bytes per step by direction, ratio, relative
error) and <out>/metrics.csv (the same train rows, for spreadsheets); TensorBoard too if installed.
Checkpoints (DeepSpeed format + compression state) go to <out>/ckpt every --save-every steps and at the
end; --resume continues from the latest one with the same data order.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import importlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from pp_compress.stats import merge_rows
from pp_lab.bottleneck import (FROM_DATA, INITS, TUNING, WITH_GRADS, Basis, Decoder, Encoder, data_bases, embedding_of,
                               fixed_basis, hidden_moments, random_tokens)
from pp_lab.model import GPT, GPTConfig, lm_loss, stage_cuts
from pp_lab.paths import CONFIGS


def add_args(ap: argparse.ArgumentParser, steps: int, lr: float) -> argparse.ArgumentParser:
    import deepspeed

    import pp_compress.deepspeed as ppd

    ap.add_argument("--stages", type=int, default=2,
                    help="pipeline stages (world size / (stages x tp) = data-parallel replicas)")
    ap.add_argument("--tp", type=int, default=1, help="Megatron-style tensor-parallel ranks per stage (lab/pp_lab/tp.py); "
                    "> 1 sends [seq, batch, hidden] between stages, and DeepSpeed partitions it over the TP ranks "
                    "unless the config's pipeline.pipe_partitioned is false")
    ap.add_argument("--sbh", action="store_true", help="[seq, batch, hidden] between stages also with --tp 1")
    ap.add_argument("--untied", action="store_true",
                    help="an output head of its own instead of the embedding's transpose: no gradient all-reduce of the "
                         "embedding between the first and the last stage each step (from a tied checkpoint the head "
                         "starts as a copy of the embedding)")
    ap.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step and replica")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=None, help="LR warm-up steps (default 5%% of --steps)")
    ap.add_argument("--weight-decay", type=float, default=0.1,
                    help="AdamW's decoupled weight decay (per step, lr x this); with --optimizer muon, scaled so that "
                         "the matrices decay per step as they would under AdamW at --lr")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="muon: DeepSpeed's Muon for the blocks' matrices (orthogonalised momentum at --muon-lr), "
                         "AdamW at --lr for the embedding, norms and biases (the DeepSpeed engine only)")
    ap.add_argument("--muon-lr", type=float, default=0.02, help="the Muon matrices' learning rate (--optimizer muon)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="bf16 weights/activations (what crosses the wire too)")
    ap.add_argument("--out", type=Path, required=True, help="run directory: metrics, checkpoints, summary")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100, help="0 = only at the end")
    ap.add_argument("--eval-batches", type=int, default=8, help="pipeline batches per evaluation")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint period in steps (0 = only at the end)")
    ap.add_argument("--keep-checkpoints", type=int, default=2,
                    help="newest checkpoints kept in <out>/ckpt, older ones deleted once a save completes (0 = keep all): "
                         "with +aqsgd each holds every sample's reference activations, so they grow with the run")
    ap.add_argument("--resume", action="store_true", help="continue from <out>/ckpt")
    ap.add_argument("--overwrite", action="store_true", help="discard an earlier run's metrics and checkpoints in --out")
    ap.add_argument("--eval-at-start", action="store_true", help="also evaluate before the first step (a fresh run)")
    ap.add_argument("--digest", action="store_true",
                    help="at the end, a sha256 of each rank's weights, optimizer state and compression state in "
                         "summary.json (to check that a resumed run ends bitwise where an uninterrupted one does)")
    ap.add_argument("--dualpipev", action="store_true",
                    help="DeepSpeed's DualPipeV schedule: each rank holds two stages of a V (--stages ranks, 2 x --stages "
                         "stages)")
    ap.add_argument("--bottleneck", type=int, default=None, metavar="K",
                    help="a learned bottleneck at every boundary (lab/pp_lab/bottleneck.py): the hidden state crosses "
                         "as K coordinates per token (then through --pp-compress) plus the first tokens in full")
    ap.add_argument("--bottleneck-init", choices=INITS, default=None,
                    help="pca: the boundary's principal subspace on calibration text (the default from a pretrained "
                         "checkpoint); blend: the top eigenvectors of its covariance plus --bottleneck-grad-weight "
                         "times the loss gradient's second moment, both of unit trace (a pretrained checkpoint); "
                         "fisher: the subspace weighted by the loss's gradient there (a pretrained checkpoint); random: "
                         "a seeded orthonormal basis (the default from scratch); identity")
    ap.add_argument("--bottleneck-sink", type=int, default=1, help="leading tokens that cross in full (attention sink)")
    ap.add_argument("--bottleneck-group", type=int, default=1,
                    help="tokens whose codes share one row on the wire (e.g. d / K: rows as wide as the hidden state)")
    ap.add_argument("--bottleneck-calib", type=int, default=384, metavar="N",
                    help="training sequences the pca, blend or fisher init is computed on, shared by the processes "
                         "(with d = 576, 24 estimate the covariance poorly: docs/bottleneck.md)")
    ap.add_argument("--bottleneck-fisher-damping", type=float, default=TUNING["fisher"], metavar="F",
                    help="fisher init: the gradient's second moment plus F times its mean eigenvalue (large F: pca)")
    ap.add_argument("--bottleneck-grad-weight", type=float, default=TUNING["blend"], metavar="W",
                    help="blend init: the weight of the loss gradient's second moment against the hidden state's "
                         "covariance (0: pca); the layers before a cut learn only from what its bottleneck passes back")
    ap.add_argument("--bottleneck-tokens", action="store_true",
                    help="each bottleneck also predicts every token's hidden state from its id (a table fitted with "
                         "the pca, blend or fisher init; from scratch, a seeded random one), its code carries the "
                         "rest, and the token ids cross beside it")
    ap.add_argument("--bottleneck-frozen", action="store_true",
                    help="keep the encoders and decoders at their initialisation (a fixed subspace)")
    ap.add_argument("--bottleneck-residual", type=int, default=0, metavar="R",
                    help="a trained residual branch of width R beside each encoder and decoder (ResBM's design): "
                         "their maps stay fixed at their initialisation, a low-rank identity path, and the branches "
                         "train from zero (0: none)")
    ap.add_argument("--bottleneck-lr-scale", type=float, default=1.0, metavar="F",
                    help="the encoders' and decoders' learning rate is F x --lr (new layers in a pretrained model "
                         "often learn at a larger rate than its body); the schedule scales both alike")
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    ppd.add_argparse_args(ap)
    deepspeed.add_config_arguments(ap)
    return ap


def init_distributed() -> None:
    """gloo on CPU, NCCL on GPUs; on CPU skip DeepSpeed's shared-memory op build (30-70 s, unused by p2p)."""
    import deepspeed

    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel")  # DeepSpeed's tied-weight sync
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def finish() -> None:
    """Leave cleanly (pp_compress.deepspeed.finish): barrier, remove DeepSpeed's shared-memory buffers, tear the
    process groups down, exit 0."""
    from pp_compress.deepspeed import finish as leave

    leave()


def rank0_first(fn: Any, *a: Any, **kw: Any) -> Any:
    """Run fn on rank 0 first (it fetches/tokenizes into the cache), then on the others (they hit the cache)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        dist.barrier()
    out = fn(*a, **kw)
    if dist.get_rank() == 0:
        dist.barrier()
    return out


def warn_if_slow_bf16(bf16: bool, cpuinfo: str | None = None) -> None:
    """Warn (once per process) when --bf16 runs on a CPU without bf16 matrix units (AVX512-BF16 or AMX):
    torch then emulates bf16 matmuls, 57x slower than fp32 on this project's AMD EPYC (98 s per finetuning step)."""
    if not bf16 or torch.cuda.is_available():
        return
    try:
        flags = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:  # not Linux: cannot tell
        return
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        warnings.warn("--bf16 on a CPU without AVX512-BF16/AMX: bf16 matmuls are emulated and run many times slower "
                      "than fp32 here (57x measured on an AMD EPYC); drop --bf16 on this machine", RuntimeWarning, stacklevel=2)


def param_groups(module: nn.Module, lr: float, bottleneck_scale: float,
                 optimizer: str = "adamw") -> list[dict[str, Any]]:
    """The optimizer's parameter groups: the trainable parameters at `lr`, the bottleneck's encoders and decoders at
    lr x bottleneck_scale (a group only where it has parameters). With Muon, one group that sets no rate: DeepSpeed
    splits it into Muon's half and AdamW's, each at its own rate from the config, which a group's rate would
    override."""
    if not bottleneck_scale > 0:
        raise SystemExit(f"--bottleneck-lr-scale {bottleneck_scale}; accepted: a number > 0")
    if optimizer == "muon":
        if bottleneck_scale != 1.0:
            raise SystemExit(f"--bottleneck-lr-scale {bottleneck_scale} with --optimizer muon; accepted: 1 (Muon's "
                             "matrices and AdamW's rest each take their rate from --muon-lr and --lr)")
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    inner = {id(p) for m in module.modules() if isinstance(m, (Encoder, Decoder)) for p in m.parameters()}
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if id(p) not in inner], "lr": lr},
              {"params": [p for p in trainable if id(p) in inner], "lr": lr * bottleneck_scale}]
    return [g for g in groups if g["params"]]


def with_bottleneck(args: argparse.Namespace, cfg: GPTConfig, checkpoint: str | Path | None,
                    train_ds: Any) -> tuple[GPTConfig, dict[int, Basis] | None]:
    """The model config with --bottleneck at the pipeline's cuts, and the bases its encoders and decoders start from
    (None: seeded random ones). The pca, blend and fisher inits run the checkpoint's model in this process on the first
    --bottleneck-calib training sequences; call it before seeding the weights (it draws random numbers)."""
    if args.bottleneck is None:
        for flag, value, owner in _init_options(args):
            if value != TUNING[owner]:
                raise SystemExit(f"{flag} {value} without --bottleneck: there is no bottleneck to initialise")
        if args.bottleneck_lr_scale != 1.0:
            raise SystemExit(f"--bottleneck-lr-scale {args.bottleneck_lr_scale} without --bottleneck: there is no "
                             "bottleneck to train")
        if args.bottleneck_tokens:
            raise SystemExit("--bottleneck-tokens without --bottleneck: there is no bottleneck to predict for")
        if args.bottleneck_residual:
            raise SystemExit(f"--bottleneck-residual {args.bottleneck_residual} without --bottleneck: there is no "
                             "bottleneck to put a branch beside")
        return cfg, None
    if args.bottleneck_residual < 0 or (args.bottleneck_residual and args.bottleneck_frozen):
        raise SystemExit(f"--bottleneck-residual {args.bottleneck_residual}"
                         f"{' with --bottleneck-frozen' if args.bottleneck_frozen else ''}; accepted: 0, or a width "
                         ">= 1 without --bottleneck-frozen (the maps stay fixed anyway; the branch is what trains)")
    cuts = tuple(int(c) - 1 for c in stage_cuts(cfg, args.stages))  # layer index (embedding first) -> block index
    cfg = dataclasses.replace(cfg, bottleneck=args.bottleneck, bottleneck_after=cuts, bottleneck_sink=args.bottleneck_sink,
                              bottleneck_group=args.bottleneck_group, bottleneck_trainable=not args.bottleneck_frozen,
                              bottleneck_tokens=args.bottleneck_tokens, bottleneck_residual=args.bottleneck_residual)
    how = args.bottleneck_init or ("pca" if checkpoint is not None else "random")
    # from scratch there is nothing to fit the table to: a seeded random one, as Subspace Networks re-add theirs
    scratch = how == "random" and checkpoint is None
    if args.bottleneck_tokens and how not in FROM_DATA and not scratch:
        raise SystemExit(f"--bottleneck-tokens with --bottleneck-init {how}"
                         f"{' from a pretrained --checkpoint' if checkpoint is not None else ''}: its table is fitted on "
                         f"calibration data; accepted: --bottleneck-init {' or '.join(FROM_DATA)} (from a pretrained "
                         "--checkpoint), or random without one (a seeded random table)")
    for flag, value, owner in _init_options(args):
        if value != TUNING[owner] and how != owner:
            raise SystemExit(f"{flag} {value} with --bottleneck-init {how}: it applies to --bottleneck-init {owner} "
                             "only")
    if not args.bottleneck_fisher_damping > 0:
        raise SystemExit(f"--bottleneck-fisher-damping {args.bottleneck_fisher_damping}; accepted: a number > 0")
    if not args.bottleneck_grad_weight > 0:
        raise SystemExit(f"--bottleneck-grad-weight {args.bottleneck_grad_weight}; accepted: a number > 0 (0 is "
                         "--bottleneck-init pca)")
    if args.bottleneck_calib < 1:
        raise SystemExit(f"--bottleneck-calib {args.bottleneck_calib}; accepted: a number of sequences >= 1")
    if how not in FROM_DATA:
        table = random_tokens(cfg.vocab_size, cfg.d_model, cfg.init_std, cfg.subspace_seed) if args.bottleneck_tokens \
            else None
        return cfg, {c: fixed_basis(cfg.d_model, args.bottleneck, how, cfg.subspace_seed + c)._replace(tokens=table)
                     for c in cuts}
    if checkpoint is None:
        raise SystemExit(f"--bottleneck-init {how} needs a pretrained --checkpoint (a model trained from scratch has "
                         "no subspace yet); accepted without one: random, identity")
    plain = GPT(dataclasses.replace(cfg, bottleneck=None, bottleneck_after=(), bottleneck_tokens=False),
                checkpoint).eval()
    calib = train_ds.with_format("torch", columns=["input_ids", "labels"])[: args.bottleneck_calib]
    seq_dim = 0 if cfg.layout == "sbh" else 1
    # each process takes every world-th batch of 4 sequences, and the moments' sums are added up across processes
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    ids, labels = calib["input_ids"].split(4)[rank::world], calib["labels"].split(4)[rank::world]
    grads = how in WITH_GRADS
    stats = hidden_moments(list(plain.layers), cuts, args.bottleneck_sink, list(zip(ids, labels)) if grads else ids,
                           seq_dim, args.bottleneck_tokens, lm_loss if grads else None)
    if world > 1:
        for m in stats.values():
            m.reduce(_sum_over_ranks)
    emb = embedding_of(list(plain.layers)) if args.bottleneck_tokens else None
    tuning = {owner: value for _, value, owner in _init_options(args)}.get(how)
    return cfg, data_bases(how, stats, args.bottleneck, emb, tuning)


def _init_options(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    """(flag, value, the init it tunes) of the options that tune one data init each (defaults: TUNING)."""
    return [("--bottleneck-fisher-damping", args.bottleneck_fisher_damping, "fisher"),
            ("--bottleneck-grad-weight", args.bottleneck_grad_weight, "blend")]


def _sum_over_ranks(t: Tensor) -> None:
    """Sum a CPU tensor over all processes in place, through the accelerator where the backend needs one (NCCL)."""
    if dist.get_backend() == "nccl":
        on = t.to(torch.cuda.current_device())
        dist.all_reduce(on)
        t.copy_(on.cpu())
    else:
        dist.all_reduce(t)


def config_path(args: argparse.Namespace) -> Path:
    """--deepspeed_config, else the ready config for this machine."""
    return Path(args.deepspeed_config or CONFIGS / ("gpu_nccl.json" if torch.cuda.is_available() else "cpu_gloo.json"))


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked on the command line, before any process work or any write to --out: the
    compression (--pp-compress over the config's section; one message and exit 2 if bad), the run directory, and a
    one-time note when the setting's recorded verdict on this model is worse than uncompressed
    (pp_compress.advice.advice)."""
    from pp_compress.advice import advice
    from pp_compress.runtime import check_args as check_compression, exit_once, launch_rank

    cfg = check_compression(args, str(config_path(args)))
    out = getattr(args, "out", None)
    if out is not None and not (getattr(args, "resume", False) or getattr(args, "overwrite", False)):
        old = [p.name for p in (out / "metrics.jsonl", out / "ckpt") if p.exists()]
        if old:
            exit_once(f"{out} holds an earlier run ({', '.join(old)}): pass --resume to continue it, --overwrite to "
                      "discard it, or another --out")
    note = advice(cfg, testbed(args))
    if note and launch_rank() == 0:
        print(f"pp_compress: {note}", file=sys.stderr)


def testbed(args: argparse.Namespace) -> str | None:
    """The studies' testbed a recipe run trains (pp_compress.presets.MODELS): pretraining's small GPT, or finetuning
    SmolLM2-135M (the default checkpoint); None for a model the studies have not measured."""
    if getattr(args, "model", None) == "small":
        return "small GPT"
    ckpt = getattr(args, "checkpoint", None)
    if hasattr(args, "checkpoint") and (ckpt is None or Path(ckpt).name.startswith("SmolLM2-135M")):
        return "SmolLM2-135M"
    return None


def ds_config(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    """The JSON config (`config_path`) with the CLI's sizes."""
    cfg = json.loads(config_path(args).read_text())
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    cfg.update(train_micro_batch_size_per_gpu=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
               train_batch_size=args.micro_batch * args.grad_accum * dp,
               steps_per_print=10**9)  # the progress bar and metrics.jsonl report instead
    cfg["bf16"] = {"enabled": bool(args.bf16)}
    warn_if_slow_bf16(bool(args.bf16))
    if args.optimizer == "muon":
        if not args.muon_lr > 0:
            raise SystemExit(f"--muon-lr {args.muon_lr}; accepted: a number > 0")
        # DeepSpeed shares one weight decay between Muon's half and AdamW's, and decoupled decay per step is lr x wd:
        # scaled so that the matrices, most of the weights, decay per step as they do under AdamW at --lr (the
        # embedding and norms then decay lr / muon_lr as much)
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": args.lr, "adam_lr": args.lr, "muon_lr": args.muon_lr,
                                                       "weight_decay": args.weight_decay * args.lr / args.muon_lr,
                                                       "betas": [0.9, 0.95], "momentum": 0.95, "torch_adam": True}}
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.weight_decay,
                                                        "betas": [0.9, 0.95], "torch_adam": True}}
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps, "warmup_num_steps": warmup,
                                                             "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}}
    cfg.setdefault("gradient_clipping", 1.0)
    return cfg


class Logger:
    """JSONL + CSV (+ TensorBoard) on rank 0; flushes every line (nothing lost on a crash).

    On resume from step `start`, the rows a cut-off run logged after its last checkpoint are dropped (those steps
    run again), then the files are appended to: every step appears once.
    """

    FIELDS = ["step", "tokens", "loss", "lr", "tokens_per_s", "step_s", "act_wire_bytes", "grad_wire_bytes",
              "act_raw_bytes", "grad_raw_bytes", "act_ratio", "grad_ratio", "act_rel_error", "grad_rel_error", "rss_mb"]

    def __init__(self, out: Path, active: bool, start: int = 0) -> None:
        self.active = active
        if not active:
            return
        if start:
            self._truncate(out, start)
        self.jsonl = open(out / "metrics.jsonl", "a")
        new = not (out / "metrics.csv").exists()
        # a resumed run keeps the columns its file started with (an older version may have logged fewer)
        fields = self.FIELDS if new else (out / "metrics.csv").read_text().split("\n", 1)[0].strip().split(",")
        self.csv_file = open(out / "metrics.csv", "a", newline="")
        self.csv = csv.DictWriter(self.csv_file, fields, extrasaction="ignore")
        if new:
            self.csv.writeheader()
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(out / "tb"))
        except ImportError:
            self.tb = None

    @staticmethod
    def _truncate(out: Path, start: int) -> None:
        for name in ("metrics.jsonl", "metrics.csv"):
            path = out / name
            if not path.exists():
                continue
            lines = path.read_text().splitlines(keepends=True)
            if name.endswith(".jsonl"):
                keep = [x for x in lines if json.loads(x)["step"] <= start]
            else:  # header, then rows whose first field is the step
                keep = lines[:1] + [x for x in lines[1:] if int(x.split(",", 1)[0]) <= start]
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text("".join(keep))
            tmp.replace(path)

    def write(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if row.get("kind") == "train":
            self.csv.writerow(row)
            self.csv_file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def close(self) -> None:
        """Flush and close every output (TensorBoard buffers its events; `finish` ends the process without finalizers)."""
        if not self.active:
            return
        self.jsonl.close()
        self.csv_file.close()
        if self.tb is not None:
            self.tb.close()


def digest(*states: Any) -> str:
    """sha256 of nested dicts / lists of tensors, numbers and strings (dict keys in sorted order): two states have
    one digest exactly when every tensor's dtype, shape and bytes and every other value agree."""
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, dict):
            h.update(b"{")
            for k in sorted(v, key=str):
                h.update(repr(k).encode())
                feed(v[k])
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[")
            for x in v:
                feed(x)
            h.update(b"]")
        else:
            h.update(repr(v).encode())

    for state in states:
        feed(state)
    return h.hexdigest()


def gather_digests(*states: Any) -> list[str]:
    """Every rank's digest(*states), in rank order, on every rank."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest(*states))
    return out


def rss_mb() -> float:
    """The largest resident memory of any rank, in MiB (every rank calls it at the same step)."""
    import psutil
    import torch.distributed as dist

    t = torch.tensor([psutil.Process().memory_info().rss / 2**20], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(float(t), 1)


def wire_totals(stats: dict[str, dict[str, Any]], counted: bool = True) -> dict[str, float]:
    """Sum over every rank of its sent bytes (both directions) and error terms, from each rank's compression `stats`
    (`counted`: whether this rank's count; DeepSpeed counts replica 0's)."""
    import torch.distributed as dist

    rows = {d: [0.0, 0.0, 0.0, 0.0] for d in ("act", "grad")}  # raw, wire, err_sq, ref_sq
    if counted:
        for key, s in stats.items():
            d = key.split(".")[1]
            if d in rows:
                rows[d] = [a + b for a, b in zip(rows[d], (s["raw_bytes"], s["wire_bytes"], s["err_sq"], s["ref_sq"]))]
    t = torch.tensor([v for d in ("act", "grad") for v in rows[d]], dtype=torch.float64)
    dist.all_reduce(t)
    out = {}
    for i, d in enumerate(("act", "grad")):
        raw, wire, err, ref = t[4 * i: 4 * i + 4].tolist()
        out.update({f"{d}_raw_bytes": raw, f"{d}_wire_bytes": wire, f"{d}_err_sq": err, f"{d}_ref_sq": ref})
    return out


def wire_rows(totals: dict[str, float], last: dict[str, float], n: int) -> dict[str, Any]:
    """A metrics row's per-step bytes, ratios and relative errors over the `n` steps between `last` and `totals`
    (`wire_totals`)."""
    row: dict[str, Any] = {}
    for d in ("act", "grad"):
        raw, wire = (totals[f"{d}_{k}_bytes"] - last[f"{d}_{k}_bytes"] for k in ("raw", "wire"))
        err, ref = (totals[f"{d}_{k}"] - last[f"{d}_{k}"] for k in ("err_sq", "ref_sq"))
        row.update({f"{d}_raw_bytes": raw / n, f"{d}_wire_bytes": wire / n, f"{d}_ratio": raw / wire if wire else 1.0,
                    f"{d}_rel_error": (err / ref) ** 0.5 if ref else None})  # None: not measured (error_every)
    return row


def evaluate(engine: Any, make_iter: Any, batches: int) -> float:
    """Mean loss of the first `batches` pipeline batches of the validation set (the same ones every time)."""
    return evaluate_batches(make_iter, batches, lambda it: float(engine.eval_batch(it)))


def evaluate_batches(make_iter: Any, batches: int, run: Any) -> float:
    """Mean of `run(it)` over `batches` calls, `it` an endless repeat of `make_iter()` (each call takes what one
    evaluation needs: an engine's micro-batches, or one whole batch)."""
    def repeat() -> Iterator:
        while True:
            n = 0
            for n, b in enumerate(make_iter(), 1):
                yield b
            if n == 0:
                raise SystemExit("the validation set holds less than one micro-batch: raise --val-fraction or lower --micro-batch")
    it = repeat()
    return sum(run(it) for _ in range(batches)) / batches


def train(args: argparse.Namespace, module: Any, model_cfg: dict[str, Any], train_ds: Any, val_ds: Any,
          batches_fn: Any, eval_batches_fn: Any) -> dict[str, Any]:
    """Run the loop; returns the summary (also written to <out>/summary.json)."""
    import torch.distributed as dist

    import pp_compress.deepspeed as ppd
    from pp_compress.stats import format_table

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (args.stages * args.tp):
        raise SystemExit(f"world size {world} is not a multiple of --stages x --tp = {args.stages} x {args.tp}")
    dp = world // (args.stages * args.tp)
    old = [p for p in (args.out / "metrics.jsonl", args.out / "ckpt") if p.exists()]
    if old and not args.resume:
        if not args.overwrite:
            raise SystemExit(f"{args.out} holds an earlier run ({', '.join(p.name for p in old)}): "
                             "pass --resume to continue it, --overwrite to discard it, or another --out")
        dist.barrier()
        if rank == 0:
            for p in old + [args.out / "metrics.csv", args.out / "summary.json", args.out / "run.json"]:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        dist.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    config = ds_config(args, dp)
    _, compression = ppd.resolve_config(config, args.pp_compress)
    if model_cfg.get("layout") == "sbh":  # the boundary tensors are [seq, batch, hidden]
        if compression.batch_dim not in (0, 1):
            raise SystemExit(f"pp_compress batch_dim={compression.batch_dim}, but this model sends [seq, batch, hidden]: "
                             "use batch_dim=1")
        if compression.batch_dim == 0 and rank == 0:
            print("pp_compress: the model sends [seq, batch, hidden], so batch_dim=1", file=sys.stderr)
        compression = dataclasses.replace(compression, batch_dim=1)
    engine, *_ = ppd.initialize(model=module, config=config, compression=compression,
                                model_parameters=param_groups(module, args.lr, args.bottleneck_lr_scale,
                                                              args.optimizer))
    ckpt = args.out / "ckpt"
    if args.resume:
        path, _ = engine.load_checkpoint(str(ckpt))
        if path is None:
            raise SystemExit(f"--resume: no checkpoint in {ckpt}")
    start = engine.global_steps
    dp_id = engine.grid.data_parallel_id
    shard = train_ds.shard(num_shards=dp, index=dp_id, contiguous=True) if dp > 1 else train_ds
    per_step = args.grad_accum
    train_iter = batches_fn(shard, args.micro_batch, args.seed, skip=start * per_step)
    tokens_per_step = args.micro_batch * args.grad_accum * dp * args.seq_len
    main = rank == 0
    log = Logger(args.out, main, start)
    if main and start == 0:
        (args.out / "run.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "model": model_cfg, "pp_compress": str(engine.pp_compress_config()),
                                                       "world": world, "stages": args.stages, "tp": args.tp}, indent=1))
    if args.eval_at_start and start == 0:  # where the run starts from (a bottleneck's initialisation, say)
        val_loss = evaluate(engine, lambda: eval_batches_fn(val_ds, args.micro_batch), args.eval_batches)
        log.write({"kind": "eval", "step": 0, "tokens": 0, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
    bar = tqdm(total=args.steps, initial=start, disable=not main, dynamic_ncols=True, unit="step")
    last = {"t": time.perf_counter(), "step": start, **wire_totals(engine.pp_compress_stats(), dp_id == 0)}
    losses: list[float] = []
    val_loss = math.nan
    for step in range(start + 1, args.steps + 1):
        losses.append(float(engine.train_batch(train_iter)))
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            now, totals = time.perf_counter(), wire_totals(engine.pp_compress_stats(), dp_id == 0)
            n = step - last["step"]
            row: dict[str, Any] = {"kind": "train", "step": step, "tokens": step * tokens_per_step,
                                   "loss": sum(losses) / len(losses), "lr": engine.get_lr()[0],
                                   "step_s": (now - last["t"]) / n, "tokens_per_s": n * tokens_per_step / (now - last["t"]),
                                   "rss_mb": rss_mb()}
            row.update(wire_rows(totals, last, n))
            log.write(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            wire=f"{row['act_ratio']:.1f}x/{row['grad_ratio']:.1f}x")
            last, losses = {"t": time.perf_counter(), "step": step, **totals}, []
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            val_loss = evaluate(engine, lambda: eval_batches_fn(val_ds, args.micro_batch), args.eval_batches)
            log.write({"kind": "eval", "step": step, "tokens": step * tokens_per_step, "val_loss": val_loss,
                       "val_ppl": math.exp(min(val_loss, 50))})
            bar.write(f"step {step}: val loss {val_loss:.4f}") if main else None
            last["t"] = time.perf_counter()  # evaluation time is not training time
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            engine.save_checkpoint(str(ckpt), client_state={"model": model_cfg})
            dist.barrier()  # every rank has written its part before any old checkpoint goes
            if main:
                prune_checkpoints(ckpt, args.keep_checkpoints)
            last["t"] = time.perf_counter()
    bar.close()
    log.close()
    every = [None] * world
    dist.all_gather_object(every, {k: v for k, v in engine.pp_compress_stats().items() if v["calls"]} if dp_id == 0 else {})
    stats = merge_rows(every)
    summary = {"final_val_loss": val_loss, "steps": args.steps, "pp_compress": str(engine.pp_compress_config()),
               "stats": stats}
    if args.digest:
        summary["digest"] = gather_digests(engine.module.state_dict(), engine.optimizer.state_dict(),
                                           engine.pp_compress.state_dict(), engine.lr_scheduler.state_dict())
    if main:
        print(f"pp_compress {engine.pp_compress_config()}, all boundaries of replica 0, since this process started:\n"
              f"{format_table(dict(sorted(stats.items())))}", file=sys.stderr)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: final val loss {val_loss:.4f}; metrics in {args.out / 'metrics.jsonl'}", file=sys.stderr)
    return summary


def prune_checkpoints(ckpt: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest DeepSpeed checkpoints (global_step<N>) in `ckpt`, never the one `latest` names;
    keep=0 keeps all. Returns what was deleted."""
    if keep < 0:
        raise ValueError(f"--keep-checkpoints {keep}; accepted: 0 (keep all) or a positive count")
    steps = sorted((p for p in ckpt.glob("global_step*") if p.name.removeprefix("global_step").isdigit()),
                   key=lambda p: int(p.name.removeprefix("global_step")))
    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    gone = [p for p in steps[: len(steps) - keep] if p.name != latest] if keep else []
    for p in gone:
        shutil.rmtree(p)
    return gone

