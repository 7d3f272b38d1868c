"""pp_compress.Codec: one call per message each way, the exact size known in advance, both sides in step."""
import pytest
import torch

import pp_compress as ppc


@pytest.mark.parametrize("spec,direction", [("identity", "act"), ("safe", "act"), ("aggressive", "grad"),
                                            ("act=int3:stoch,grad=int8", "act"), ("int4+ef21", "act"),
                                            ("topk:0.1", "grad")])
def test_unpack_gives_what_the_operator_reconstructs_and_the_size_is_known(spec, direction):
    send, recv = ppc.Codec(spec, direction=direction), ppc.Codec(spec, direction=direction)
    cfg = ppc.parse_spec(spec)
    ref = cfg.spec_for(0, direction).build()
    for step in range(3):  # stochastic rounding and EF21's shared state must follow the message count on both sides
        x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(step))
        buf, n = send.pack(x)
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and n == buf.numel() == recv.nbytes(x.shape, x.dtype)
        y = recv.unpack(buf, x.shape, x.dtype)
        ctx = ppc.Context(direction=direction, step=step)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(y, ref.decompress(ref.compress(x, ctx), ctx)), (spec, step)
    if spec == "identity":
        assert torch.equal(y, x)


def test_a_buffer_of_the_wrong_size_is_refused_with_both_sizes():
    send, recv = ppc.Codec("int8"), ppc.Codec("int8")
    buf, n = send.pack(torch.randn(4, 64))
    with pytest.raises(ValueError, match=f"buffer has {n - 1} bytes, layout needs {n}"):
        recv.unpack(buf[:-1], (4, 64), torch.float32)


def test_a_bad_direction_names_the_accepted_ones():
    with pytest.raises(ValueError, match="direction='fwd'; accepted: act, grad"):
        ppc.Codec("int8", direction="fwd")


@pytest.mark.parametrize("spec", ["int8", "safe", "aggressive", "topk:0.1", "nf6", "int3:stoch"])
def test_random_bytes_from_a_peer_decode_to_finite_values_or_one_error_that_says_the_message_is_corrupt(spec):
    send, recv = ppc.Codec(spec), ppc.Codec(spec)
    x = torch.randn(4, 128, 576)
    _, n = send.pack(x)
    for seed in range(8):
        noise = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        try:
            y = recv.unpack(noise, x.shape, x.dtype)
        except (ValueError, FloatingPointError) as e:
            assert str(e).startswith("boundary0.act: ") and "corrupt" in str(e), str(e)
        else:
            assert y.shape == x.shape and bool(torch.isfinite(y).all())
