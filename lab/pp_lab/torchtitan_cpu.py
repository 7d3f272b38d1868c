"""torchtitan's own entry point (`torchtitan.train.main`) on CPU with gloo, stock (`--module llama3`) or with
pp_compress (`--module pp_compress.torchtitan`), for tests/integration/test_torchtitan.py and the torchtitan study
(pp_lab/eval/torchtitan.py): `python recipes/torchtitan_cpu.py --module ... --config ...` on each rank.
torchtitan 0.3.0 expects an accelerator; the patches that let it run on CPU live here, in the lab and tests only (the
library patches nothing of this), and change nothing of what is compared:
- the device: torchtitan falls back to "cuda" when it finds no accelerator; here it is "cpu", and the few calls it
  makes on its device module besides (name, memory statistics) are answered for the CPU;
- attention: FlexAttention has no backward on CPU; the same masked attention runs densely (SDPA with the block mask's
  mask), and the block mask is built without torch.compile (which would cost each job seconds);
- the metrics: each logged step's loss and gradient norm are appended exactly (the console rounds them) to
  `$TT_METRICS.rank<r>.jsonl`;
- the exit: gloo can abort a finished process as it exits ("terminate called without an active exception"), so the
  worker ends with os._exit once torchtitan's main has returned.

`make_assets(folder, files)` writes what torchtitan's debug configs read from `./tests/assets`, which its wheel does not
ship: a byte-level BPE tokenizer (2,000 tokens, the debug model has 2,048) and a c4_test-shaped corpus (JSON lines with
a "text" field), both from the given text files.
"""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path


def make_assets(folder: Path, files: list[Path], held_out: list[Path] = ()) -> tuple[Path, Path, Path | None]:
    """(tokenizer folder, dataset folder, held-out dataset folder or None) under `folder`: a document per paragraph of
    `files` (the tokenizer is trained on those) and of `held_out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    paragraphs = _write_corpus(folder / "c4_test", files)
    val = folder / "held_out" if held_out else None
    if val is not None:
        _write_corpus(val, held_out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok.train_from_iterator(paragraphs, trainers.BpeTrainer(vocab_size=2000, special_tokens=[bos, eos],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    tok.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    return tokenizer, folder / "c4_test", val


def _write_corpus(folder: Path, files: list[Path]) -> list[str]:
    paragraphs = [p.strip() for f in sorted(files) for p in f.read_text().split("\n\n") if p.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    # a file name without "test" in it: the datasets library would call its split "test", torchtitan reads "train"
    (folder / "corpus.json").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return paragraphs


def _patch_for_cpu() -> None:
    import torch
    import torch._utils
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_block_mask, create_mask

    torch._utils._get_available_device_type = lambda: "cpu"
    torch.cpu.current_device = lambda: 0  # torchtitan passes it to barrier(device_ids=...)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, fn in {"get_device_name": lambda *a: "cpu", "memory_stats": lambda *a: {}, "empty_cache": lambda: None,
                     "get_device_properties": lambda *a: types.SimpleNamespace(total_memory=memory),
                     "reset_peak_memory_stats": lambda *a: None}.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)

    from torchtitan.models.common import attention

    def dense_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        assert score_mod is None and not return_aux.lse, "the dense stand-in covers the language models' attention"
        mask = create_mask(block_mask.mask_mod, block_mask.shape[0], 1, q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), AuxOutput()

    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex)
    attention._compiled_create_block_mask = create_block_mask

    from torchtitan.components.metrics import MetricsProcessor

    stock_log = MetricsProcessor.log
    out = os.environ.get("TT_METRICS")

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if out and global_avg_loss != -1.0:  # -1: a rank that holds no loss (not the last stage)
            with open(f"{out}.rank{os.environ['RANK']}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": repr(global_avg_loss), "grad_norm": repr(grad_norm)}) + "\n")
        return stock_log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    MetricsProcessor.log = log


def main() -> None:
    """torchtitan.train.main with the patches, on this rank."""
    _patch_for_cpu()
    from torchtitan.train import main as train

    train()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
