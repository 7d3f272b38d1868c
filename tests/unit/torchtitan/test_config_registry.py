"""`--config NAME` under `--module pp_compress.torchtitan`: torchtitan's own configs with a pp_compress section."""
import pytest

pytest.importorskip("torchtitan", reason="torchtitan runs in make test's second environment (.venv-torch-next)")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from pp_compress.torchtitan import CompressedTrainer, PPCompress, config_registry  # noqa: E402


def test_every_torchtitan_config_comes_with_a_pp_compress_section():
    config = config_registry.llama3_debugmodel()
    assert type(config) is CompressedTrainer.Config and config.pp_compress == PPCompress()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    stock = llama3_debugmodel()  # every stock field is there, with its stock value
    assert config.training == stock.training and config.parallelism == stock.parallelism
    assert config.model_spec.name == "llama3" and config.model_spec.flavor == stock.model_spec.flavor
    assert config_registry.deepseek_v3_debugmodel().model_spec.name == "deepseek_v3"  # a model of two words


def test_unknown_names_are_attribute_errors_and_the_listing_names_what_is_on_offer():
    for name in ("llama3_nonexistent", "nonexistent", "_private", "__path__"):
        with pytest.raises(AttributeError):
            getattr(config_registry, name)
    assert {"llama3_debugmodel", "qwen3_debugmodel"} <= set(dir(config_registry))


def test_torchtitans_command_line_sets_the_section(tmp_path):
    cfg = ConfigManager().parse_args(["--module", "pp_compress.torchtitan", "--config", "llama3_debugmodel",
                                      "--pp_compress.compression", "act=int8,grad=int4:stoch",
                                      "--hf_assets_path", str(tmp_path)])
    assert str(cfg.pp_compress.resolve()) == "act=int8,grad=int4:stoch"


def test_a_config_with_a_trainer_of_its_own_is_refused():
    from dataclasses import dataclass

    @dataclass(kw_only=True, slots=True)
    class Other(Trainer.Config):
        pass

    with pytest.raises(TypeError, match="wraps configs of torchtitan's Trainer; this one is a .*Other"):
        CompressedTrainer.Config.of(Other())
