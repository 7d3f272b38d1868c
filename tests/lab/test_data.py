"""recipes/data.py on the committed fixture corpus only: offline, no fetch, a few seconds."""
import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from pp_lab import data

SEQ = 64
VAL = 0.1


@pytest.fixture(scope="module", autouse=True)
def _private_hf_cache(tmp_path_factory):
    """datasets' caches go to a temporary folder, not the repository's .cache."""
    mp = pytest.MonkeyPatch()
    mp.setattr(data, "HF_DATASETS", tmp_path_factory.mktemp("hf") / "datasets")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def lm(tok):
    return data.lm_datasets(data.corpus_files("fixture"), tok, SEQ, VAL)


def rows(ds) -> list[tuple[int, ...]]:
    return [tuple(r) for r in ds["input_ids"]]


# ------------------------------------------------------------------------------------- tokenizer, corpora

def test_gpt2_tokenizer_gives_gpt2_ids(tok, tmp_path):
    assert tok.encode("Hello world") == [15496, 995]
    assert tok(" the quick brown fox\n\nSay it ain't so")["input_ids"] == [262, 2068, 7586, 21831, 198, 198, 25515,
                                                                          340, 18959, 470, 523]
    assert tok.eos_token_id == 50256 and len(tok) == 50257
    text = data.FIXTURE.joinpath("sonnets_1-70.txt").read_text()[:5000]
    assert data._encode(tok, [text]) == [tok(text)["input_ids"]]  # the fast path gives the same ids
    tok.save_pretrained(tmp_path)
    assert data.load_tokenizer(str(tmp_path)).encode("Hello world") == [15496, 995]
    with pytest.raises(ValueError, match="'gpt-2'.*'gpt2' or a local folder"):
        data.load_tokenizer("gpt-2")


def test_fixture_corpus_and_bad_names(monkeypatch, tmp_path):
    files = data.corpus_files("fixture")
    assert [f.name for f in files] == ["macbeth_act1.txt", "sonnets_1-70.txt"]
    assert all(0 < f.stat().st_size < 100_000 for f in files)
    with pytest.raises(ValueError) as e:
        data.corpus_files("shakspeare")
    assert "'shakspeare'" in str(e.value) and all(name in str(e.value) for name in data.CORPORA)
    monkeypatch.setattr(data, "CACHE", tmp_path)
    with pytest.raises(FileNotFoundError, match="fetch kjv"):
        data.corpus_files("kjv", fetch=False)


def test_fetch_is_atomic_and_reports_the_failed_command(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "CACHE", tmp_path)
    fail = [sys.executable, "-c", "import sys; sys.stderr.write('no such package'); sys.exit(3)"]

    def broken(work: Path, out: Path) -> None:
        (out / "half.txt").write_text("half a corpus")
        data._run("kjv", fail)

    monkeypatch.setitem(data._FETCHERS, "kjv", broken)
    with pytest.raises(RuntimeError) as e:
        data.corpus_files("kjv")
    msg = str(e.value)
    assert "'kjv'" in msg and "sys.exit(3)" in msg and "exited with 3" in msg and "no such package" in msg
    assert list((tmp_path / "corpora").iterdir()) == []  # no half corpus, no leftover temporary folder

    monkeypatch.setitem(data._FETCHERS, "kjv", lambda work, out: (out / "a.txt").write_text("whole"))
    assert [f.read_text() for f in data.corpus_files("kjv")] == ["whole"]
    assert [p.name for p in (tmp_path / "corpora").iterdir()] == ["kjv"]


def test_import_is_offline_and_light():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "PP_COMPRESS"))}
    code = ("import os, sys, pp_lab.data as d; "
            "print(sorted(m for m in ('deepspeed', 'datasets', 'transformers') if m in sys.modules)); "
            "print([os.environ[k] for k in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE', 'TRANSFORMERS_OFFLINE')]); "
            "print(os.environ['HF_HOME'] == str(d.ROOT / '.cache' / 'hf'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=data.ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[:3] == ["[]", "['1', '1', '1']", "True"]


# ------------------------------------------------------------------------------------------- lm_datasets

def test_lm_datasets_are_the_token_stream_cut_into_blocks(tok, lm):
    train, val = lm
    assert train.column_names == val.column_names == ["input_ids", "labels", "sample_id"]
    expected = {"train": [], "val": []}  # rebuilt independently: head of every file + EOS, tail + EOS
    for f in data.corpus_files("fixture"):
        ids = tok(f.read_text())["input_ids"]
        cut = len(ids) - round(len(ids) * VAL)
        expected["train"] += ids[:cut] + [tok.eos_token_id]
        expected["val"] += ids[cut:] + [tok.eos_token_id]
    for ds, stream in ((train, expected["train"]), (val, expected["val"])):
        n = len(stream) // (SEQ + 1)
        assert len(ds) == n > 0
        x, y = torch.tensor(ds["input_ids"]), torch.tensor(ds["labels"])
        assert x.shape == y.shape == (n, SEQ)
        blocks = torch.tensor(stream[: n * (SEQ + 1)]).view(n, SEQ + 1)
        assert torch.equal(x, blocks[:, :-1]) and torch.equal(y, blocks[:, 1:])  # labels = next tokens
    assert len(val) / (len(train) + len(val)) == pytest.approx(VAL, abs=0.03)


def test_lm_sample_ids_unique_and_splits_disjoint(lm):
    train, val = lm
    assert list(train["sample_id"]) == list(range(len(train)))
    assert list(val["sample_id"]) == list(range(len(train), len(train) + len(val)))
    assert not set(rows(train)) & set(rows(val))
    assert not {tuple(r[i:i + 16]) for r in rows(train) for i in range(0, SEQ, 16)} & \
        {tuple(r[i:i + 16]) for r in rows(val) for i in range(0, SEQ, 16)}  # no shared 16-token runs either


def test_lm_datasets_deterministic(tok, lm):
    again = data.lm_datasets(data.corpus_files("fixture"), tok, SEQ, VAL)
    for a, b in zip(lm, again):
        assert a.to_dict() == b.to_dict()
    other = data.lm_datasets(data.corpus_files("fixture")[:1], tok, SEQ, VAL)[0]  # not a stale cache
    assert len(other) < len(lm[0])
    with pytest.raises(ValueError, match="too little text"):
        data.lm_datasets(data.corpus_files("fixture"), tok, 100_000)


# ----------------------------------------------------------------------------------------------- batches

def test_batches_format_and_contents(lm):
    train = lm[0]
    (x, sid), y = next(data.batches(train, 4, seed=0))
    assert x.shape == y.shape == (4, SEQ) and sid.shape == (4,)
    assert x.dtype == y.dtype == sid.dtype == torch.int64
    for i, s in enumerate(sid.tolist()):  # the row with that sample id
        assert x[i].tolist() == train[s]["input_ids"] and y[i].tolist() == train[s]["labels"]


def test_batches_shuffle_epochs_deterministically(lm):
    train, b = lm[0], 4
    per_epoch = len(train) // b

    def ids(seed: int, n: int) -> list[list[int]]:
        return [sid.tolist() for (_, sid), _ in islice(data.batches(train, b, seed), n)]

    run = ids(0, 2 * per_epoch)
    assert run == ids(0, 2 * per_epoch)
    assert run != ids(1, 2 * per_epoch)
    epochs = [sum(run[:per_epoch], []), sum(run[per_epoch:], [])]
    for epoch in epochs:  # each sample at most once per epoch; only the partial last batch is dropped
        assert len(set(epoch)) == len(epoch) == per_epoch * b
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])


@pytest.mark.parametrize("skip", [0, 1, 5, "epoch-2", "epoch", "2*epoch+3"])
def test_batches_skip_equals_drawing(lm, skip):
    train, b = lm[0], 3
    per_epoch = len(train) // b
    n = {"epoch-2": per_epoch - 2, "epoch": per_epoch, "2*epoch+3": 2 * per_epoch + 3}.get(skip, skip)
    drawn = list(islice(data.batches(train, b, seed=7), n, n + 5))  # "epoch-2" crosses into the next epoch
    resumed = list(islice(data.batches(train, b, seed=7, skip=n), 5))
    for ((x1, s1), y1), ((x2, s2), y2) in zip(drawn, resumed, strict=True):
        assert torch.equal(x1, x2) and torch.equal(s1, s2) and torch.equal(y1, y2)


def test_batches_skip_is_cheap_and_errors(lm):
    next(data.batches(lm[0], 4, seed=0, skip=10**12))  # would take forever if skipped batches were built
    with pytest.raises(ValueError, match="no micro-batch"):
        next(data.batches(lm[1], len(lm[1]) + 1, seed=0))


def test_eval_batches_in_order(lm):
    val = lm[1]
    out = list(data.eval_batches(val, 3))
    assert len(out) == len(val) // 3
    assert torch.cat([sid for (_, sid), _ in out]).tolist() == list(val["sample_id"])[: len(out) * 3]
    assert torch.equal(torch.cat([x for (x, _), _ in out]), torch.tensor(val["input_ids"][: len(out) * 3]))


# --------------------------------------------------------------------------------------------------- sft

def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PAIRS = [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(19)]
PAIRS.append({"prompt": "Say a long thing.", "response": "word " * 200})  # truncated at seq_len


def _check_sft(train, val, tok, n_rows: int, prompt_ids, full_ids) -> None:
    assert sorted(list(train["sample_id"]) + list(val["sample_id"])) == list(range(n_rows))
    assert len(val) == 1  # round(20 * 0.05)
    for ds in (train, val):
        for x, y, i in zip(ds["input_ids"], ds["labels"], ds["sample_id"]):
            full, p = full_ids[i][: SEQ + 1], len(prompt_ids[i])
            n = min(len(full), SEQ)
            assert x[:n] == full[:n] and set(x[n:]) <= {tok.eos_token_id}  # padded with EOS (GPT-2 has no pad)
            assert y[: p - 1] == [-100] * (p - 1)  # no loss on predicting prompt tokens
            assert y[p - 1: len(full) - 1] == full[p:]  # loss on every response token (+ end of turn)
            assert y[len(full) - 1:] == [-100] * (SEQ - len(full) + 1)  # nor on padding


def test_sft_prompt_response_without_chat_template(tok, tmp_path):
    train, val = data.sft_datasets(_jsonl(tmp_path / "qa.jsonl", PAIRS), tok, SEQ)
    prompts = [tok(r["prompt"] + "\n")["input_ids"] for r in PAIRS]
    fulls = [p + tok(r["response"])["input_ids"] + [tok.eos_token_id] for p, r in zip(prompts, PAIRS)]
    _check_sft(train, val, tok, len(PAIRS), prompts, fulls)
    long = (train if 19 in train["sample_id"] else val).filter(lambda r: r["sample_id"] == 19)[0]
    assert -100 not in long["labels"][len(prompts[19]):]  # truncated: loss up to the last position
    assert tok.decode([t for t in train[0]["labels"] if t != -100]).startswith("It is")


def test_sft_prompt_response_with_chat_template(tmp_path):
    tok = data.load_tokenizer("gpt2")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|endoftext|>{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    train, val = data.sft_datasets(_jsonl(tmp_path / "qa.jsonl", PAIRS), tok, SEQ)
    prompts = [tok(f"<user>{r['prompt']}<|endoftext|><assistant>")["input_ids"] for r in PAIRS]
    fulls = [p + tok(r["response"] + "<|endoftext|>")["input_ids"] for p, r in zip(prompts, PAIRS)]
    assert fulls[0][-1] == tok.eos_token_id  # the special token in the template text is one token
    _check_sft(train, val, tok, len(PAIRS), prompts, fulls)


def test_sft_text_rows_txt_and_errors(tok, tmp_path):
    texts = [{"text": f"Line number {i} of a small text file."} for i in range(10)]
    train, val = data.sft_datasets(_jsonl(tmp_path / "t.jsonl", texts), tok, 16, val_fraction=0.2)
    assert len(train) == 8 and len(val) == 2
    row = train[0]
    ids = tok(texts[row["sample_id"]]["text"])["input_ids"] + [tok.eos_token_id]
    assert row["labels"][: len(ids) - 1] == ids[1:] and set(row["labels"][len(ids) - 1:]) == {-100}

    same = data.sft_datasets(data.FIXTURE / "macbeth_act1.txt", tok, SEQ)
    assert same[0].to_dict() == data.lm_datasets([data.FIXTURE / "macbeth_act1.txt"], tok, SEQ)[0].to_dict()
    with pytest.raises(ValueError, match="'text' field or 'prompt' and 'response'"):
        data.sft_datasets(_jsonl(tmp_path / "bad.jsonl", [{"question": "?"}]), tok, SEQ)
    with pytest.raises(ValueError, match="expected a .txt file"):
        data.sft_datasets(tmp_path / "data.csv", tok, SEQ)


# --------------------------------------------------------------------------------------------------- CLI

def test_cli_fetch_and_stats_on_the_fixture(capsys):
    data.main(["fetch", "fixture"])
    data.main(["stats", "fixture"])
    out = capsys.readouterr().out
    assert "fixture: 2 files, 67,536 bytes" in out and "19,241 tokens (gpt2)" in out


def test_run_record_and_val_fraction(tmp_path):
    assert data.run_record(tmp_path) is None and data.run_val_fraction(tmp_path) is None  # a transformers folder
    (tmp_path / "run.json").write_text(json.dumps({"args": {"val_fraction": "0.05"}, "pp_compress": "int8"}))
    assert data.run_record(tmp_path)["pp_compress"] == "int8"
    assert data.run_val_fraction(tmp_path) == 0.05  # train.py records args as strings
    (tmp_path / "run.json").write_text(json.dumps({"args": {"val_fraction": "None"}}))
    assert data.run_val_fraction(tmp_path) is None
    (tmp_path / "run.json").write_text(json.dumps({"args": {}}))  # runs from before --val-fraction was recorded
    assert data.run_val_fraction(tmp_path) is None
