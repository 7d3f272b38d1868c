import json

import pytest

import pp_compress as ppc
from pp_compress.config import CompressorSpec
from tests.conftest import FEEDBACK_SPECS, OP_SPECS

CONFIG_FORMS = [
    "topk:0.1",
    "act=int8,grad=topk:0.1+ef",
    "act=int4:per=block64:asym:stoch:scale=fp16,grad=bf16",
    "act=topk:0.1>int8,grad=int8,eval=none",
    "act=int8,grad=int8,warmup=100,min_numel=4096,seed=3,nonfinite=allow",
    "act=int8,grad=topk:0.3+ef,b1.grad=int8,b0.act=identity",
    "act=lowrank:8:method=svd:iters=2+ef21,grad=randk:0.1:unbiased",
    "int8+aqsgd",
]


@pytest.mark.parametrize("spec", OP_SPECS + FEEDBACK_SPECS)
def test_operator_spec_roundtrip(spec):
    parsed = CompressorSpec.parse(spec)
    assert CompressorSpec.parse(str(parsed)) == parsed
    assert ppc.build(str(parsed)).spec == str(parsed)


@pytest.mark.parametrize("text", CONFIG_FORMS)
def test_config_string_and_json_roundtrip(text):
    cfg = ppc.parse_spec(text)
    assert ppc.parse_spec(str(cfg)) == cfg
    d = json.loads(json.dumps(cfg.to_dict()))
    assert ppc.CompressionConfig.from_dict(d) == cfg
    assert str(ppc.CompressionConfig.from_dict(d)) == str(cfg)


def test_canonical_forms():
    assert str(ppc.parse_spec("topk:0.1")) == "act=topk:0.1,grad=topk:0.1"
    assert str(CompressorSpec.parse("int8:per=row:scale=bf16")) == "int8"
    assert str(CompressorSpec.parse("fp8")) == "fp8:e4m3"
    assert str(CompressorSpec.parse("none")) == "identity"
    assert str(CompressorSpec.parse("vq:4:dim=2")) == "vq:4"  # a whole float as typed, not vq:4.0
    assert str(CompressorSpec.parse("topk:1.0")) == "topk:1" and CompressorSpec.parse("topk:1").ops[0].ratio == 1.0


def test_spec_for_overrides_and_eval():
    cfg = ppc.parse_spec("act=int8,grad=topk:0.3+ef,b1.grad=int8,eval=none")
    assert str(cfg.spec_for(0, "grad")) == "topk:0.3+ef"
    assert str(cfg.spec_for(1, "grad")) == "int8"
    assert str(cfg.spec_for(1, "act")) == "int8"
    assert cfg.spec_for(0, "act", training=False).is_identity
    assert str(ppc.parse_spec("int8").spec_for(0, "act", training=False)) == "int8"


def test_dataclass_accepts_strings_and_is_frozen():
    cfg = ppc.CompressionConfig(activations="int8", gradients="topk:0.1+ef", warmup_steps=5)
    assert cfg == ppc.parse_spec("act=int8,grad=topk:0.1+ef,warmup=5")
    with pytest.raises(Exception):
        cfg.warmup_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad,token",
    [
        ("topz:0.1", "'topz'"),
        ("topk:0", "topk:0"),
        ("topk:1.5", "topk:1.5"),
        ("topk:-0.1", "topk:-0.1"),
        ("topk:abc", "'abc'"),
        ("topk", "'topk'"),
        ("int9", "int9"),
        ("int8+efx", "'efx'"),
        ("int8+ef+ef21", "feedback"),
        ("act=int8,,grad=int8", "empty item"),
        ("act=int8,foo=int8", "'foo=int8'"),
        ("act=int8,act=int4", "given twice"),
        ("act=int8,warmup=ten", "warmup_steps"),
        ("act=int8,nonfinite=ignore", "nonfinite"),
        ("", "empty"),
        ("topk:0.1>", "unknown operator ''"),
        ("int8:per=block", "per='block'"),
    ],
)
def test_bad_specs_name_the_bad_token_and_the_accepted_forms(bad, token):
    with pytest.raises(ValueError) as e:
        ppc.parse_spec(bad)
    msg = str(e.value)
    assert token in msg, msg
    assert "accepted" in msg or "e.g." in msg or "given twice" in msg, msg


def test_unknown_json_keys_are_errors():
    with pytest.raises(ValueError, match="unknown pp_compress key"):
        ppc.CompressionConfig.from_dict({"activations": "int8", "gradient": "int8"})
    with pytest.raises(ValueError, match="boundaries"):
        ppc.CompressionConfig.from_dict({"boundaries": {"0": {"act": "int8"}}})
    with pytest.raises(ValueError, match="warmup_steps"):
        ppc.CompressionConfig.from_dict({"warmup_steps": -1})


def test_batch_dim_round_trips_and_is_checked():
    cfg = ppc.parse_spec("int8,batch_dim=1")
    assert cfg.batch_dim == 1 and ppc.parse_spec(str(cfg)) == cfg
    assert ppc.CompressionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="batch_dim"):
        ppc.parse_spec("int8,batch_dim=-1")


def test_presets_stand_for_their_spec_and_take_more_keys():
    parse_spec = ppc.parse_spec
    from pp_compress.presets import PRESETS

    for name, spec in PRESETS.items():
        cfg = parse_spec(name)
        assert cfg == parse_spec(spec) and str(cfg) == str(parse_spec(spec))  # logs record what actually ran
        assert parse_spec(str(cfg)) == cfg
    assert parse_spec("safe,warmup=100").warmup_steps == 100
    with pytest.raises(ValueError, match=r"'act' given twice in 'safe,act=int4' \(the preset 'safe' stands for"):
        parse_spec("safe,act=int4")
    with pytest.raises(ValueError, match=r"unknown operator 'safer'.*or a preset: safe, aggressive"):
        parse_spec("safer")
