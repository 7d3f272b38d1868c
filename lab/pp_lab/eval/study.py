"""The quality study of issue 5 on the real pipeline: one pretraining run per compression setting.

    python eval/study.py --protocol long      # the headline testbed (issue 17): 1,000 steps, resumable mid-run
    python eval/study.py --protocol smollm2   # the real-model testbed (issue 24): SmolLM2-135M, `make models` first
    python eval/study.py                      # the short 120-step protocol (history), resumable: finished runs are skipped
    python eval/study.py --only base,topk0.1  # some of them
    python eval/study.py --finetune           # the finetuning settings (SmolLM2-135M; `make models` first)
    python eval/study.py --protocol megatron  # the small GPT on Megatron-Core (issue 70)
    python eval/report.py                     # -> results/eval/RESULTS.md + plots from the runs

Every run is recipes/pretrain.py with the same model, data, seed and steps (4 pipeline stages on CPU
processes, gloo), differing only in --pp-compress. Runs with error compensation are also evaluated
without compression at inference (recipes/infer.py, `--pp-compress none`, the same validation batches).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from pp_lab.bench.e2e import AUTO_LINE, THROTTLE
from pp_lab.paths import RESULTS, ROOT
from pp_lab.launch import run_job



def topk(ratio: str, where: str) -> str:
    return {"both": f"topk:{ratio}", "act": f"act=topk:{ratio},grad=none", "grad": f"act=none,grad=topk:{ratio}"}[where]


# name -> spec, the most informative first (the study is resumable and can be cut short)
SETTINGS: dict[str, str] = {
    "base": "none", "topk0.1": "topk:0.1", "topk0.1+ef": "topk:0.1+ef", "topk0.1+ef21": "topk:0.1+ef21",
    "topk0.1+aqsgd": "topk:0.1+aqsgd", "int8": "int8", "act-int4_grad-int8": "act=int4,grad=int8",
    "act-int2": "act=int2,grad=none", "act-topk0.1": topk("0.1", "act"), "grad-topk0.1": topk("0.1", "grad"),
    "randk0.13": "randk:0.13", "lowrank10": "lowrank:10",  # matched to topk:0.1's 7.6x: 0.13*32 bits; 10*(128+192)/(128*192)
    **{f"{'' if w == 'both' else w + '-'}topk{r}": topk(r, w) for w in ("both", "act", "grad") for r in ("0.5", "0.3", "0.2", "0.05")},
}
# Rotated low-bit quantization (issue 13): does a randomized Hadamard rotation move int4/int3/int2 activations, and
# int4 stochastic gradients, towards int8's parity?
SETTINGS.update({"act-int4rot_grad-int8": "act=int4:rot,grad=int8", "act-int3_grad-int8": "act=int3,grad=int8",
                 "act-int3rot_grad-int8": "act=int3:rot,grad=int8",
                 "act-int4rot_grad-int4rotstoch": "act=int4:rot,grad=int4:rot:stoch", "act-int2rot": "act=int2:rot,grad=none"})
# The research seeds' own operators (issue 14): natural compression for gradients against stochastic int4 at about the
# same bits, and importance-weighted channel selection (mirror descent on the returning gradient's saliency) against
# TopK at the same ratio
SETTINGS.update({"act-int8_grad-nat4": "act=int8,grad=nat:bits=4", "act-int8_grad-int4stoch": "act=int8,grad=int4:stoch",
                 "act-int8_grad-nat": "act=int8,grad=nat",
                 **{f"act-mdtopk0.2{tag}": f"act=mdtopk:0.2{mode},grad=none" for tag, mode in
                    (("", ""), ("wg", ":mode=weighted_greedy"), ("gw", ":mode=greedy_weighted"), ("st", ":mode=stochastic"))},
                 "act-topk0.2row": "act=topk:0.2:per=row,grad=none"})  # weighted_greedy's control: TopK per row, unweighted
# Subspace pipelines (issue 16): the small GPT's d = 192 with k = d/4, d/8, d/16, uncompressed (the architecture's
# own cost) and with int8 on the coordinates
EXTRA: dict[str, list[str]] = {}
for _k in (48, 24, 12):
    for _tag, _spec in (("", "none"), ("-int8", "int8")):
        SETTINGS[f"subspace{_k}{_tag}"] = _spec
        EXTRA[f"subspace{_k}{_tag}"] = ["--subspace", str(_k)]
SETTINGS["base-seed1"] = "none"  # the noise floor: the baseline again with another seed (weights and data order)
SEEDS = {"base-seed1": 1, "ft-base-seed1": 1}  # finetuning: another data order (the weights are the checkpoint's)
# Runs whose checkpoints are also evaluated with no compression: error compensation's promise, and the act-only
# TopK runs (their own validation compresses activations, which the grad-only runs' does not)
FEEDBACK = ("topk0.1+ef", "topk0.1+ef21", "topk0.1+aqsgd", "topk0.1", *(f"act-topk{r}" for r in ("0.5", "0.3", "0.2", "0.1", "0.05")),
            *(f"act-mdtopk0.2{tag}" for tag in ("", "wg", "gw", "st")), "act-topk0.2row")
# Finetuning SmolLM2-135M-Instruct (make models) on Jane Austen: 2 stages, fp32 (this CPU has no bf16 matmul units:
# bf16 ran 57x slower than fp32, ~98 s/step), short
FINETUNE: dict[str, str] = {"ft-base": "none", "ft-base-seed1": "none", "ft-int8": "int8", **{f"ft-topk{r}": f"topk:{r}" for r in ("0.3", "0.2", "0.1")},
                            "ft-topk0.1+ef": "topk:0.1+ef"}
# Rotation where outlier channels exist: SmolLM2's hidden states (results/bench/op_table_smollm2.md)
FINETUNE.update({"ft-act-int4_grad-int8": "act=int4,grad=int8", "ft-act-int4rot_grad-int8": "act=int4:rot,grad=int8",
                 "ft-act-int3rot_grad-int8": "act=int3:rot,grad=int8"})
# The paper's findings in its own regime (finetuning a pretrained model; lab/pp_lab/eval/findings.py): TopK on one direction
# only (finding 1) and EF21 (finding 4); finding 5's AQ-SGD pair is multi-epoch (FT_EPOCHS)
FINETUNE.update({"ft-act-topk0.1": "act=topk:0.1,grad=none", "ft-grad-topk0.1": "act=none,grad=topk:0.1",
                 "ft-topk0.1+ef21": "topk:0.1+ef21"})
FT_FEEDBACK = ("ft-topk0.1", "ft-topk0.1+ef", "ft-topk0.1+ef21", "ft-act-topk0.1")
FT_COMMON = ["--stages", "2", "--data", "austen", "--steps", "40", "--seq-len", "128", "--micro-batch", "2", "--grad-accum", "2",
             "--eval-every", "20", "--eval-batches", "8", "--log-every", "5", "--lr", "1e-4", "--seed", "0"]
COMMON = ["--stages", "4", "--model", "small", "--steps", "120", "--eval-every", "40", "--eval-batches", "8",
          "--log-every", "10", "--seed", "0"]


# The long protocol (issue 17): the same model, data and pipeline, 1,000 optimizer steps (2.0M tokens, 1.3 epochs of
# Shakespeare), so the baseline's validation curve flattens and the findings are not artefacts of the unigram phase.
# 5% of every file is held out (2% in the short protocol), so eval/tasks.py gets ~3x more documents.
# Checkpoints every 100 steps: a run cut off (session end, crash) resumes from its last checkpoint. One representative
# per family, the most informative first; EXTRA and SEEDS apply as in the short protocol.
LONG: dict[str, str] = {
    "base": "none", "base-seed1": "none", "int8": "int8",
    "act-int4_grad-int3stoch": "act=int4,grad=int3:stoch",  # <= 4 bits per element averaged over both directions
    "subspace48-int8": "int8",
    "act-int8_grad-int3stoch": "act=int8,grad=int3:stoch",  # which direction costs: int3 gradients alone
    "act-int5_grad-int3stoch": "act=int5,grad=int3:stoch",  # one more activation bit (4.08 bits averaged)
    # int4 with a scale per 32 values: this residual stream has no outlier channels (rotation cannot help), so int4's
    # error is set by the per-row absmax; finer scales cut it for 0.42 more bits, 3.79 averaged
    # (results/bench/boundary_error_base.md)
    "act-int4b32_grad-int3stoch": "act=int4:per=block32,grad=int3:stoch",
    # normal-float levels (dense near zero): int5's bytes with less error than int5 on the activations; the gradients
    # at 2 bits, stochastic (unbiased) with less variance than int2:stoch. 3.58 bits averaged
    "act-nf5_grad-nf2stoch": "act=nf5,grad=nf2:stoch",
    # 6-bit normal-float activations with the 3-bit gradients that cost nothing: 4.58 bits averaged
    "act-nf6_grad-int3stoch": "act=nf6,grad=int3:stoch",
    # level counts between powers of two (base-L packing): 40 activation levels (5.33 bits) have less error than nf5,
    # 5 stochastic gradient levels (2.33 bits) less than nf2:stoch; 3.92 bits averaged with the scales
    "act-nf40_grad-nf5stoch": "act=nf:40,grad=nf:5:stoch",
    # nf4 has int4:per=block32's error at int4's bytes; 3-bit gradients with less variance than int3:stoch
    "act-nf4_grad-nf3stoch": "act=nf4,grad=nf3:stoch",
    "act-int4_grad-int4stoch": "act=int4,grad=int4:stoch",
    "act-int4_grad-int3stoch-warm100": "act=int4,grad=int3:stoch,warmup=100",  # the anchors' uncompressed warm-up
    "act-int3rot_grad-int4stoch": "act=int3:rot,grad=int4:stoch",
    "act-topk0.3row-int8+ef_grad-int8": "act=topk:0.3:per=row>int8+ef,grad=int8",
    "act-lowrank8+ef21_grad-int8": "act=lowrank:8+ef21,grad=int8",
    "subspace48": "none",  # the constrained architecture's own cost, nothing lossy on the wire
    # `safe` as it is now (chosen on SmolLM2): is rotated int8 at parity on this testbed too?
    "int8rot": "int8:rot",
    # the fewest bits within the loss rule on SmolLM2 on two seeds (vector quantization of rotated tiles, 3.83 bits
    # averaged): the `aggressive` candidate for LLaMA-family models; does this testbed agree?
    "act-vq4_grad-vq3": "act=vq:4,grad=vq:3",
}
# The paper's six findings re-judged (lab/pp_lab/eval/findings.py): TopK levels, one direction, feedback, AQ-SGD
FINDINGS_RUNS = ("topk0.1", "topk0.1+ef", "topk0.1+ef21", "act-topk0.1", "grad-topk0.1", "topk0.1+aqsgd", "topk0.2", "topk0.3")
LONG_COMMON = ["--stages", "4", "--model", "small", "--steps", "1000", "--val-fraction", "0.05", "--eval-every", "50",
               "--eval-batches", "32", "--log-every", "20", "--save-every", "100"]
# Multi-epoch finetuning, where AQ-SGD can compress: it sends a sample's first visit raw (or compressed, with
# `+aqsgd:first=`) and later visits as compressed deltas to what the receiver already holds, so with E epochs (E - 1) / E of the traffic is deltas. SmolLM2-135M on
# 32 sequences of Austen for 8 epochs (64 steps of 4 sequences): 7/8 of the visits are repeats, and 8 epochs of a small
# set is the usual few-shot finetuning regime. int4 without AQ-SGD is the control at the same delta bits. Validation
# runs uncompressed (eval=none): the question is what compressed training does to the model, and int4 at inference
# on SmolLM2's outlier channels would otherwise dominate the validation loss.
FT_EPOCHS: dict[str, str] = {"ft-ep-base": "none", "ft-ep-act-int4": "act=int4,grad=int8,eval=none",
                             "ft-ep-act-int4+aqsgd": "act=int4+aqsgd,grad=int8,eval=none",
                             # the fewest bits on repeats: 2-bit deltas, and the 3-bit stochastic gradients pretraining took
                             "ft-ep-act-int2+aqsgd_grad-int3stoch": "act=int2+aqsgd,grad=int3:stoch,eval=none",
                             # the first visit compressed too (issue 24): rotated int8 (near-lossless on SmolLM2's
                             # outlier channels), or the tile-adaptive 3.5 bits; later visits as 2-bit deltas
                             "ft-ep-act-int2+aqsgd-first-int8rot_grad-int3stoch":
                                 "act=int2+aqsgd:first=int8:rot,grad=int3:stoch,eval=none",
                             "ft-ep-act-int2+aqsgd-first-tile3.5_grad-int3stoch":
                                 "act=int2+aqsgd:first=tile:3.5,grad=int3:stoch,eval=none",
                             # finding 5 in the paper's regime: AQ-SGD + TopK against TopK, over 8 epochs
                             "ft-ep-topk0.1": "topk:0.1,eval=none", "ft-ep-topk0.1+aqsgd": "act=topk:0.1+aqsgd,grad=topk:0.1,eval=none"}
FT_EP_COMMON = ["--stages", "2", "--data", "austen", "--train-sequences", "32", "--steps", "64", "--seq-len", "128",
                "--micro-batch", "2", "--grad-accum", "2", "--eval-every", "8", "--eval-batches", "8", "--log-every", "4",
                "--lr", "5e-5", "--seed", "0", "--save-every", "16"]
LONG.update({n: SETTINGS[n] for n in FINDINGS_RUNS})
# The learned bottleneck trained from the start (issue 44, ResBM's regime), where SmolLM2's rows retrofit one into a
# pretrained model: the small GPT (d = 192) from random orthonormal encoders and decoders, k coordinates a token, d / k
# tokens a row on the wire. d/4 through int8 is the same bytes as `subspace48-int8` (a fixed seed-derived basis,
# +0.128). The first token crosses in full, as on SmolLM2 (its code in a row would set the row's scale), but through
# the codec (`min_numel=0`: alone it is smaller than the size below which tensors cross raw, and in fp32 it would cost
# 0.25 bits per element, ResBM's whole budget). The first two rows sent no token in full (`sink0`), one of them with a
# seeded random token table re-added by each decoder at the token's id, as Subspace Networks re-add their fixed
# embedding at every stage (`tokens`). Then d/2 through vq; k = d with no codec (nothing is lost at the cut, but the
# encoders and decoders train: what training them costs, since d/2 through vq ended near d/4 through int8). k = d
# was far behind the baseline, so then the bottleneck `frozen` at its random orthonormal init (a fixed low-rank
# identity path; ResBM preserves one beside its trained encoder-decoder) at d/4 through int8, d/2 through vq and d/16
# through vq (near ResBM's 128x). Then the trainable d/4 with no codec; d/2 through vq with the maps learning at a
# tenth of the body's rate (`lr01`: between frozen and trained); d/8 through int8. Then ResBM's whole design (`res`):
# the frozen identity path with a trained residual branch of width d beside each map, at d/2 through vq and d/4
# through int8, frozen's two best cells. Then the optimizer ResBM reports its best results with: DeepSpeed's Muon for
# the blocks' matrices (`muon`), its baseline first (`muon-base`, no bottleneck: the gap that counts is to it), then
# d/2 through vq frozen and trained; Muon's own seed-to-seed gap (`muon-base-seed1`, the tolerance its rows are judged
# by); frozen with Muon at d/16 through vq (ResBM's 128x) and d/4 through int8. Then d/16 through vq, trained; then
# d/2 frozen with Muon and no codec: what vq costs the frozen d/2 Muon row. Then, at about the same 2 bits, a wider
# code through a coarser codec: 2d/3 frozen with Muon through vq:2.5 both ways (2.08 bits against d/2's 2.03); it was
# worse, so then a narrower code through a finer one: d/3 through int6:rot (2.04 bits, two tokens a row; d/4 through
# int8 is 2.09), the closest 2-bit row, and the same with AdamW; then below 2 bits, d/4 through int6:rot with Muon.
LONG_BOTTLENECK = [(48, "int8", "tokens-sink0"), (48, "int8", "sink0"), (48, "int8", ""), (96, "vq4", ""),
                   (192, "none", ""), (48, "int8", "frozen"), (96, "vq4", "frozen"), (12, "vq4", "frozen"),
                   (48, "none", ""), (96, "vq4", "lr01"), (24, "int8", ""), (96, "vq4", "res"), (48, "int8", "res"),
                   (96, "vq4", "frozen-muon"), (96, "vq4", "muon"), (12, "vq4", "frozen-muon"),
                   (48, "int8", "frozen-muon"), (12, "vq4", ""), (96, "none", "frozen-muon"),
                   (128, "vq2.5", "frozen-muon"), (64, "int6rot", "frozen-muon"), (64, "int6rot", "frozen"),
                   (48, "int6rot", "frozen-muon")]
for _k, _codec, _variant in LONG_BOTTLENECK:
    _name, _parts = f"bn{_k}{'-' + _variant if _variant else ''}-{_codec}", _variant.split("-")
    LONG[_name] = {"none": "none", "int8": "int8", "vq4": "act=vq:4,grad=vq:3", "vq2.5": "vq:2.5",
                   "int6rot": "int6:rot"}[_codec] \
        + ("" if "sink0" in _parts else ",min_numel=0")
    _group = next(g for g in range(192 // _k, 0, -1) if 128 % g == 0)  # d / k tokens a row where seq 128 allows it
    EXTRA[_name] = ["--bottleneck", str(_k), "--bottleneck-group", str(_group),
                    *(["--bottleneck-sink", "0"] if "sink0" in _parts else []),
                    *(["--bottleneck-frozen"] if "frozen" in _parts else []),
                    *(["--bottleneck-lr-scale", "0.1"] if "lr01" in _parts else []),
                    *(["--bottleneck-residual", "192"] if "res" in _parts else []),
                    *(["--optimizer", "muon"] if "muon" in _parts else []),
                    *(["--bottleneck-tokens"] if "tokens" in _parts else [])]
for _name in ("muon-base", "muon-base-seed1"):
    LONG[_name], EXTRA[_name] = "none", ["--optimizer", "muon"]
SEEDS["muon-base-seed1"] = 1
# The drop-in codec alone at the bottleneck rows' bytes (vq:1.5 both ways, 2.0 bits per element on these rows) with
# each optimizer: whether a bottleneck is the better way to 2 bits from scratch at all.
for _name, _opt in (("muon-vq1.5", ["--optimizer", "muon"]), ("vq1.5", [])):
    LONG[_name], EXTRA[_name] = "vq:1.5", _opt
BOTTLENECK_LONG_ORDER = [f"bn{k}{'-' + v if v else ''}-{codec}" for k, codec, v in LONG_BOTTLENECK]
BOTTLENECK_LONG_ORDER.insert(BOTTLENECK_LONG_ORDER.index("bn96-frozen-muon-vq4"), "muon-base")
BOTTLENECK_LONG_ORDER.insert(BOTTLENECK_LONG_ORDER.index("bn12-frozen-muon-vq4"), "muon-base-seed1")
BOTTLENECK_LONG_ORDER += ["muon-vq1.5", "vq1.5"]
# The real-model testbed (issue 24): continued pretraining of SmolLM2-135M-Instruct (LLaMA architecture, 30 blocks,
# outlier channels and an attention sink from the middle layers on; `make models`) on Jane Austen's novels, 5% of every
# file held out. 4 pipeline stages as DeepSpeed balances them: cuts after blocks 8, 16 and 23, so one run compresses an
# early, a middle and a deep cut at once (each boundary's own statistics are logged). 200 steps of 2,048 tokens
# (410k tokens, ~40% of the corpus) with a cosine schedule to 10%: the baseline's validation curve flattens. About 12 s
# per step on 2 cores, ~45 min per run with its evaluations. Checkpoints every 50 steps (resumable); only the newest
# is kept (1.8 GB each).
SMOLLM2: dict[str, str] = {
    "sm-base": "none",
    # tile-adaptive rotated activations (3.85 bits) with tile-quantized stochastic gradients (3.33): 3.59 averaged
    "sm-tile3.5_grad-tile3stoch": "act=tile:3.5,grad=tile:3:stoch",
    "sm-base-seed1": "none",
    "sm-act-tile3.5": "act=tile:3.5,grad=none",  # activations alone at <= 4 bits (TAH-Quant's level)
    # the second seed of the <= 4-bit candidate: served uncompressed, its first seed is within the tolerance
    "sm-tile3.5_grad-tile3stoch-seed1": "act=tile:3.5,grad=tile:3:stoch",
    "sm-safe": "act=nf6,grad=int3:stoch",  # the `safe` preset when it ran (it is int8:rot since SmolLM2 measured this worse)
    # rotated int8 both ways: near-lossless on SmolLM2's outlier channels at inference (the conservative preset
    # candidate for LLaMA-family models, since `safe` fails the loss rule here); ahead of the rest for that reason
    "sm-int8rot": "int8:rot",
    # vector quantization of rotated tiles: at equal bits 26-54% less error than tile's uniform grid on SmolLM2's own
    # boundary tensors (results/bench/boundary_error_smollm2_vq.md); nearest-rounded both ways, 3.83 averaged
    "sm-act-vq4_grad-vq3": "act=vq:4,grad=vq:3",
    # its second seed: its first ran within the tolerance of the baseline all along (+0.016 at steps 25-75)
    "sm-act-vq4_grad-vq3-seed1": "act=vq:4,grad=vq:3",
    # activations alone at <= 4 bits with vq (3.81 bits; tile:3.5 at 3.85 was +0.043 through its own codec)
    "sm-act-vq3.5": "act=vq:3.5,grad=none",
    # the `aggressive` preset when it ran (it is act=vq:4,grad=vq:3 since SmolLM2 measured this far worse)
    "sm-aggressive": "act=nf5,grad=nf2:stoch",
    "sm-int8": "int8",
    "sm-topk0.1": "topk:0.1",
    # the 3-bit moonshot with vq (2.83 bits averaged), validated and served through rotated int8: vq's trained runs
    # end at what their codec alone costs the baseline at inference, and vq:2.5's cost there is far past the
    # tolerance (results/bench/boundary_loss_smollm2.md), so through its own codec no such run could pass. What
    # training at 2.83 bits does to the model is the question, and int8:rot costs the baseline next to nothing.
    "sm-vq2.5-serve-int8rot": "act=vq:2.5,grad=vq:2.5,eval=int8:rot",
    "sm-topk0.2": "topk:0.2", "sm-topk0.3": "topk:0.3",  # the paper's levels, for the frontier
    # the same 2.83 bits split the other way: which direction's error does training at <= 3 bits tolerate?
    "sm-act-vq2_grad-vq3-serve-int8rot": "act=vq:2,grad=vq:3,eval=int8:rot",
    # unbiased (stochastically rounded) 2.85-bit gradients against vq's nearest-rounded 2.83, with 3.33-bit
    # activations (3.09 averaged), served through int8:rot like the vq moonshot, for the same reason
    "sm-act-tile3_grad-tile2.5stoch-serve-int8rot": "act=tile:3,grad=tile:2.5:lo=2:hi=3:stoch,eval=int8:rot",
}
# A learned bottleneck at each boundary (issue 44; lab/pp_lab/bottleneck.py): the hidden state crosses as k of
# d = 576 coordinates per token (PCA-initialised on training sequences, then trained) plus the attention-sink token
# in full, and the code goes through a codec, so the ratios multiply: bits per dense element are about the codec's
# bits x (128 k + 576) / (128 x 576). The codes of d / k tokens share a row, so the codecs' per-row costs (scales,
# vq's pivot) spread over 576 values as on the dense tensor. The most informative first: d/4 through int8:rot and d/2
# through `aggressive`'s vq (both near the issue's 2-bit goal; d/2 because d/4 already costs the model tenths of a nat
# before training when all three cuts project at once), the bottleneck's own cost (no codec), d/8 through int8:rot
# and d/4 through vq (near 1 bit), the fixed-subspace control (the same initial basis, never trained), then the
# rest of the grid, down to d/16 through vq (near ResBM's 128x). Each run is evaluated before its first step too (the initialisation's loss).
# After the first three rows (d/2 through vq +0.097, most of it the bottleneck's own cost), d/2 through vq again with the
# bottleneck learning at 10x the body's rate (`lr10`: new layers in a pretrained model, as MAPL and ResBM train theirs
# at a from-scratch rate), before the narrower settings.
# After d/8 through vq, d/2 through vq with the PCA taken from 384 training sequences instead of 24 (`calib384`): with
# d = 576 and 24 x 127 tokens the covariance is poorly estimated, and the projection's cost before training falls
# with more calibration. The loss-weighted init (`fisher`) was stopped at step 25 of d/2 through vq, far behind pca's
# run (docs/bottleneck.md), and is not queued. Then the token table (`tokens`: each token's hidden state predicted
# from its id, the code carrying the rest; with 384 sequences, since 24 overfit its d x d map), at d/2 through vq and
# d/4 through int8:rot, where it starts the model closest to itself
# (results/bench/bottleneck_init_calib_tokens_smollm2.md).
# Then the best d/2 setting for 600 steps (`tokens-long`: the baseline's 200 steps three times over, its own cosine
# schedule): no setting at or below 2 bits reached the baseline's final loss in 200 steps, and the time to that loss
# (steps to target x step time per link) is what decides on a slow link. Its loss rule is not comparable (not equal
# steps). It takes longer than a session: it goes on from its checkpoint where runs/
# survives the session (it restarts from the beginning where it does not). It runs before the rest of the grid: a
# bottleneck that costs the model more than 0.05 where the grid's other rows start (d/4 and below) cannot reach
# the 2-bit goal's parity in 200 steps, so the question that is left is whether d/2 gets there with more steps.
# Then d/2 with a token table through vq from the blended subspace (`blend`: the hidden state's covariance plus the
# loss gradient's second moment), after d/4 with a table: the layers before a cut learn only from the gradient its
# bottleneck passes back, and the principal subspace passes about k/d of it; the blended one with weight 0.25 passes
# more for the least cost in the projection of the weights measured (results/bench/bottleneck_init_blend_smollm2.md).
# Then d/2 with a token table and no codec on its codes, before the grid's last cells: at d/2 the gap to the baseline
# opens in the first 25 steps (results/bench/bottleneck_gap_smollm2.md), and every d/2 row so far sent its codes
# through vq; at d/4 the codec cost nothing measurable, so this row says whether the bottleneck or vq opens it.
# Then the same d/2 setting through vq with its encoders and decoders frozen at the PCA initialisation
# (`tokens-frozen`), before the grid's last cells: the bottleneck itself opens d/2's gap in its first 25 steps, and
# learning at 10x the body's rate (`lr10`) opened it further, so this row says whether training the bottleneck at all
# opens it (the fixed subspace at the same bytes, where the grid's closest setting is).
BOTTLENECK_ORDER = [(144, "int8rot", ""), (288, "vq4", ""), (144, "none", ""), (288, "vq4", "lr10"), (72, "int8rot", ""),
                    (144, "vq4", ""), (144, "int8rot", "frozen"), (36, "int8rot", ""), (72, "vq4", ""),
                    (288, "vq4", "calib384"), (288, "vq4", "tokens"), (288, "vq4", "tokens-long"),
                    (144, "int8rot", "tokens"), (288, "vq4", "tokens-blend"), (72, "none", ""),
                    (288, "none", "tokens"), (288, "vq4", "tokens-frozen"), (36, "none", ""), (36, "vq4", "")]
BN_CODECS = {"none": "none", "int8rot": "int8:rot", "vq4": "act=vq:4,grad=vq:3"}
for _k, _codec, _variant in BOTTLENECK_ORDER:
    _name, _parts = f"sm-bn{_k}{'-' + _variant if _variant else ''}-{_codec}", _variant.split("-")
    SMOLLM2[_name] = BN_CODECS[_codec]
    EXTRA[_name] = ["--bottleneck", str(_k), "--bottleneck-group", str(576 // _k),
                    *(["--bottleneck-frozen"] if "frozen" in _parts else []),
                    *(["--bottleneck-lr-scale", "10"] if "lr10" in _parts else []),
                    # the rows before calib384 ran with the default of their time, 24 sequences
                    "--bottleneck-calib", "384" if {"calib384", "tokens"} & set(_parts) else "24",
                    *(["--bottleneck-tokens"] if "tokens" in _parts else []),
                    *(["--bottleneck-init", "blend", "--bottleneck-grad-weight", "0.25"] if "blend" in _parts else []),
                    *(["--steps", "600"] if "long" in _parts else [])]  # after SM_COMMON's: the last one counts
AT_START = {n for n in SMOLLM2 if n.startswith("sm-bn")}
"""Settings evaluated before their first step as well (--eval-at-start)."""
SM_COMMON = ["--stages", "4", "--data", "austen", "--steps", "200", "--seq-len", "128", "--micro-batch", "4",
             "--grad-accum", "4", "--val-fraction", "0.05", "--eval-every", "25", "--eval-batches", "16", "--log-every", "5",
             "--lr", "1e-4", "--save-every", "50", "--keep-checkpoints", "1"]
SEEDS["sm-base-seed1"] = SEEDS["sm-tile3.5_grad-tile3stoch-seed1"] = SEEDS["sm-act-vq4_grad-vq3-seed1"] = 1
# The long study's run order: what a session can finish first is what the goals need most (a <= 4-bit
# candidate, AQ-SGD's multi-epoch deltas, one run per family, the findings' core), then the rest.
LONG_ORDER = ["base", "base-seed1", "int8", "act-int4_grad-int3stoch", "subspace48-int8", "act-int8_grad-int3stoch",
              "act-int5_grad-int3stoch", "act-int4b32_grad-int3stoch", "act-nf5_grad-nf2stoch", "act-nf6_grad-int3stoch",
              "ft-ep-base", "ft-ep-act-int4+aqsgd", "ft-ep-act-int4", "ft-ep-act-int2+aqsgd_grad-int3stoch",
              "ft-ep-act-int2+aqsgd-first-int8rot_grad-int3stoch", "ft-ep-act-int2+aqsgd-first-tile3.5_grad-int3stoch",
              "ft-ep-topk0.1", "ft-ep-topk0.1+aqsgd",
              "act-int4_grad-int3stoch-warm100",
              "act-topk0.3row-int8+ef_grad-int8", "act-lowrank8+ef21_grad-int8", "act-nf40_grad-nf5stoch", "topk0.1", "topk0.1+ef",
              "topk0.1+ef21", "act-topk0.1", "grad-topk0.1", "topk0.2", "topk0.3", "topk0.1+aqsgd", "act-nf4_grad-nf3stoch",
              "act-int4_grad-int4stoch", "act-int3rot_grad-int4stoch", "subspace48", "int8rot", "act-vq4_grad-vq3",
              *BOTTLENECK_LONG_ORDER]
assert sorted(LONG_ORDER) == sorted([*LONG, *FT_EPOCHS]), "every long setting runs exactly once"
# Is `auto` (issue 46) at parity? Its runs train over emulated links (benchmarks/throttle.py: a sender sleeps for a
# message's time on its link) so that it has choices to make: boundary 0 unlimited, boundary 2 at 25 Mbit/s, and
# boundary 1 slow, then unlimited, then slow again, so that it switches codecs mid-run. A schedule's clock starts at
# the first message of each (re)start. Their own tables, not LONG's or SMOLLM2's: what they send depends on the link,
# so they are no frontier rows. name -> (spec, PPC_BENCH_LINKS).
AUTO_LONG: dict[str, tuple[str, str]] = {
    "auto-mixed": ("auto:max=aggressive:model=small-gpt", "0=none,1=5mbit@20ms~1200s=none~2400s=5mbit@20ms,2=25mbit@10ms")}
AUTO_SMOLLM2: dict[str, tuple[str, str]] = {  # ~4x the small GPT's step time: the schedule's phases too
    "sm-auto-mixed": ("auto:max=aggressive:model=SmolLM2-135M",
                      "0=none,1=5mbit@20ms~1500s=none~3000s=5mbit@20ms,2=25mbit@10ms")}
AUTO_MEGATRON: dict[str, tuple[str, str]] = {  # one link (2 stages): slow, unlimited, slow again
    "mc-auto-mixed": ("auto:max=aggressive:model=small-gpt", "0=5mbit@20ms~120s=none~240s=5mbit@20ms")}
AUTO_RUNS = {**AUTO_LONG, **AUTO_SMOLLM2, **AUTO_MEGATRON}
# Megatron-Core (issue 70): the small GPT's sizes as Megatron-Core's own GPTModel under its own 1F1B schedule
# (recipes/pretrain.py --engine megatron), 2 pipeline stages (one process per core here), the recipe's 300 steps
MEGATRON: dict[str, str] = {"mc-base": "none", "mc-base-seed1": "none", "mc-safe": "safe", "mc-aggressive": "aggressive"}
MC_COMMON = ["--engine", "megatron", "--untied", "--stages", "2", "--model", "small", "--steps", "300", "--eval-every",
             "50", "--eval-batches", "8", "--save-every", "50", "--keep-checkpoints", "1"]
SEEDS["mc-base-seed1"] = 1
_SM_ORDER = list(SMOLLM2)
_SM_ORDER.insert(_SM_ORDER.index("sm-bn288-lr10-vq4") + 1, "sm-auto-mixed")  # after the bottleneck row running when it came
# protocol -> (names in run order, where the runs go)
PROTOCOLS = {"short": (list(SETTINGS), ROOT / "runs" / "study"),
             "long": ([*LONG_ORDER, *AUTO_LONG], ROOT / "runs" / "study_long"),
             # the long protocol's from-scratch bottleneck rows alone, where the long study's runs go
             "long-bottleneck": (BOTTLENECK_LONG_ORDER, ROOT / "runs" / "study_long"),
             "smollm2": (_SM_ORDER, ROOT / "runs" / "study_smollm2"),
             "megatron": ([*MEGATRON, *AUTO_MEGATRON], ROOT / "runs" / "study_megatron")}


def job(name: str, protocol: str) -> tuple[str, int, list[str], str]:
    """(recipe, processes, its arguments, the spec) of one setting of a protocol."""
    if protocol == "long" and name in AUTO_LONG:
        return "pretrain.py", 4, [*LONG_COMMON, "--seed", "0"], AUTO_LONG[name][0]
    if protocol == "smollm2" and name in AUTO_SMOLLM2:
        return "finetune.py", 4, [*SM_COMMON, "--seed", "0"], AUTO_SMOLLM2[name][0]
    if protocol == "megatron":
        specs = {**MEGATRON, **{n: spec for n, (spec, _) in AUTO_MEGATRON.items()}}
        if name not in specs:
            raise SystemExit(f"unknown setting {name!r} in the megatron protocol; accepted: {', '.join(specs)}")
        return "pretrain.py", 2, [*MC_COMMON, "--seed", str(SEEDS.get(name, 0))], specs[name]
    if name in FINETUNE:
        return "finetune.py", 2, [*FT_COMMON, "--seed", str(SEEDS.get(name, 0))], FINETUNE[name]
    if protocol == "long" and name in FT_EPOCHS:
        return "finetune.py", 2, FT_EP_COMMON, FT_EPOCHS[name]
    if protocol == "smollm2":
        if name not in SMOLLM2:
            raise SystemExit(f"unknown setting {name!r} in the smollm2 protocol; accepted: {', '.join(SMOLLM2)}")
        start = ["--eval-at-start"] if name in AT_START else []
        return "finetune.py", 4, [*SM_COMMON, "--seed", str(SEEDS.get(name, 0)), *EXTRA.get(name, []), *start], SMOLLM2[name]
    settings, common = (LONG, LONG_COMMON) if protocol.startswith("long") else (SETTINGS, COMMON)
    if name not in settings:
        raise SystemExit(f"unknown setting {name!r} in the {protocol} protocol; accepted: {', '.join([*PROTOCOLS[protocol][0], *FINETUNE])}")
    return "pretrain.py", 4, [*common, "--seed", str(SEEDS.get(name, 0)), *EXTRA.get(name, [])], settings[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated setting names")
    ap.add_argument("--protocol", choices=list(PROTOCOLS), default="short",
                    help="short: 120 steps (the first study, kept as history); long: 1,000 steps (the headline); "
                         "long-bottleneck: its bottleneck rows alone; smollm2: continued pretraining of SmolLM2-135M; "
                         "megatron: the small GPT as Megatron-Core's GPTModel (pip install -e '.[megatron]')")
    ap.add_argument("--runs", type=Path, default=None, help="where the runs go (default runs/study, runs/study_long)")
    ap.add_argument("--finetune", action="store_true", help=f"the short finetuning settings {list(FINETUNE)} instead")
    ap.add_argument("--retrain", action="store_true",
                    help="smollm2: train settings whose logs are committed again, for their checkpoints (lm-eval on a "
                         "fresh machine); the committed logs stay as they are")
    args = ap.parse_args()
    order, runs = PROTOCOLS[args.protocol]
    args.runs = args.runs or runs
    names = args.only.split(",") if args.only else list(FINETUNE) if args.finetune else order
    for name in names:
        out = args.runs / name
        recipe, nproc, recipe_args, spec = job(name, args.protocol)
        if args.protocol == "smollm2" and landed(name) and not args.retrain:
            continue  # a fresh checkout has no runs/, but what landed is committed: never train it again
        if not (out / "summary.json").exists():
            t0 = time.perf_counter()
            again = "--resume" if (out / "ckpt" / "latest").exists() else "--overwrite"  # a run cut off goes on
            # a run takes up to two hours here (three before it is cut off, to go on next time from its checkpoint)
            # and its output is captured: say where to follow it
            print(f"{name:24s} {spec:34s} {again}: running, its log grows in {out / 'metrics.jsonl'}", flush=True)
            script, first, env = ROOT / "recipes" / recipe, [], None
            if name in AUTO_RUNS:  # through the emulated links (Megatron-Core posts its P2P ops in batches)
                script, first, env = THROTTLE, [str(script)], {"PPC_BENCH_LINKS": AUTO_RUNS[name][1],
                                                               "PPC_BENCH_P2P": "batch" if name in AUTO_MEGATRON
                                                               else "deepspeed"}
            out.mkdir(parents=True, exist_ok=True)
            with open(out / TRAIN_LOG, "a") as f:
                f.write(f"{ATTEMPT} {again} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            try:  # the log goes to the run's directory as it is written: a run cut off with this process keeps it
                rc, log = run_job(script, nproc, *first, *recipe_args, "--pp-compress", spec, "--out", str(out), again,
                                  timeout=10800, env=env, log_file=out / TRAIN_LOG)
            except TimeoutError as e:  # run_job: the job hung or overran (and was killed); go on with the next setting
                rc, log = 124, str(e)
            if name in AUTO_RUNS:
                write_decisions(out, AUTO_RUNS[name][1])
            print(f"{name:24s} {spec:34s} {again} rc={rc} {time.perf_counter() - t0:.0f} s", flush=True)
            if rc != 0:
                print(log[-3000:], flush=True)
                continue
        if args.protocol == "megatron":  # its logs are committed as each lands
            keep_logs(out, RESULTS / "megatron" / name)
        if args.protocol == "smollm2":  # served uncompressed too (training's cost alone); logs go where they are committed
            infer_plain(name, out, 4, "--data", "austen", "--micro-batch", "4", "--ppl-batches", "16")
            if landed(name):  # retrained: the same command is not bitwise repeatable across machines, so say how close
                print(f"{name:24s} retrained: {retrained(out, RESULTS / 'smollm2' / name)}", flush=True)
            else:
                keep_logs(out, RESULTS / "smollm2" / name)
        if name in FT_FEEDBACK:  # the validation batches of FT_COMMON's evaluations
            infer_plain(name, out, 2, "--data", "austen", "--micro-batch", "2", "--ppl-batches", "16")
        elif name in FEEDBACK:
            infer_plain(name, out, 4, "--data", "shakespeare", "--ppl-batches", "32")


DECISIONS = "decisions.log"
"""An `auto` run's decisions (its log lines), in its run directory."""
TRAIN_LOG = "train.log"
"""A run's output (every attempt's, appended), in its run directory; not kept in results/eval."""
ATTEMPT = "=== eval/study.py: attempt"
"""The line that starts each attempt's part of TRAIN_LOG."""


def write_decisions(out: Path, links: str) -> None:
    """An auto run's decisions from its log, every attempt's (a resumed run decides again) -> out/DECISIONS."""
    attempts = (out / TRAIN_LOG).read_text(errors="replace").split(ATTEMPT) if (out / TRAIN_LOG).exists() else []
    lines = [f"# links {links}"]
    for i, text in enumerate(a for a in attempts if a.strip()):
        lines += [f"# attempt {i + 1}", *AUTO_LINE.findall(text)]
    (out / DECISIONS).write_text("\n".join(lines) + "\n")
LOGS = ("metrics.jsonl", "run.json", "summary.json", DECISIONS)
"""What of a run directory is kept in results/eval (checkpoints are not)."""
SM_LOGS = (*LOGS, "infer_none.json")
"""A SmolLM2 run's, with its uncompressed evaluation."""


def landed(name: str) -> bool:
    """A SmolLM2 setting whose logs (its training and its uncompressed evaluation) are in results/eval."""
    return all((RESULTS / "smollm2" / name / f).exists() for f in ("summary.json", "infer_none.json"))


def retrained(run: Path, results: Path) -> str:
    """The retrained run's final validation loss next to the committed one's."""
    again, committed = (json.loads((d / "summary.json").read_text())["final_val_loss"] for d in (run, results))
    return f"final validation loss {again:.4f}, committed {committed:.4f} ({again - committed:+.4f})"


def keep_logs(run: Path, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    for f in SM_LOGS:
        if (run / f).exists():
            shutil.copy(run / f, results / f)


def infer_plain(name: str, out: Path, stages: int, *args: str) -> None:
    """Evaluate the run's final checkpoint over `stages` processes with no compression at all -> <out>/infer_none.json
    (once)."""
    if not (out / "infer_none.json").exists():
        rc, log = run_job(ROOT / "recipes/infer.py", stages, "--checkpoint", str(out), "--stages", str(stages), *args,
                          "--pp-compress", "none", "--out", str(out / "infer_none.json"), timeout=1800)
        print(f"{name:24s} inference without compression rc={rc}", flush=True)
        if rc != 0:
            print(log[-3000:], flush=True)


if __name__ == "__main__":
    main()
