"""eval/tasks.py: the held-out sets follow the run's validation split, and the word-order task is well formed."""
import json

import pytest

from pp_lab.eval import tasks
from pp_lab import data


def test_held_out_fraction_follows_the_runs_validation_split(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"args": {"val_fraction": "0.05"}}))
    assert tasks.held_out_fraction(tmp_path) == pytest.approx(0.045)
    assert tasks.held_out_fraction(tmp_path / "hf_folder") == tasks.DEFAULT  # no run.json: a transformers folder
    (tmp_path / "run.json").write_text(json.dumps({"args": {"val_fraction": "0.004"}}))
    with pytest.raises(ValueError, match="--val-fraction 0.004 leaves no held-out text"):
        tasks.held_out_fraction(tmp_path)
    assert tasks.task_dir(0.045) != tasks.task_dir(tasks.DEFAULT)


def test_held_out_text_is_the_tail_of_every_file(monkeypatch):
    texts = [f.read_text(encoding="utf-8") for f in data.corpus_files("fixture")]
    for frac in (0.1, 0.2):
        monkeypatch.setitem(tasks.HELD_OUT, "fixture", frac)
        tails = tasks.held_out("fixture")
        assert [len(t) for t in tails] == [round(len(x) * frac) for x in texts]
        assert all(x.endswith(t) for x, t in zip(texts, tails))


def test_word_order_choices_swap_one_pair_of_neighbouring_words(tmp_path):
    names = tasks.build("fixture", tmp_path)
    assert names == [f"ppc_fixture_{k}" for k in ("ppl", "nextline", "wordorder", "lastword")]
    docs = [json.loads(x) for x in (tmp_path / "ppc_fixture_wordorder.jsonl").read_text().splitlines()]
    assert len(docs) > 20
    labels = set()
    for d in docs:
        true = d["choices"][d["label"]]
        assert len(set(d["choices"])) == 4  # distinct: exactly one right answer
        for c in d["choices"]:
            a, b = c.split(), true.split()
            diff = [i for i in range(len(a)) if a[i] != b[i]]
            assert len(a) == len(b) and (diff == [] if c == true else len(diff) == 2 and diff[1] == diff[0] + 1
                                         and (a[diff[0]], a[diff[1]]) == (b[diff[1]], b[diff[0]]))
        labels.add(d["label"])
    assert labels == {0, 1, 2, 3}  # the answer's position is drawn, not fixed
