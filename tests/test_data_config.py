"""DataConfig: defaults, from_dict with did-you-mean errors, validation naming data.<field>."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tape_train.data import DataConfig, DataError, SourceConfig, load_data_config

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "data"


def test_default_is_the_demo_and_round_trips():
    cfg = DataConfig()
    assert cfg.sources[0].path == "data/demo" and cfg.tokenizer.endswith(".model")
    again = DataConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert DataConfig.from_dict(dataclasses.asdict(cfg)) == cfg  # asdict output is accepted


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_configs_load(name):
    cfg = load_data_config(name)
    assert all(isinstance(s, SourceConfig) for s in cfg.sources)


@pytest.mark.parametrize("data, match", [
    ({"shufle_buffer": 4}, r"data: unknown key\(s\) 'shufle_buffer' \(did you mean 'shuffle_buffer'\?\)"),
    ({"sources": [{"pth": "x"}]}, r"data.sources\[0\]: unknown key\(s\) 'pth' \(did you mean 'path'\?\)"),
    ({"sources": [{"path": "x", "weight": 0}]}, r"data.sources\[0\].weight must be a finite number > 0"),
    ({"sources": ["y", {"path": "x", "weight": float("inf")}]},
     r"data.sources\[1\].weight must be a finite number > 0, got inf"),
    ({"sources": [{"path": "x", "hub": "c4"}]}, r"data.sources\[0\]: set exactly one of"),
    ({"sources": []}, r"data.sources must be a non-empty list"),
    ({"sources": [{"path": "x", "data_files": "*.json"}]}, r"data.sources\[0\].data_files needs 'hub'"),
    ({"shuffle_buffer": 0}, r"data.shuffle_buffer must be a positive integer"),
    ({"prefetch": -1}, r"data.prefetch must be an integer >= 0"),
    ({"eval_fraction": 1.0}, r"data.eval_fraction must be in \[0, 1\)"),
    ({"sharding": "globl"}, r"data.sharding='globl' is not one of .*did you mean 'global'"),
    ({"add_bos": "yes"}, r"data.add_bos must be true or false"),
    ({"eval_sources": [{"path": "x", "text_feild": "t"}]},
     r"data.eval_sources\[0\]: unknown key\(s\) 'text_feild' \(did you mean 'text_field'\?\)"),
])
def test_bad_values_name_the_key(data, match):
    with pytest.raises(DataError, match=match) as info:
        DataConfig.from_dict(data, source="run.yaml")
    assert str(info.value).startswith("run.yaml: ")


def test_bare_string_source_is_a_path():
    cfg = DataConfig(sources=["a/*.jsonl", {"hub": "allenai/c4", "config": "en"}])
    assert cfg.sources[0].path == "a/*.jsonl" and cfg.sources[1].hub == "allenai/c4"


def test_unknown_named_config():
    with pytest.raises(DataError, match="named data configs: .*demo"):
        load_data_config("no-such-config")
