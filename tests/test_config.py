"""RunConfig: YAML + dotted overrides, validation messages, round trip, resume diffs."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tape_train.config import (ConfigError, RunConfig, TrainConfig, diff_configs,
                               load_run_config, parse_override)

BASE = """\
model: tiny
train:
  run_dir: runs/x
  seq_len: 64
  lr: 3.0e-4
eval:
  interval: 10
"""


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_yaml_and_overrides_compose(tmp_path):
    cfg = load_run_config(_write(tmp_path, BASE),
                          ["model.pe=rope", "train.lr=3e-4", "train.max_steps=50",
                           "eval.lengths=[64,128]", "optim.betas=[0.9,0.95]"])
    assert cfg.model.pe == "rope" and cfg.model.hidden_size == 256  # tiny + override
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)  # "3e-4" is a YAML string
    assert cfg.train.max_steps == 50 and cfg.eval.lengths == [64, 128]
    assert cfg.optim.betas == [0.9, 0.95]
    assert cfg.data.tokenizer  # data section defaults


def test_model_mapping_with_base_and_field_overrides(tmp_path):
    cfg = load_run_config(_write(tmp_path, """\
        model: {base: tiny, num_layers: 2}
        """), ["model.hidden_size=64"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.vocab_size) == (2, 64, 8000)


def test_a_model_mapping_without_base_gives_the_whole_shape(tmp_path):
    """`model: {pe: rope}` (base forgotten) trained the fields' default 125M shape without a
    word: the section's line, the missing keys and the sizes to start from."""
    path = _write(tmp_path, "train: {seq_len: 8}\nmodel:\n  pe: rope\n  hidden_size: 64\n")
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value) == (
        f"{path}:2: 'model' without 'base' gives the whole shape itself; missing "
        f"model.vocab_size, model.num_layers, model.num_heads, model.intermediate_size (or "
        f"start from a size: base: one of 125m, 1b, 350m, 7b, tiny)")
    cfg = load_run_config(path, ["model.vocab_size=97", "model.num_layers=2",  # control
                                 "model.num_heads=4", "model.intermediate_size=96"])
    assert (cfg.model.hidden_size, cfg.model.pe) == (64, "rope")


def test_round_trip_through_dict_and_yaml(tmp_path):
    import yaml

    cfg = load_run_config(_write(tmp_path, BASE), ["model.pe=alibi"])
    again = RunConfig.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg
    assert "base" not in cfg.to_dict()["model"]  # the model is fully expanded


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    path = _write(tmp_path, BASE + "  max_step: 3\n")  # line 8, under eval
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    msg = str(err.value)
    assert f"{path}:8" in msg and "'eval.max_step'" in msg and "did you mean 'eval.max_tokens'" in msg


def test_unknown_override_key_is_named_with_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'train\.lrr=1'.*unknown key 'train\.lrr'"
                                          r" \(did you mean 'train\.lr'\?\)"):
        load_run_config(_write(tmp_path, BASE), ["train.lrr=1"])


@pytest.mark.parametrize("override, hint", [
    ("train.weight_decay=0.1", "(a key of section 'optim': optim.weight_decay)"),  # not 'decay'
    ("model.lr=1", "(a key of section 'train': train.lr)"),
    ("train.pe=rope", "(a key of section 'model': model.pe)"),
    ("lr=1", "(a key of section 'train': train.lr)"),  # a section key at the top level
])
def test_a_key_in_the_wrong_section_names_the_section_it_belongs_to(tmp_path, override, hint):
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, BASE), [override])
    key = override.split("=")[0]
    assert f"unknown key '{key}' {hint}" in str(err.value)
    assert "did you mean" not in str(err.value)


def test_unknown_section_and_nested_model_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'trian' \(did you mean 'train'\?\)"):
        load_run_config(_write(tmp_path, BASE), ["trian.lr=1"])
    with pytest.raises(ConfigError, match=r"'model\.hidden'.*did you mean 'model\.hidden_size'"):
        load_run_config(_write(tmp_path, BASE), ["model.hidden=3"])


@pytest.mark.parametrize("override, pattern", [
    ("train.dtype=bf15", r"train\.dtype: expected one of 'auto', 'bf16', 'fp32', got 'bf15' "
                         r"\(did you mean 'bf16'\?\)"),
    ("train.max_steps=abc", r"train\.max_steps: expected int, got 'abc'"),
    ("train.max_steps=0", r"train\.max_steps must be > 0"),
    ("train.lr=.inf", r"train\.lr: expected a finite number, got inf"),
    ("optim.eps=.nan", r"optim\.eps: expected a finite number, got nan"),
    ("optim.betas=[0.9, .inf]", r"optim\.betas: expected a list of a finite number"),
    ("train.micro_batch_size=true", r"train\.micro_batch_size: expected int, got True"),
    ("train.cuda_expandable_segments=maybe", r"train\.cuda_expandable_segments: expected "
                                             r"bool, got 'maybe'"),
    ("train.cuda_expandable_segments=1", r"train\.cuda_expandable_segments: expected bool, "
                                         r"got 1"),
    ("checkpoint.keep=1", r"checkpoint\.keep must be >= 2"),
    ("train.seed=-1", r"train\.seed must be in \[0, 4294967295\] \(2\*\*32 - 1\), got -1"),
    ("train.seed=18446744073709551616", r"train\.seed must be in \[0, 4294967295\]"),
    ("optim.betas=[0.9]", r"optim\.betas must be two numbers"),
    ("parallel.tp=0", r"parallel\.tp must be >= 1"),
    ("parallel.offload_optimizer=gpu", r"parallel\.offload_optimizer: expected one of 'none', "
                                       r"'cpu', got 'gpu' \(did you mean 'cpu'\?\)"),
    ("model.pe=ropee", r"model\.pe='ropee' is not one of .*did you mean 'rope'"),
    ("eval.lengths=[0]", r"eval\.lengths\[0\] must be a positive integer"),
    ("data.sharding=globl", r"data\.sharding='globl'.*did you mean 'global'"),
    ("train.collective_timeout_s=0", r"train\.collective_timeout_s must be > 0 and at most "
                                     r"31536000 seconds .*, got 0"),
    ("train.collective_timeout_s=10m", r"train\.collective_timeout_s: expected a finite number"),
    ("train.collective_timeout_s=3600", r"train\.collective_timeout_s=3600 must be <= "
                                        r"train\.startup_timeout_s=1800 .*: raise both"),
])
def test_invalid_values_name_the_key(tmp_path, override, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        load_run_config(_write(tmp_path, BASE), [override])
    assert f"override '{override}'" in str(err.value)


def test_every_seed_in_range_seeds_each_generator_the_run_derives():
    """train.seed's bounds are those the trainer's generators take: seeded at both ends, with
    the per-rank and per-sample offsets the run adds (a seed past them failed with a traceback
    after start-up: NumPy takes no negative seed, torch nothing past 64 bits)."""
    import numpy as np
    import torch

    from tape_train.config import MAX_SEED
    from tape_train.data.synthetic import synthetic_eval_documents, synthetic_sample
    from tape_train.train.loop import seed_everything

    for seed in (0, MAX_SEED):
        assert TrainConfig(seed=seed).seed == seed
        seed_everything(seed + 1_000_003 * 1023)         # rank 1023's stream
        np.random.default_rng([seed, 7, 1023])           # the data loaders' keys
        synthetic_sample(10**9, seed, 16, 8, 0.0)
        synthetic_eval_documents(16, 1, 8, seed)
    with pytest.raises(ValueError):                     # negative control: one past the range
        np.random.default_rng([-1])
    with pytest.raises((ValueError, RuntimeError)):
        torch.Generator().manual_seed(2**64)
    torch.manual_seed(0)


def test_a_run_dir_and_data_paths_under_home_are_expanded(tmp_path, monkeypatch):
    """`train.run_dir=~/runs/x`: no shell expands a `~` after `=` in an argument, and the run
    went into a directory named `~` under the current one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_run_config(_write(tmp_path, BASE), ["train.run_dir=~/runs/x"])
    assert cfg.train.run_dir == str(tmp_path / "home" / "runs" / "x")
    assert load_run_config(_write(tmp_path, BASE)).train.run_dir == "runs/x"  # control
    # The data paths and the tokenizer too (a YAML file or an override alike).
    cfg = load_run_config(_write(tmp_path, BASE), [
        "data.sources=[{path: ~/corpus}, {path: [~/a.jsonl, b.jsonl]}, {hub: c4}]",
        "data.eval_sources=[~/held]", "data.tokenizer=~/tok.model"])
    home = tmp_path / "home"
    assert [s.path for s in cfg.data.sources] == [str(home / "corpus"),
                                                  [str(home / "a.jsonl"), "b.jsonl"], None]
    assert cfg.data.sources[0].name == str(home / "corpus") and cfg.data.sources[2].hub == "c4"
    assert cfg.data.eval_sources[0].path == str(home / "held")
    assert cfg.data.tokenizer == str(home / "tok.model")


def test_bad_value_in_file_names_the_line(tmp_path):
    path = _write(tmp_path, BASE.replace("seq_len: 64", "seq_len: -4"))
    with pytest.raises(ConfigError, match=rf"{path}:4: train\.seq_len must be > 0"):
        load_run_config(path)


@pytest.mark.parametrize("text, line, message", [
    (BASE + "data:\n  sources: [x]\n  tokenizer: 5\n", 10, "data.tokenizer must be a path"),
    (BASE.replace("interval: 10", "interval: -3"), 7, "eval.interval must be an integer >= 0"),
], ids=["data", "eval"])
def test_bad_data_or_eval_value_names_the_file_once(tmp_path, text, line, message):
    """The data and eval sections validate themselves like the others: one location, the
    key's line, then the message (not the file a second time)."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value).startswith(f"{path}:{line}: {message}")
    assert str(err.value).count(str(path)) == 1
    key = message.split()[0]
    with pytest.raises(ConfigError) as err:      # from an override: the override, not the file
        load_run_config(_write(tmp_path, BASE), [f"{key}=-4"])
    assert str(err.value).startswith(f"override '{key}=-4': {key} ")
    assert str(tmp_path) not in str(err.value)


def test_a_bad_value_in_a_list_item_names_the_item_line(tmp_path):
    """An error inside `data.sources[1]` points at its own line, not at `sources:`; an
    override that replaced the list is blamed, not the file's lines it replaced."""
    text = BASE + ("data:\n  sources:\n    - path: a\n      weight: 1\n    - path: b\n"
                   "      weight: -1\n  tokenizer: x.model\n")
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value).startswith(f"{path}:13: data.sources[1].weight must be a finite")
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, text.replace("weight: -1", "pth: c")))
    assert str(err.value).startswith(f"{path}:12: data.sources[1]: unknown key(s) 'pth'")
    override = "data.sources=[{path: a}, {path: b, weight: 0}]"
    with pytest.raises(ConfigError) as err:
        load_run_config(_write(tmp_path, text), [override])
    assert str(err.value).startswith(f"override '{override}': data.sources[1].weight must")


@pytest.mark.parametrize("override", ["model.num_heads=5", "parallel.tp=3"])
def test_a_check_across_keys_blames_the_key_that_was_given(tmp_path, override):
    """`model.hidden_size (256) must be divisible by model.num_heads (5)` names the key of
    the base size first; the override that broke it was blamed as the file's `model:` line."""
    path = _write(tmp_path, BASE)
    with pytest.raises(ConfigError) as err:
        load_run_config(path, [override])
    assert str(err.value).startswith(f"override '{override}': ")
    # in the file: the line of the key given there, not the section's
    path = _write(tmp_path, BASE.replace("model: tiny", "model:\n  base: tiny\n  num_heads: 5"))
    with pytest.raises(ConfigError, match=rf"^{path}:3: model\.hidden_size \(256\) must be "
                                          rf"divisible by model\.num_heads \(5\)"):
        load_run_config(path)
    # control: a key the message names first and that was given keeps the blame
    with pytest.raises(ConfigError, match=r"^override 'model\.hidden_size=250': "):
        load_run_config(_write(tmp_path, BASE), ["model.hidden_size=250"])
    # both given, one in the file and one by an override: the override changed what held
    path = _write(tmp_path, BASE.replace("model: tiny", "model:\n  base: tiny\n  hidden_size: 256"))
    with pytest.raises(ConfigError, match=r"^override 'model\.num_heads=3': model\.hidden_size"):
        load_run_config(path, ["model.num_heads=3"])


def test_malformed_override_and_missing_file(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not of the form"):
        parse_override("train.lr")
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} is a directory"):
        load_run_config(tmp_path)  # it said "does not exist"
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)  # a bare name that is no shipped config: the directory is named,
    with pytest.raises(ConfigError, match=r"^config file runs is a directory"):  # not a missing
        load_run_config("runs")                                      # configs/train/runs.yaml
    assert load_run_config("demo").train.run_dir == "runs/demo"  # control: a name still finds it
    os.mkfifo(tmp_path / "pipe.yaml")  # what `--config <(...)` gives: every rank reads it
    for special in ("/dev/null", tmp_path / "pipe.yaml"):  # it said "does not exist" too
        with pytest.raises(ConfigError, match=f"config file {special} is not a regular file"):
            load_run_config(special)
    with pytest.raises(ConfigError, match="section 'model' is required"):
        load_run_config(_write(tmp_path, "train: {seq_len: 8}\n"))


def test_a_key_or_override_mistaken_for_the_other_gets_its_fix(tmp_path):
    """A dotted key in the YAML file, and a flow list the shell split at its space."""
    path = _write(tmp_path, "model: tiny\ntrain.lr: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: unknown key 'train\.lr' \(dotted keys are "
                                          r"for command-line overrides; in YAML write 'train:' "
                                          r"and 'lr:' indented under it\)"):
        load_run_config(path)
    with pytest.raises(ConfigError, match=r"override 'eval\.lengths=\[256,': value is not valid "
                                          r"YAML; the shell splits an unquoted override at its "
                                          r"spaces: quote the whole of it, e.g. "
                                          r"'eval\.lengths=\[256, \.\.\.\]'"):
        load_run_config(_write(tmp_path, BASE), ["eval.lengths=[256,", "512]"])
    with pytest.raises(ConfigError) as err:  # control: a list that is wrong, not split
        load_run_config(_write(tmp_path, BASE), ["eval.lengths=[256, 512"])
    assert "value is not valid YAML (" in str(err.value) and "shell" not in str(err.value)
    assert str(err.value).endswith("value is not valid YAML (expected ',' or ']', but got "
                                   "'<stream end>' (character 10, while parsing a flow "
                                   "sequence from character 1); close the bracket or brace)")
    with pytest.raises(ConfigError) as err:  # control: a misspelt key keeps did-you-mean
        load_run_config(_write(tmp_path, "model: tiny\ntrian: {lr: 1}\n"))
    assert "did you mean 'train'" in str(err.value)


def test_parse_override_values_are_yaml_scalars():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a.b=null") == (["a", "b"], None)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=rope") == (["a", "b"], "rope")


def test_parallel_layout_is_checked_against_the_model_before_any_process_group(tmp_path):
    import torch.distributed as dist

    path = _write(tmp_path, BASE)
    cfg = load_run_config(path, ["parallel.sp=2", "parallel.tp=2"])
    assert (cfg.parallel.sp, cfg.parallel.tp) == (2, 2)
    with pytest.raises(ConfigError, match=r"num_heads=\d+ is not divisible by parallel.tp × parallel.sp"):
        load_run_config(path, ["parallel.sp=4", "parallel.tp=4"])
    with pytest.raises(ConfigError, match="model.pe=alibi is not supported with parallel.sp=2"):
        load_run_config(path, ["parallel.sp=2", "model.pe=alibi"])
    with pytest.raises(ConfigError, match="train.seq_len=.* is not divisible by parallel.sp=3"):
        load_run_config(path, ["parallel.sp=3", "model.num_heads=6", "model.hidden_size=96"])
    assert not dist.is_initialized()


def protected_differences(diffs) -> list[str]:
    """The keys a resume must not change (the layout keys included: ``relayout.problems``
    rules on those)."""
    from tape_train.train.relayout import classify_changes

    changes = classify_changes(diffs)
    return [key for key, _, _ in changes.protected + changes.layout]


def test_diff_and_protected_keys(tmp_path):

    old = load_run_config(_write(tmp_path, BASE)).to_dict()
    new = load_run_config(_write(tmp_path, BASE), ["model.hidden_size=128", "train.lr=1e-3",
                                                   "model.attn_backend=eager",
                                                   "train.seq_len=128"]).to_dict()
    diffs = diff_configs(old, new)
    keys = {k for k, _, _ in diffs}
    assert {"model.hidden_size", "train.lr", "model.attn_backend", "train.seq_len"} <= keys
    assert sorted(protected_differences(diffs)) == ["model.hidden_size", "train.seq_len"]
    assert diff_configs(old, old) == []


def test_a_checkpoint_config_without_the_block_window_is_no_change(tmp_path):
    """A run config saved before data.block_shuffle_window existed does not count as changed
    (its loader state resumes the stream it was saved with: packing order); a saved value
    that differs is a protected change (negative control)."""
    from tape_train.train.relayout import classify_changes

    now = load_run_config(_write(tmp_path, BASE)).to_dict()
    old = json.loads(json.dumps(now))
    del old["data"]["block_shuffle_window"]
    changes = classify_changes(diff_configs(old, now))
    assert changes.protected == changes.applied == changes.layout == []
    old["data"]["block_shuffle_window"] = 1
    assert classify_changes(diff_configs(old, now)).protected == [
        ("data.block_shuffle_window", 1, now["data"]["block_shuffle_window"])]


def test_a_resume_may_move_the_data_but_not_change_it(tmp_path):
    """Where the data lies (a local source's path, its default label, the tokenizer file) is a
    `moved` change, which the resume data check rules on; what it is (a source added, a
    weight, a Hub dataset instead of files) stays protected, and a difference is named by
    the source's field, not as the whole `data.sources` list."""
    from tape_train.train.relayout import classify_changes

    path = _write(tmp_path, BASE)

    def changes(old: list[str], new: list[str]):
        return classify_changes(diff_configs(load_run_config(path, old).to_dict(),
                                             load_run_config(path, new).to_dict()))

    here = ["data.sources=[a/corpus]", "data.tokenizer=a/tok.model", "train.max_steps=4"]
    there = ["data.sources=[/scratch/corpus]", "data.tokenizer=/scratch/tok.model",
             "train.max_steps=6"]
    moved = changes(here, there)
    assert moved.moved == [("data.sources[0].path", "a/corpus", "/scratch/corpus"),
                           ("data.tokenizer", "a/tok.model", "/scratch/tok.model")]
    assert moved.applied == [("train.max_steps", 4, 6)]  # the label moved with the path
    assert moved.protected == moved.layout == []
    assert protected_differences(diff_configs(load_run_config(path, here).to_dict(),
                                              load_run_config(path, there).to_dict())) == []
    # A path list, and an explicit name changed (a label): still no protected change.
    listed = changes(["data.sources=[{path: [a/x, a/y], name: web}]"],
                     ["data.sources=[{path: [b/x, b/y], name: web2}]"])
    assert [k for k, _, _ in listed.moved] == ["data.sources[0].path"]
    assert listed.applied == [("data.sources[0].name", "web", "web2")]
    # Negative controls: what the data is.
    added = changes(here, ["data.sources=[a/corpus, b/more]", *here[1:]])
    (key, old, new), = added.protected  # the source added: one difference, the whole entry
    assert key == "data.sources[1]" and old == "<absent>" and new["path"] == "b/more"
    assert not added.moved and not added.applied
    weighted = changes(here, ["data.sources=[{path: a/corpus, weight: 2}]", *here[1:]])
    assert [k for k, _, _ in weighted.protected] == ["data.sources[0].weight"]
    hub = changes(here, ["data.sources=[{hub: a/corpus}]", *here[1:]])
    assert {"data.sources[0].hub", "data.sources[0].path"} <= {k for k, _, _ in hub.protected}
    assert not hub.moved
    # Held-out sources were always free to change; flattening them keeps them so.
    assert changes(here, [*here, "data.eval_sources=[b/held]"]).protected == []


def test_offload_needs_its_zero_stage_and_may_change_on_resume(tmp_path):
    path = _write(tmp_path, BASE)
    with pytest.raises(ConfigError, match=r"parallel\.offload_params=cpu needs "
                                          r"parallel\.zero_stage=3 .*got 2"):
        load_run_config(path, ["parallel.zero_stage=2", "parallel.offload_params=cpu"])
    with pytest.raises(ConfigError, match=r"parallel\.offload_optimizer=cpu needs "
                                          r"parallel\.zero_stage >= 1 .*got 0"):
        load_run_config(path, ["parallel.zero_stage=0", "parallel.offload_optimizer=cpu"])
    on = ["parallel.zero_stage=1", "parallel.offload_optimizer=cpu"]
    assert load_run_config(path, on).parallel.offload_optimizer == "cpu"
    diffs = diff_configs(load_run_config(path, on[:1]).to_dict(),
                         load_run_config(path, on).to_dict())
    assert [k for k, _, _ in diffs] == ["parallel.offload_optimizer"]
    assert protected_differences(diffs) == []  # a resume may turn it on or off
    diffs = diff_configs(load_run_config(path, on).to_dict(),
                         load_run_config(path, ["parallel.zero_stage=3", *on[1:]]).to_dict())
    assert protected_differences(diffs) == ["parallel.zero_stage"]  # negative control


def test_keys_a_checkpoint_predates_are_no_difference_at_their_defaults(tmp_path):
    """A checkpoint saved before a key existed (no `profile` section, no `train.lr` here)
    behaved as the default: resuming it with the defaults warns about nothing. Controls: a
    non-default value of such a key, and a key the new config lacks, still differ."""
    new = load_run_config(_write(tmp_path, BASE)).to_dict()
    old = {name: dict(section) for name, section in new.items()}
    del old["profile"], old["train"]["grad_accum_steps"]
    assert diff_configs(old, new) == []
    enabled = load_run_config(_write(tmp_path, BASE), ["profile.enabled=true"]).to_dict()
    assert diff_configs(old, enabled) == [("profile.enabled", "<absent>", True)]
    assert diff_configs(new, {k: v for k, v in new.items() if k != "logging"}) != []


PROFILED = BASE.replace("  lr: 3.0e-4\n", "  lr: 3.0e-4\n  max_steps: 10\n") + """\
profile:
  enabled: true
  start_step: 9
  active_steps: 3
"""


def test_a_profile_window_past_the_run_names_its_keys_and_line(tmp_path):
    path = _write(tmp_path, PROFILED)
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value) == (f"{path}:11: profile.start_step=9 with profile.active_steps=3 "
                              f"traces steps 9-11, beyond train.max_steps=10")
    assert load_run_config(path, ["train.max_steps=11"]).profile.start_step == 9  # fits
    # Off, the window is not checked: a short run need not touch the profile section.
    assert not load_run_config(path, ["profile.enabled=false"]).profile.enabled
    with pytest.raises(ConfigError, match=r"profile\.repeat=3 windows every profile\.interval"
                                          r"=5 steps end at step 21, beyond train\.max_steps=11"):
        load_run_config(path, ["train.max_steps=11", "profile.repeat=3", "profile.interval=5"])
    assert load_run_config(path, ["train.max_steps=11", "profile.repeat=0",
                                  "profile.interval=5"]).profile.repeat == 0  # until the end


@pytest.mark.parametrize("override, pattern", [
    ("profile.ranks=al", r"profile\.ranks: expected a list of int or one of 'all', got 'al'"),
    ("profile.ranks=[]", r"profile\.ranks must be a non-empty list of ranks >= 0 or 'all'"),
    ("profile.ranks=[-1]", r"profile\.ranks must be a non-empty list"),
    ("profile.warmup_steps=9", r"profile\.warmup_steps=9 must be < profile\.start_step=9"),
    ("profile.active_steps=0", r"profile\.active_steps must be > 0, got 0"),
    ("profile.interval=4", r"profile\.interval=4 is only used with profile\.repeat other than 1"),
    ("profile.repeat=2", r"profile\.repeat=2 needs profile\.interval .* >= "
                         r"profile\.warmup_steps \+ profile\.active_steps = 4, got None"),
    ("profile.trace=false", r"profile\.trace and profile\.memory_snapshot are both false"),
    ("profile.with_stacks=true", r"unknown key 'profile\.with_stacks' \(did you mean "
                                 r"'profile\.with_stack'\?\)"),
])
def test_bad_profile_values_name_the_key(tmp_path, override, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        load_run_config(_write(tmp_path, PROFILED), ["train.max_steps=20", override])
    assert f"override '{override}'" in str(err.value)


def test_profile_ranks_outside_the_world_fail_the_preflight(tmp_path):
    from tape_train.train.preflight import run_preflight

    def preflight(ranks, world):
        cfg = load_run_config(_write(tmp_path, PROFILED), [
            "train.max_steps=20", "train.synthetic_data=true", "train.device=cpu",
            f"train.run_dir={tmp_path / 'run'}", f"profile.ranks={ranks}"])
        return run_preflight(cfg, world_size=world, check_resume=False, plan=False)

    report = preflight("[0,3]", 2)
    assert report.problems == ["profile.ranks=[0, 3]: rank 3 is outside a world of 2 rank(s) "
                               "(0-1)"]
    report = preflight("[0,3]", 4)                       # negative control: it fits
    assert report.problems == []
    assert f"profiling: on (profile.enabled), steps 9-11 after 1 warm-up step(s), on rank 0, 3" \
        in report.lines
    assert any(line.endswith("(Chrome trace JSON: ui.perfetto.dev, chrome://tracing)")
               and f"{tmp_path / 'run'}/profile/step_9/rank0.pt.trace.json" in line
               for line in report.lines)
    assert preflight("all", 2).problems == []
    # More windows: the warm-up belongs to each window, said before the repetition.
    cfg = load_run_config(_write(tmp_path, PROFILED), [
        "train.max_steps=20", "train.synthetic_data=true", "train.device=cpu",
        f"train.run_dir={tmp_path / 'run'}", "profile.repeat=0", "profile.interval=5"])
    assert ("profiling: on (profile.enabled), steps 9-11 after 1 warm-up step(s), then every 5 "
            "steps until the run ends, on rank 0") in run_preflight(
                cfg, world_size=1, check_resume=False, plan=False).lines


def test_a_shorter_run_than_its_warm_up_says_which_keys_fix_it():
    """`train.max_steps=8` on the demo recipe (warm-up 30 steps): the message says to override
    the warm-up too, and the overrides it suggests are accepted."""
    with pytest.raises(ConfigError) as err:
        load_run_config("demo", ["train.max_steps=8"])
    message = str(err.value)
    assert "train.warmup_steps must be in [0, train.max_steps=8], got 30" in message
    assert "train.warmup_steps=0" in message and "train.warmup_steps=null" in message
    assert load_run_config("demo", ["train.max_steps=8", "train.warmup_steps=0"]).train.max_steps == 8
    cfg = load_run_config("demo", ["train.max_steps=8", "train.warmup_steps=null"])
    assert cfg.train.warmup_steps is None and 0 <= cfg.train.resolved_warmup_steps <= 8


def test_a_refused_resume_lists_only_the_changes_it_refuses(tmp_path):
    """A resume that changes model.pe (refused) and train.lr (applied) is refused naming
    model.pe with both values; train.lr is not in the refusal (listing every difference made
    it read as refused too)."""
    import types

    from tape_train.train import checkpoint as ckpt
    from tape_train.train.loop import Trainer

    saved = load_run_config(_write(tmp_path, BASE), ["model.pe=rope"]).to_dict()
    now = load_run_config(_write(tmp_path, BASE), ["model.pe=tape", "train.lr=1e-3"])

    def check(cfg):
        from tape_train.parallel import RankGrid

        trainer = types.SimpleNamespace(cfg=cfg, grid=RankGrid.from_sizes(1), _relayout=None,
                                        allow_config_change=False, rank=0,
                                        _resume_data_fits=None)
        Trainer._check_config(trainer, {"config": saved, "step": 3, "zero_stage": 3,
                                        "world_size": 1}, tmp_path / "step_3")

    with pytest.raises(ckpt.CheckpointError) as err:
        check(now)
    message = str(err.value)
    assert "these config changes would corrupt the run: model.pe: 'rope' -> 'tape'" in message
    assert "train.lr" not in message, message
    # negative control: with only the harmless change it resumes (no error)
    check(load_run_config(_write(tmp_path, BASE), ["model.pe=rope", "train.lr=1e-3"]))
