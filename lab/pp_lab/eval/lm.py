"""An lm-evaluation-harness model: our recipes' checkpoints (or a LLaMA-family folder) with a chosen
compression at the pipeline's stage boundaries, at inference.

    python eval/lm.py run --model pp_compress --model_args checkpoint=runs/study/base,compress=topk:0.1,stages=4 \
        --tasks ppc_shakespeare_ppl --include_path .cache/eval_tasks

`python eval/lm.py` is lm-eval's own CLI (`lm_eval`, same arguments) with this model registered: the
installed `lm_eval` script has no plugin hook that would import it. In Python, `import eval.lm` and then
`lm_eval.simple_evaluate(model="pp_compress", ...)` works the same.

The model runs in one process: the same layers as the pipeline (lab/pp_lab/model.py), cut into `stages`
exactly as DeepSpeed's `partition_method="type:Block"` cuts them, with a pp_compress
CompressionBoundary at every cut. In eval mode a boundary compresses and decompresses the hidden
states through the same operators the pipeline sends (the spec's `eval`, else its `act`), so what
the next stage sees is what it would receive over the wire. `compress=none` is the uncompressed model.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import Tensor, nn
from tqdm import tqdm

import pp_compress as ppc
from pp_lab.kvcache import load_model  # noqa: F401 - pp_lab.bench uses it from here
from pp_lab.model import GPT, GPTConfig, stage_cuts  # noqa: F401 - stage_cuts: pp_lab.eval and pp_lab.bench use it from here


class Staged(nn.Module):
    """The layers with a CompressionBoundary after each stage cut (eval mode: inference compression)."""

    def __init__(self, model: GPT, stages: int, compress: str) -> None:
        super().__init__()
        cfg = ppc.parse_spec(compress)
        cuts = stage_cuts(model.cfg, stages)  # boundary b follows layer cuts[b]
        seq: list[nn.Module] = []
        for i, layer in enumerate(model.layers):
            seq.append(layer)
            if i in cuts:
                seq.append(ppc.CompressionBoundary(cfg, boundary=cuts.index(i)))
        self.seq = nn.ModuleList(seq)
        self.group = model.cfg.bottleneck_group if model.cfg.bottleneck is not None else 1
        """Tokens per wire row of a bottleneck model: the sequence length must be a multiple of it."""

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        # a bottleneck sends `group` tokens' codes a row; tokens appended at the end leave the real positions' outputs
        # unchanged (causal attention), except through a codec whose scales the last row's pad shares
        x: Any = F.pad(ids, (0, -t % self.group))  # (B, T padded)
        for m in self.seq:
            if isinstance(m, ppc.CompressionBoundary) and isinstance(x, tuple):  # (c, token ids) of a subspace model
                x = (m(x[0]), *x[1:])  # the float tensor is compressed, the integer ones travel as they are
            else:
                x = m(x)
        return x[:, :t]  # (B, T, V)


@register_model("pp_compress")
class PPCompressLM(LM):
    """lm-eval model over lab/pp_lab/model.py with compression at the stage boundaries."""

    LM_EVAL_ARGS = ("max_batch_size", "device")
    """What lm-eval itself adds to model_args (from --batch_size / --max_batch_size / --device): accepted, unused."""

    def __init__(self, checkpoint: str, compress: str = "none", stages: int = 4, batch_size: int | str = 8,
                 max_length: int | None = None, dtype: str = "float32", **extra: Any) -> None:
        unknown = sorted(set(extra) - set(self.LM_EVAL_ARGS))
        if unknown:  # a misspelled compress= would otherwise evaluate uncompressed and pass a parity gate falsely
            accepted = [p for p in inspect.signature(type(self).__init__).parameters if p not in ("self", "extra")]
            raise ValueError(f"unknown pp_compress model_args {unknown}; accepted: {', '.join(accepted)}")
        super().__init__()
        model, self.tok, trained_len = load_model(checkpoint)
        self.net = Staged(model, int(stages), str(compress)).to(getattr(torch, dtype)).eval()
        self.batch = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length or trained_len)
        self.eos = self.tok.eos_token_id
        self.compress = str(compress)

    # --- helpers ---------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy one) for token-id pairs.

        A continuation longer than half the window is scored in pieces of half a window, each conditioned on as much
        of the context and the earlier pieces as fits: the sum of the pieces is its log-likelihood (chain rule)."""
        step = max(1, self.max_length // 2)
        pieces, owner = [], []
        for i, (ctx, cont) in enumerate(pairs):
            for j in range(0, len(cont), step) if len(cont) > step else [0]:
                pieces.append((ctx + cont[:j], cont[j:j + step] if len(cont) > step else cont))
                owner.append(i)
        scored = self._score_fitting(pieces)
        out = [(0.0, True) for _ in pairs]
        for i, (ll, greedy) in zip(owner, scored):
            out[i] = (out[i][0] + ll, out[i][1] and greedy)
        return out

    @torch.no_grad()
    def _score_fitting(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """_score for continuations that fit the window (the context is cut from the left)."""
        out: list[tuple[float, bool]] = []
        for i in range(0, len(pairs), self.batch):
            chunk = pairs[i:i + self.batch]
            seqs = [(ctx + cont)[-(self.max_length + 1):][:-1] for ctx, cont in chunk]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.eos, dtype=torch.long)  # (B, T) right-padded
            for r, s in enumerate(seqs):
                ids[r, :len(s)] = torch.tensor(s)
            logp = F.log_softmax(self.net(ids).float(), dim=-1)  # (B, T, V)
            for r, ((ctx, cont), s) in enumerate(zip(chunk, seqs)):
                n = len(cont)
                rows = logp[r, len(s) - n:len(s)]  # (n, V): positions that predict the continuation
                target = torch.tensor(cont)
                out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
        return out

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's convention: trailing spaces of the context belong to the continuation."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return (ctx or [self.eos]), whole[len(ctx):]

    # --- the LM interface --------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pair(*r.args) for r in tqdm(requests, disable=disable_tqdm, desc="tokenizing")]
        return self._score(pairs)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for r in tqdm(requests, disable=disable_tqdm, desc="rolling loglikelihood"):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self._encode(r.args[0]), prefix_token=self.eos, max_seq_len=self.max_length, context_len=1)]
            out.append(sum(ll for ll, _ in self._score(windows)))
        return out

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in tqdm(requests, disable=disable_tqdm, desc="generating"):
            context, kwargs = r.args
            until = kwargs.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            ids = (self._encode(context) or [self.eos])[-self.max_length:]
            new: list[int] = []
            for _ in range(int(kwargs.get("max_gen_toks", 64))):
                logits = self.net(torch.tensor([(ids + new)[-self.max_length:]]))  # (1, T, V)
                nxt = int(logits[0, -1].argmax())
                if nxt == self.eos:
                    break
                new.append(nxt)
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
            text = self.tok.decode(new)
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


def main() -> None:
    # lm-eval's own CLI with this model registered (the installed `lm_eval` script cannot import it):
    # python eval/lm.py run --model pp_compress --model_args ... --tasks ... --include_path .cache/eval_tasks
    from lm_eval.__main__ import cli_evaluate

    sys.exit(cli_evaluate())


if __name__ == "__main__":
    main()
