"""auto's pure parts (pp_compress/auto.py): the spec, the admitted candidates, the cost model, the measurements."""
import time

import pytest
import torch

import pp_compress as ppc
from pp_compress.advice import verdicts
from pp_compress.auto import (Cost, Link, candidate_op, candidate_ops, candidates, choose, describe, fastest_trips,
                              link_of, measure_codec)
from pp_compress.config import AutoConfig

MB = 1 << 20


def test_the_spec_and_its_errors():
    assert AutoConfig.parse("auto") == AutoConfig()
    assert AutoConfig.parse("auto:max=aggressive:model=SmolLM2-135M") == AutoConfig("aggressive", "SmolLM2-135M")
    assert AutoConfig.parse("auto:model=small-gpt") == AutoConfig.parse("auto:model=Small_GPT") == AutoConfig("safe", "small GPT")
    for bad, words in [("auto:max=fast", "max='fast'; accepted: safe, aggressive"), ("auto:speed=1", "accepted keys"),
                       ("auto:model=GPT-9", "accepted: small GPT, SmolLM2-135M"), ("auto:max=safe:max=safe", "each once"),
                       ("safe", "is not an auto spec")]:
        with pytest.raises(ValueError, match=words):
            AutoConfig.parse(bad)


def test_the_candidates_stop_at_the_budget_and_are_never_measured_worse():
    assert candidates(AutoConfig()) == ["none", "safe"]
    assert candidates(AutoConfig("aggressive", "SmolLM2-135M")) == ["none", "safe", "aggressive"]
    assert candidates(AutoConfig("aggressive")) == ["none", "safe", "aggressive"]  # parity by the loss rule on both
    for name in candidates(AutoConfig("aggressive"))[1:]:
        assert all(v.loss_rule == "parity" for v in verdicts(ppc.PRESETS[name]))
    ops = candidate_ops(AutoConfig("aggressive"), "grad")
    assert [op.spec for op in ops.values()] == ["int8:rot", "vq:3"]


def test_a_setting_that_is_no_preset_is_a_candidate_only_on_a_family_where_both_rules_put_it_at_parity():
    """int8 (no rotation) is at parity on both rules on the small GPT, and worse by lm-eval on SmolLM2 (outlier
    channels): a candidate there only, and never for a family not named."""
    assert candidates(AutoConfig("aggressive", "small GPT")) == ["none", "int8", "safe", "aggressive"]
    assert candidates(AutoConfig("safe", "small GPT")) == ["none", "int8", "safe"]
    assert "int8" not in candidates(AutoConfig("aggressive", "SmolLM2-135M"))
    assert "int8" not in candidates(AutoConfig("aggressive"))
    assert [v.lm_eval for v in verdicts("int8", "SmolLM2-135M")] == ["worse"]
    assert candidate_ops(AutoConfig("safe", "small GPT"), "act")["int8"].spec == "int8"
    with pytest.raises(ValueError, match="has no operator"):
        candidate_op("none", 0, "act")


def test_the_cost_model_sends_dense_on_a_fast_link_and_compresses_on_a_slow_one():
    raw = 8 * MB
    costs = {"safe": Cost(0.3e-3, 0.3e-3, raw // 4), "aggressive": Cost(4e-3, 1e-3, raw // 8)}
    nvlink = choose(Link(400e9, 5e-6), raw, costs)
    assert nvlink.candidate == "none" and nvlink.saving == 0.0
    ib = choose(Link(50e9 / 8 * 8, 5e-6), raw, costs)  # 50 GB/s: 0.17 ms dense, 0.64 ms through safe
    assert ib.candidate == "none"
    ethernet = choose(Link(1.25e9, 50e-6), raw, costs)  # 10 Gbit/s: 6.7 ms dense, 2.3 ms safe, 5.9 ms aggressive
    assert ethernet.candidate == "safe" and 0.6 < ethernet.saving < 0.7
    internet = choose(Link(5e6 / 8, 20e-3), raw, costs)  # 5 Mbit/s: the fewest bytes win
    assert internet.candidate == "aggressive"
    assert choose(Link(1e9, 0.0), raw, {}).candidate == "none"
    assert describe(1, "act", Link(1.25e9, 50e-6), ethernet) == (
        "pp_compress auto: boundary 1 act: link 1.25 GB/s, 0.05 ms; safe (int8:rot): 2.33 ms per message expected "
        "against 6.76 ms dense (66% saved)")


def test_a_codec_is_measured_on_the_real_tensor():
    x = torch.randn(4, 64, 576)
    op = ppc.build("int8:rot")
    cost = measure_codec(op, x, ppc.Context(), reps=3)
    assert cost.wire_bytes == op.wire_nbytes(tuple(x.shape), x.dtype) and cost.encode_s > 0 and cost.decode_s > 0


def test_the_guards_error_is_measured_on_spaced_rows_and_matches_the_whole_tensors():
    from pp_compress.auto import GUARD_ELEMENTS, relative_error

    x = torch.randn(8, 64, 576, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 10, 576)
    op = ppc.build("int8:rot")
    seen = []
    real = op.compress
    op.compress = lambda t, ctx: (seen.append(tuple(t.shape)), real(t, ctx))[1]
    sampled = relative_error(op, x, ppc.Context())
    assert seen == [(x.numel() // 576 // (x.numel() // GUARD_ELEMENTS), 576)]
    ref = x.double()
    whole = float((ref - op.decompress(real(x, ppc.Context()), ppc.Context()).double()).norm() / ref.norm())
    assert sampled == pytest.approx(whole, rel=0.05)


def test_a_link_is_measured_from_round_trips():
    def round_trip(n):  # a simulated 100 MB/s link with 2 ms each way
        t0 = time.perf_counter()
        time.sleep(0.004 + n / 100e6)
        return time.perf_counter() - t0
    link = link_of(*fastest_trips(round_trip, 2 * MB, reps=3), 2 * MB)
    assert 60e6 < link.bandwidth < 140e6 and 0.0015 < link.latency < 0.004
    with pytest.raises(ValueError, match="a positive bandwidth"):
        Link(0.0, 1e-3)


def test_a_trip_slowed_by_something_else_does_not_make_a_fast_link_look_slow():
    """One descheduled round trip of each size, among few: the link is still measured at its speed."""
    slow = iter([True, False, True, False])  # the first trip of each size waits 50 ms on something else
    link = link_of(*fastest_trips(lambda n: 1e-4 + n / 10e9 + (0.05 if next(slow) else 0.0), 2 * MB, reps=2), 2 * MB)
    assert link.bandwidth == pytest.approx(10e9, rel=1e-6) and link.latency == pytest.approx(5e-5)
