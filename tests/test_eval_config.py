"""EvalConfig: defaults, length resolution, and errors that name the key at fault."""

from __future__ import annotations

import pytest

from tape_train.eval.config import EvalConfig


def test_defaults_resolve_to_multiples_of_the_training_length():
    cfg = EvalConfig()
    assert not cfg.enabled and cfg.protocols == ["nonoverlap", "sliding"]
    assert cfg.resolve_lengths(256) == [256, 512, 1024, 2048]
    assert cfg.resolve_stride(512) == 256
    explicit = EvalConfig.from_dict({"interval": 10, "lengths": [64, 128], "sliding_stride": 16,
                                     "protocols": "sliding", "max_tokens": None})
    assert explicit.enabled and explicit.resolve_lengths(256) == [64, 128]
    assert explicit.protocols == ["sliding"] and explicit.resolve_stride(128) == 16
    assert EvalConfig.from_dict(explicit.to_dict()) == explicit


@pytest.mark.parametrize("data,message", [
    ({"lenghts": [1]}, r"'eval\.lenghts' \(did you mean 'eval\.lengths'\?\)"),
    ({"max_token": 5}, r"'eval\.max_token' \(did you mean 'eval\.max_tokens'\?\)"),
    ({"interval": -1}, r"eval\.interval must be an integer >= 0, got -1"),
    ({"lengths": [128, 0]}, r"eval\.lengths\[1\] must be a positive integer, got 0"),
    ({"lengths": [128, 128]}, r"eval\.lengths has duplicates: \[128\]"),
    ({"lengths": []}, r"eval\.lengths is empty"),
    ({"lengths": "128"}, r"eval\.lengths must be a list"),
    ({"protocols": ["slidng"]}, r"eval\.protocols\[0\]='slidng'.*did you mean 'sliding'"),
    ({"batch_size": 0}, r"eval\.batch_size must be a positive integer"),
    ({"max_tokens": 1.5}, r"eval\.max_tokens must be a positive integer"),
    ({"lengths": [64, 256], "sliding_stride": 64}, r"eval\.sliding_stride=64 must be smaller"),
])
def test_errors_name_the_key(data, message):
    with pytest.raises(ValueError, match=message) as err:
        EvalConfig.from_dict(data, source="run.yaml")
    assert str(err.value).startswith("run.yaml: ")


def test_a_command_line_names_its_options_and_the_config_its_keys():
    """tape-eval passes ``name``; the run config (the default) keeps ``eval.<key>``."""
    from tape_train.eval.settings import option_name

    flags = dict(lengths=[64, 0], name=option_name)
    with pytest.raises(ValueError, match=r"^--lengths \(value 2\) must be a positive integer"):
        EvalConfig(**flags)
    with pytest.raises(ValueError, match=r"^eval\.lengths\[1\] must be a positive integer"):
        EvalConfig(lengths=[64, 0])                                  # the negative control
    with pytest.raises(ValueError, match=r"^--stride=64 must be smaller"):
        EvalConfig(lengths=[64], sliding_stride=64, name=option_name)
    cfg = EvalConfig(sliding_stride=300, name=option_name)
    with pytest.raises(ValueError, match=r"^--stride=300 must be smaller.*length 256"):
        cfg.resolve_lengths(256, option_name)
    assert option_name("interval") == "eval.interval"               # no such option
    # ``name`` is no setting: not stored, not in the dict, refused in a config file.
    assert "name" not in cfg.to_dict() and EvalConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown key.*'eval\.name'"):
        EvalConfig.from_dict({"name": "x"}, source="run.yaml")


def test_stride_checked_against_resolved_default_lengths():
    cfg = EvalConfig(sliding_stride=300)           # fine until the lengths are known
    assert cfg.resolve_lengths(512) == [512, 1024, 2048, 4096]
    with pytest.raises(ValueError, match="sliding_stride=300 must be smaller.*length 256"):
        cfg.resolve_lengths(256)
