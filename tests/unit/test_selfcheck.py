"""The start-up self-check (pp_compress/selfcheck.py): stages in threads over an in-memory transport; a transport that
changes a message is caught by name, one that delivers it intact passes."""
import queue
import threading

import pytest
import torch

from pp_compress.selfcheck import probe, self_check


def run(stages, tamper=None):
    """self_check on every stage, each in its thread; `tamper(src, dst, buf)` may change a message in flight."""
    links = {(a, b): queue.Queue() for a in range(stages) for b in range(stages)}
    errors = {}

    def stage(s):
        def exchange(ops):
            for kind, peer, buf in ops:
                if kind == "send":
                    sent = buf.clone()
                    if tamper:
                        tamper(s, peer, sent)
                    links[(s, peer)].put(sent)
                else:
                    buf.copy_(links[(peer, s)].get(timeout=30))
        try:
            self_check(s, stages, torch.device("cpu"), exchange, "the test transport")
        except Exception as e:  # noqa: BLE001 - whatever a stage raised is the test's to judge
            errors[s] = str(e)

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("stages", [2, 4])
def test_an_intact_transport_passes(stages):
    assert run(stages) == {}


def test_a_transport_that_changes_a_message_is_caught_by_its_receiver():
    def flip_sign_of_zero(src, dst, buf):  # -0.0 arriving as 0.0: equal as floats, not as bits
        if (src, dst) == (2, 1):
            buf.reshape(-1).view(torch.uint8)[7] ^= 0x80  # the top byte of value 1, -0.0
    errors = run(4, flip_sign_of_zero)
    assert list(errors) == [1]
    assert "from stage 2 to stage 1 (boundary 1, grad) arrived changed through the test transport's p2p: 1 of" in errors[1]


def test_the_probe_holds_the_values_a_changed_transport_would_alter():
    x = probe(0, "act", torch.device("cpu"))
    flat = x.view(-1)
    assert flat[1].item() == 0.0 and torch.signbit(flat[1]) and 0 < flat[2].item() < torch.finfo(torch.float32).tiny
    assert not torch.equal(probe(0, "act", torch.device("cpu")), probe(0, "grad", torch.device("cpu")))
    assert torch.equal(x, probe(0, "act", torch.device("cpu")))  # the same on every rank
