"""KV-cached pipelined generation over torch.distributed p2p, with compressed hidden states between stages.

Every stage process holds its layers and their KV cache (a `Stage`: the model's side). Prefill sends the prompts'
hidden states across each boundary once; each decode step sends one position's hidden state per sequence. What
crosses goes through `StageCompression` (the same boundary policy, spec grammar and statistics as training, under
the inference spec: `eval=`, else `act=`). The last stage picks the next tokens and broadcasts them, with a "done"
flag, to every stage of the pipeline.

    gen = PipelineGenerator(stage, stage_index, num_stages, hidden=(d_model, torch.float32), compression="eval=int8")
    tokens = gen.generate(prompts, max_new_tokens=128, stop_token=eos)   # prompts: list of token-id lists (stage 0)
    gen.timings        # seconds in compute, on the wire, and in (de)compression, on this rank

Prompts of different lengths are left-padded; each sequence has its own positions, and padding is masked out of
attention. Greedy unless `temperature > 0` (then seeded by `seed`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .config import CompressionConfig
from .ops.base import TensorSpec
from .pipe import StageCompression
from .policy import Where
from .runtime import check_same_config, resolve_config


class Stage(Protocol):
    """A model's part of one pipeline stage, with its KV cache."""

    def reset(self, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> None:
        """Empty caches for `batch` sequences of up to `length` positions."""

    def __call__(self, x: Tensor, positions: Tensor, key_valid: Tensor, last_only: bool = False) -> Tensor:
        """x: token ids (B, T) on the first stage, else hidden (B, T, D); positions (B, T) per sequence; key_valid
        (B, cached + T) real (not padding) positions. Returns hidden (B, T, D), or logits (B, T, V) on the last stage:
        (B, 1, V), the last position's, with `last_only` (generation needs no more, and a prompt's logits over the
        whole vocabulary cost as much as several blocks)."""


class PipelineGenerator:
    """Generation through one pipeline: stage `index` of `stages`, one process each (ranks `ranks`, default
    0..stages-1 of the default group)."""

    def __init__(self, stage: Stage, index: int, stages: int, hidden: tuple[int, torch.dtype],
                 compression: CompressionConfig | str | dict | None = None, device: torch.device | None = None,
                 context: int | None = None, ranks: list[int] | None = None) -> None:
        _, cfg = resolve_config(None, compression)
        check_same_config(cfg)
        self.stage, self.index, self.stages = stage, index, stages
        self.width, self.dtype = hidden
        self.device = device or torch.device("cpu")
        self.context = context
        self.ranks = ranks or list(range(stages))
        self.pp = StageCompression(cfg, index, stages)
        self.timings = {"compute": 0.0, "wire": 0.0, "codec": 0.0}
        """Seconds on this rank: running the stage, sending/receiving, compressing/decompressing."""
        self.traffic = {"prefill": [0, 0, 0], "decode": [0, 0, 0]}
        """What this rank sent: [raw bytes, wire bytes, elements] of hidden states, prefill and decode apart."""

    # --- one hop -----------------------------------------------------------------------------
    def _send(self, h: Tensor, step: int, phase: str) -> None:
        t0 = time.perf_counter()
        bufs = self.pp.encode([h], Where(self.index, "act", step, 0, training=False))
        t1 = time.perf_counter()
        for _, buf in bufs:
            dist.send(buf, self.ranks[self.index + 1])
        t2 = time.perf_counter()
        self.timings["codec"] += t1 - t0
        self.timings["wire"] += t2 - t1
        raw = h.numel() * h.element_size()
        wire = sum(b.numel() * b.element_size() for _, b in bufs)
        for i, v in enumerate((raw, wire, h.numel())):
            self.traffic[phase][i] += v

    def _recv(self, shape: tuple[int, ...], step: int) -> Tensor:
        where, spec = Where(self.index - 1, "act", step, 0, training=False), [TensorSpec(shape, self.dtype)]
        bufs = self.pp.recv_buffers(spec, where, self.device, [None])
        t0 = time.perf_counter()
        for _, buf in bufs:
            dist.recv(buf, self.ranks[self.index - 1])
        t1 = time.perf_counter()
        (h,) = self.pp.decode(spec, where, [None], bufs)
        self.timings["wire"] += t1 - t0
        self.timings["codec"] += time.perf_counter() - t1
        return h

    def _step(self, x: Tensor | None, shape: tuple[int, int], positions: Tensor, valid: Tensor, step: int,
              phase: str, last_only: bool = False) -> Tensor | None:
        """Run this stage on one step's input: the ids (stage 0) or what the previous stage sends; pass it on."""
        b, t = shape
        if self.index > 0:
            x = self._recv((b, t, self.width), step)
        t0 = time.perf_counter()
        y = self.stage(x, positions, valid, last_only)  # type: ignore[arg-type]
        self.timings["compute"] += time.perf_counter() - t0
        if self.index < self.stages - 1:
            self._send(y.to(self.dtype), step, phase)
            return None
        return y

    # --- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]] | None, max_new_tokens: int, stop_token: int | None = None,
                 temperature: float = 0.0, seed: int = 0, pad_token: int = 0,
                 on_step: Callable[[int], None] | None = None) -> list[list[int]]:
        """New tokens per prompt (on every rank), until `stop_token` (kept) or `max_new_tokens`. Stage 0 passes the
        prompts (token-id lists); the other stages pass None. `on_step(step)` runs after each step (a progress bar)."""
        lens = self._broadcast_lengths(prompts)
        b, longest = len(lens), max(lens)
        if min(lens) < 1:
            raise ValueError("every prompt needs at least one token")
        if self.context is not None and longest + max_new_tokens > self.context:
            raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is longer than the "
                             f"model's context of {self.context} positions; shorten the prompt or generate fewer "
                             "tokens")
        pad = torch.tensor([longest - n for n in lens], device=self.device)  # (B,) left padding
        ids = None
        if self.index == 0:
            ids = torch.full((b, longest), pad_token, dtype=torch.long, device=self.device)  # (B, T)
            for r, p in enumerate(prompts or []):
                ids[r, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        self.stage.reset(b, longest + max_new_tokens, self.device, self.dtype)
        positions = (torch.arange(longest, device=self.device)[None, :] - pad[:, None]).clamp_(min=0)  # (B, T)
        valid = torch.arange(longest, device=self.device)[None, :] >= pad[:, None]  # (B, T)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out: list[list[int]] = [[] for _ in range(b)]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        t = longest
        for step in range(max_new_tokens):
            phase = "prefill" if step == 0 else "decode"
            logits = self._step(ids, (b, t), positions, valid, step, phase, last_only=True)  # (B, 1, V) last stage
            nxt = torch.zeros(b + 1, dtype=torch.long, device=self.device)  # (B + 1,): tokens, then the done flag
            if logits is not None:
                last = logits[:, -1].float()  # (B, V)
                if temperature > 0:
                    tok = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)[:, 0]  # (B,)
                else:
                    tok = last.argmax(-1)  # (B,)
                tok = torch.where(done, torch.full_like(tok, pad_token), tok)
                if stop_token is not None:
                    done |= tok == stop_token
                nxt[:b], nxt[b] = tok, int(bool(done.all()) or step == max_new_tokens - 1)
            dist.broadcast(nxt, src=self.ranks[-1])
            for r in range(b):
                out[r].append(int(nxt[r]))
            if on_step is not None:
                on_step(step)
            if int(nxt[b]):
                break
            ids = nxt[:b, None].clone()  # (B, 1)
            positions = positions[:, -1:] + 1  # (B, 1)
            valid = torch.cat([valid, torch.ones(b, 1, dtype=torch.bool, device=self.device)], dim=1)  # (B, L + 1)
            t = 1
        return [seq[: seq.index(stop_token) + 1] if stop_token in seq else seq for seq in out]

    @torch.no_grad()
    def score(self, sequences: list[list[int]] | None, pad_token: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Teacher-forced scoring in one pass (prefill only): for every position of every sequence, the top-1 next
        token and the log-probability of the sequence's own next token. Returns (top1 (B, T-1), logprob (B, T-1), real
        (B, T-1): which positions are not padding) on every rank; stage 0 passes the sequences, the others None."""
        lens = self._broadcast_lengths(sequences)
        b, longest = len(lens), max(lens)
        pad = torch.tensor([longest - n for n in lens], device=self.device)  # (B,)
        ids = torch.full((b, longest), pad_token, dtype=torch.long, device=self.device)  # (B, T)
        if self.index == 0:
            for r, seq in enumerate(sequences or []):
                ids[r, longest - len(seq):] = torch.tensor(seq, dtype=torch.long)
        dist.broadcast(ids, src=self.ranks[0])  # the last stage needs the targets
        self.stage.reset(b, longest, self.device, self.dtype)
        positions = (torch.arange(longest, device=self.device)[None, :] - pad[:, None]).clamp_(min=0)  # (B, T)
        valid = torch.arange(longest, device=self.device)[None, :] >= pad[:, None]  # (B, T)
        logits = self._step(ids if self.index == 0 else None, (b, longest), positions, valid, 0, "prefill")
        top1 = torch.zeros(b, longest - 1, dtype=torch.long, device=self.device)  # (B, T-1)
        logprob = torch.zeros(b, longest - 1, dtype=torch.float32, device=self.device)  # (B, T-1)
        if logits is not None:
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, T-1, V)
            top1, logprob = lp.argmax(-1), lp.gather(-1, ids[:, 1:, None])[..., 0]
        dist.broadcast(top1, src=self.ranks[-1])
        dist.broadcast(logprob, src=self.ranks[-1])
        return top1, logprob, valid[:, :-1] & valid[:, 1:]

    def _broadcast_lengths(self, prompts: list[list[int]] | None) -> list[int]:
        """The prompts' lengths, from stage 0 to every stage (two small broadcasts)."""
        n = torch.tensor([len(prompts) if prompts is not None else 0], dtype=torch.long, device=self.device)
        dist.broadcast(n, src=self.ranks[0])
        lens = torch.tensor([len(p) for p in prompts] if self.index == 0 and prompts is not None else [0] * int(n),
                            dtype=torch.long, device=self.device)
        dist.broadcast(lens, src=self.ranks[0])
        return lens.tolist()

    def stats(self) -> dict[str, Any]:
        """This rank's timings, traffic (prefill and decode apart, bits per element) and compression statistics."""
        bits = {k: (8 * w / n if n else None) for k, (_, w, n) in self.traffic.items()}
        return {"timings": dict(self.timings), "traffic": {k: list(v) for k, v in self.traffic.items()},
                "bits_per_element": bits, "pp_compress": {k: v.as_dict() for k, v in self.pp.stats.items() if v.calls}}
