"""tape-submit and the batch-script rendering, without a cluster (fast).

The rendered scripts are checked against sbatch on the local cluster in test_slurm_cluster.py;
here: option validation, the #SBATCH header for CPU and GPU jobs, that rendering replaces only
the two marked blocks of launch/slurm/*.sbatch (the body exists once), and tape-submit's
error messages.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tape_train.cluster import submit
from tape_train.cluster.render import (
    HEADER_BEGIN,
    SETTINGS_BEGIN,
    SETTINGS_END,
    ClusterOptions,
    RenderError,
    default_template_dir,
    eval_header,
    parse_time_limit,
    render_eval_script,
    render_train_script,
    replace_blocks,
    train_header,
)

TEMPLATES = default_template_dir()


def train_template() -> str:
    return (TEMPLATES / "train.sbatch").read_text()


def strip_blocks(script: str) -> list[str]:
    """The script without its header and settings blocks: what rendering must not touch."""
    out, skipping = [], False
    for line in script.splitlines():
        if line.startswith("# >>> "):
            skipping = True
        elif line.startswith("# <<< "):
            skipping = False
        elif not skipping:
            out.append(line)
    return out


def sbatch_lines(script: str) -> list[str]:
    return [ln[len("#SBATCH "):] for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def run_submit(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = submit.main(args)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("text,seconds", [
    ("90", 5400), ("10:30", 630), ("04:00:00", 14400), ("2-00", 172800),
    ("1-12:30", 131400), ("1-00:00:05", 86405),
    # As Slurm's time_str2secs() reads them: a day count alone, fields past their usual range.
    ("1-", 86400), ("99:99", 99 * 60 + 99), ("0:90:00", 5400), (" 90 ", 5400),
    ("35791393", 35791393 * 60),                       # the largest whole minutes sbatch holds
])
def test_parse_time_limit_accepts_slurm_formats(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "4h", "1:2:3:4", "-5", "1-2:", ":30", "1-:30",
                                  "1-2-3", "1 - 2", "1.5", "-2-00", "\u0661\u0662"])
def test_parse_time_limit_rejects_other_text_naming_the_option(text):
    with pytest.raises(RenderError, match=f"--time {text!r} is not a Slurm time limit"):
        parse_time_limit(text)


@pytest.mark.parametrize("text", ["0", "00:00:00", "0-0", "UNLIMITED", "infinite", "-1",
                                  " unlimited "])
def test_no_time_limit_is_refused_because_no_warning_would_come(text):
    """Slurm takes 0, -1, INFINITE and UNLIMITED for no time limit: the USR1 warning before
    the end, on which the trainer checkpoints, would then never be sent."""
    with pytest.raises(RenderError, match=rf"--time {text!r} .*no time limit.*never sends "
                                          r"the USR1 warning"):
        parse_time_limit(text)


@pytest.mark.parametrize("text", ["99999999", "35791394", "24855-03:14:08", "2147483647:0"])
def test_a_time_limit_sbatch_would_wrap_around_is_refused(text):
    """sbatch adds the seconds up in a C int (then 59 to round up to minutes): 99999999
    minutes became a limit of 19734-04:11:00, unseen. 35791394 minutes is the first whole
    minute past 2^31 - 1 - 59 s."""
    with pytest.raises(RenderError, match=rf"--time {text!r} is \d+ s, more than sbatch can "
                                          r"hold \(2147483588 s"):
        parse_time_limit(text)


def test_a_time_limit_with_spaces_around_it_is_rendered_without_them():
    """`--time " 90"` rendered `#SBATCH --time= 90`, which sbatch refuses (not a time)."""
    opts = ClusterOptions(time=" 90\t")
    assert "#SBATCH --time=90" in train_header(opts)
    assert "#SBATCH --time=30" in eval_header(opts, " 30 ")


def test_the_largest_signal_grace_sbatch_takes_is_accepted():
    # control for the refusal of 65536 below
    assert "#SBATCH --signal=B:USR1@65535" in train_header(
        ClusterOptions(time="2-00:00:00", signal_grace=65535))


@pytest.mark.parametrize("kwargs,match", [
    (dict(nodes=0), "--nodes"),
    (dict(gpus_per_node=-1), "--gpus-per-node"),
    (dict(time="00:05:00", signal_grace=300), "--signal-grace 300 s must be shorter"),
    # sbatch's --signal holds the time in 16 bits and refuses more (0xffff).
    (dict(time="2-00:00:00", signal_grace=65536), r"--signal-grace 65536 s is more than "
                                                   r"sbatch's --signal takes \(65535 s"),
    (dict(gpus_per_node=4, procs_per_node=2), "--procs-per-node 2 is for CPU nodes"),
    (dict(job_name="my job"), "--job-name"),
    (dict(partition="gpu debug"), "--partition"),
    # A trailing line break (`$` in a regex lets one through): a blank line in the header.
    (dict(partition="gpu\n"), "--partition 'gpu\\\\n' contains characters"),
    (dict(job_name="train\n"), "--job-name"),
    (dict(gpus_per_node=8, gpu_type="a100\n"), "a GPU type needs"),
    (dict(socket_ifname="eth0\n"), "--socket-ifname"),
    (dict(train_module="tape_train.train\n"), "--train-module"),
    # Empty (an unset variable): said so, not "contains characters sbatch cannot take".
    (dict(partition=""), r"--partition '' is empty \(an unset shell variable\?\): name the "
                         r"partition, or leave --partition out for the cluster's default"),
    (dict(account=" "), r"--account ' ' is empty"),
    (dict(qos=""), r"--qos '' is empty"),
    (dict(log_dir='my "logs"'), "a double quote, a backslash or a line break"),
    (dict(workdir="/home/a\\b"), "a double quote, a backslash or a line break"),
    (dict(train_module="tape_train/train"), "--train-module"),
    (dict(extra_sbatch=["constraint=a100"]), "--sbatch-arg"),
    (dict(extra_sbatch=["--time=10"]), r"--sbatch-arg '--time=10': --time is set by --time; "
                                       r"a second #SBATCH line would override it unchecked"),
    (dict(extra_sbatch=["--signal=B:USR1@5"]), r"--signal is set by --signal-grace"),
    # These undo a rendered line: more tasks than nodes (two torchruns per node), no requeue.
    (dict(extra_sbatch=["--ntasks=8"]), r"--ntasks is set by the script \(one task per node"),
    (dict(extra_sbatch=["--no-requeue"]), r"--no-requeue is set by the script \(it requeues"),
    # GPUs asked for past --gpus-per-node: trainers on some of them (cuda:0 alone without it).
    (dict(extra_sbatch=["--gres=gpu:a100:8"]), r"--sbatch-arg '--gres=gpu:a100:8' asks for "
                                              r"GPUs: give them with --gpus-per-node N"),
    (dict(gpus_per_node=8, extra_sbatch=["--gpus=16"]), "'--gpus=16' asks for GPUs"),
    (dict(gpus_per_node=8, extra_sbatch=["--gpus-per-task=1"]), "asks for GPUs"),
    (dict(extra_sbatch=["--tres-per-task=gres/gpu:1"]), "asks for GPUs"),
    (dict(extra_sbatch=["--gres=nvme:1,gpu:2"]), "asks for GPUs"),
    (dict(gpu_type="a100"), "a GPU type needs a number of GPUs >= 1"),
    (dict(gpus_per_node=8, gpu_type="a 100"), "a GPU type needs"),
    (dict(max_restarts=-1), "--max-restarts must be an integer >= 0"),
    (dict(min_free_gb=float("inf")), "--min-free-gb must be a finite number >= 0, got inf"),
    (dict(min_free_gb=float("nan")), "--min-free-gb must be a finite number >= 0, got nan"),
    (dict(python=""), "--python is empty"),
])
def test_cluster_options_reject_bad_values_naming_them(kwargs, match):
    with pytest.raises(RenderError, match=match):
        ClusterOptions(**kwargs)


@pytest.mark.parametrize("arg,full,by", [
    ("--sig=B:USR1@5", "signal", "--signal-grace"), ("--no-req", "no-requeue", "the script"),
    ("--outp=x.log", "output", "--log-dir"), ("--ch=/x", "chdir", "the directory"),
    ("--tasks-per-node=2", "ntasks-per-node", "the script"),      # an alias of it
    ("--tasks-per=2", "ntasks-per-node", "the script"),
    ("--job=x", "job-name", "--job-name"), ("--part=gpu", "partition", "--partition"),
])
def test_an_abbreviated_sbatch_arg_is_the_option_it_abbreviates(arg, full, by):
    """sbatch reads its options with getopt_long, which takes an unambiguous prefix of a long
    option for the option: `--sig=B:USR1@5` replaced the rendered --signal unseen."""
    with pytest.raises(RenderError, match=rf"--sbatch-arg '{re.escape(arg)}': "
                                          rf"--{re.escape(arg[2:].split('=')[0])} \(sbatch "
                                          rf"reads it as --{full}\) is set by {by}"):
        ClusterOptions(extra_sbatch=[arg])


def test_an_abbreviation_of_gpu_options_is_one_too():
    with pytest.raises(RenderError, match=r"'--gpus-per-t=1' \(sbatch reads --gpus-per-t as "
                                          r"--gpus-per-task\) asks for GPUs"):
        ClusterOptions(extra_sbatch=["--gpus-per-t=1"])
    with pytest.raises(RenderError, match=r"\(sbatch reads --tres-per-t as --tres-per-task\)"):
        ClusterOptions(extra_sbatch=["--tres-per-t=gres/gpu:1"])


@pytest.mark.parametrize("arg,candidates", [
    ("--o=x", "--oom-kill-step, --open-mode, --output, --overcommit, --oversubscribe"),
    ("--node=2", "--nodefile, --nodelist, --nodes"),
    ("--res=r1", "--reservation, --resources, --resv-ports"),
    ("--ti=10", "--time, --time-min"),
])
def test_an_ambiguous_abbreviation_is_refused_naming_the_candidates(arg, candidates):
    with pytest.raises(RenderError, match=rf"--sbatch-arg '{re.escape(arg)}': "
                                          rf"--{arg[2:].split('=')[0]} is ambiguous, an "
                                          rf"abbreviation of {candidates} "):
        ClusterOptions(extra_sbatch=[arg])


@pytest.mark.parametrize("arg", [
    "--constraint=a100", "--constr=a100", "--exclusive", "--mem=0", "--time-min=30",
    "--nodelist=n1", "--gpu-bind=closest", "--my-spank-option=1",  # a SPANK plugin's: sbatch's
])
def test_options_tape_submit_does_not_render_pass_in_full_or_abbreviated(arg):
    """Control: an exact name wins over a longer one it is a prefix of (--time-min, not
    --time; --nodelist); names sbatch does not know are left to sbatch."""
    assert f"#SBATCH {arg}" in train_header(ClusterOptions(extra_sbatch=[arg]))


@pytest.mark.parametrize("arg,full", [("--comment", "--comment"), ("--mail-user", "--mail-user"),
                                      ("--dep", "--dep (sbatch reads it as --dependency)"),
                                      ("--constraint", "--constraint")])
def test_an_sbatch_arg_that_takes_a_value_needs_it_attached(arg, full):
    """sbatch gathers the arguments of all #SBATCH lines and reads them as one command line:
    `#SBATCH --comment` followed by `#SBATCH --exclusive` gave the job the comment
    `--exclusive` and no --exclusive (measured, 22.05), the next --sbatch-arg lost unseen."""
    with pytest.raises(RenderError, match=re.escape(f"--sbatch-arg {arg!r}: {full} takes a "
                                                    f"value, attached with '=' ({arg}=VALUE)")):
        ClusterOptions(extra_sbatch=[arg, "--exclusive"])
    # Control: with a value (an empty one too), and the options that take none or an
    # optional one attached only, nothing is swallowed.
    for args in ([f"{arg}=x", "--exclusive"], [f"{arg}=", "--exclusive"],
                 ["--exclusive", "--hold", "--contiguous", "--get-user-env", "--no-kill"]):
        ClusterOptions(extra_sbatch=args)


def test_a_time_min_no_longer_than_the_signal_grace_is_refused():
    """--time-min lets Slurm lower the job's time limit down to it to start the job sooner;
    the USR1 warning comes --signal-grace before the limit Slurm set, so a --time-min of 5
    (minutes) with the default grace of 300 s would warn at the very start, every requeue."""
    for arg in ("--time-min=5", "--time-m=4:00", "--time-min=00:05:00"):
        with pytest.raises(RenderError, match=re.escape(f"--sbatch-arg {arg!r}: Slurm may "
                                                        f"lower the time limit to")):
            ClusterOptions(extra_sbatch=[arg])
    # Control: longer than the grace, or with a shorter grace, it passes.
    ClusterOptions(extra_sbatch=["--time-min=6"])
    ClusterOptions(extra_sbatch=["--time-min=5"], signal_grace=120)


def test_sbatch_arg_values_with_spaces_or_a_hash_are_quoted():
    """sbatch ends an #SBATCH value at whitespace and takes an unquoted '#' for a comment:
    `--comment=run #2` gave the job Comment=run. Double-quoted, sbatch keeps both (and a
    single quote, which would otherwise open a quotation of its own)."""
    header = train_header(ClusterOptions(extra_sbatch=[
        "--comment=run #2", "--mail-user=a b@x", "--comment=it's", "--constraint=a100|h100",
        "--comment=plain"]))
    assert '#SBATCH --comment="run #2"' in header
    assert '#SBATCH --mail-user="a b@x"' in header
    assert '#SBATCH --comment="it\'s"' in header
    assert '#SBATCH --constraint="a100|h100"' in header
    assert "#SBATCH --comment=plain" in header              # control: plain values stay bare


@pytest.mark.parametrize("arg,match", [
    ('--comment=say "hi"', "the value contains a double quote, a backslash or a line break"),
    ("--comment=a\\b", "the value contains a double quote"),
    ("--comment=a\nb", "the value contains a double quote"),
    ("--comment run", "the option name 'comment run' contains whitespace"),
    ("--comm\tent=x", "the option name .* contains whitespace"),
    ("--=x", "'' is not an option name"),
    ("--com#ment=x", "'com#ment' is not an option name"),
])
def test_sbatch_args_an_sbatch_line_cannot_hold_are_refused(arg, match):
    with pytest.raises(RenderError, match=re.escape(f"--sbatch-arg {arg!r}: ") + match):
        ClusterOptions(extra_sbatch=[arg])


def test_paths_with_spaces_or_a_hash_are_quoted_in_the_header():
    """sbatch ends an #SBATCH value at whitespace and takes an unquoted '#' for a comment:
    `--chdir=/data/proj#2` ran the job in /data/proj (measured, Slurm 22.05). Such paths are
    double-quoted (tested with the real sbatch in test_slurm_cluster.py); '%' in the log
    directory is doubled, as Slurm's filename pattern wants it."""
    opts = ClusterOptions(workdir="/data/my proj#2", log_dir="/data/my proj#2/logs 100%")
    for header in (train_header(opts), eval_header(opts, "01:00:00")):
        assert '#SBATCH --chdir="/data/my proj#2"' in header
        assert '#SBATCH --output="/data/my proj#2/logs 100%%/%x-%j.out"' in header
    plain = train_header(ClusterOptions(workdir="/data/p", log_dir="/data/p/logs"))
    assert "#SBATCH --chdir=/data/p" in plain               # control: plain paths stay bare
    assert "#SBATCH --output=/data/p/logs/%x-%j.out" in plain


def test_short_signal_grace_warns_about_slurms_30s_granularity():
    with pytest.warns(UserWarning, match="30 s late"):
        ClusterOptions(signal_grace=30)


def test_tape_submit_prints_the_warning_as_one_line_of_its_own(tmp_path, monkeypatch, capsys):
    from tape_train.cluster import submit

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("model: tiny\n")
    for grace, warned in (("30", True), ("120", False)):     # 120 s: the negative control
        assert submit.main(["--config", "run.yaml", "--signal-grace", grace, "--dry-run",
                            "--no-preflight"]) == 0
        err = capsys.readouterr().err
        assert ("tape-submit: warning: --signal-grace 30 s: Slurm may deliver USR1 up to 30 s "
                "late" in err) is warned
        assert "UserWarning" not in err


def test_cpu_render_header_settings_and_untouched_body():
    opts = ClusterOptions(nodes=1, procs_per_node=2, cpus_per_task=4, time="00:30:00",
                          log_dir="/logs", workdir="/work", python="/venv/bin/python",
                          socket_ifname="lo", signal_grace=120)
    script = render_train_script(train_template(), opts,
                                 ["--config", "configs/train/demo.yaml", "train.lr=3e-4",
                                  "train.run_dir=runs/it's here"])
    header = sbatch_lines(script)
    assert header == [
        "--job-name=tape-train", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=4",
        "--time=00:30:00", "--signal=B:USR1@120", "--requeue", "--open-mode=append",
        "--output=/logs/%x-%j.out", "--chdir=/work"]
    assert not any(ln.startswith("--gpus") for ln in header)
    # Arguments are shell-quoted: the one with a quote and a space survives as one word.
    assert ("TRAIN_ARGS=(--config configs/train/demo.yaml train.lr=3e-4 "
            "'train.run_dir=runs/it'\"'\"'s here')") in script
    for line in ("TAPE_PYTHON=/venv/bin/python", "TAPE_GPUS_PER_NODE=0",
                 "TAPE_PROCS_PER_NODE=2", "TAPE_SOCKET_IFNAME=lo", "TAPE_SIGNAL_GRACE=120",
                 "TAPE_TRAIN_MODULE=tape_train.train.cli", "TAPE_MAX_RESTARTS=3"):
        assert f"\n{line}\n" in script
    # The body is the template's, line for line: one source of truth.
    assert strip_blocks(script) == strip_blocks(train_template())
    # Rendering a rendered script again gives the same script (markers are kept).
    assert render_train_script(script, opts, ["--config", "configs/train/demo.yaml",
                                              "train.lr=3e-4", "train.run_dir=runs/it's here"]
                               ) == script


def test_gpu_render_four_nodes_with_placement_options():
    opts = ClusterOptions(nodes=4, gpus_per_node=8, cpus_per_task=64, time="2-00:00:00",
                          partition="gpu", account="proj42", qos="high", job_name="big",
                          extra_sbatch=["--constraint=a100", "--exclusive"])
    script = render_train_script(train_template(), opts, ["--config", "x.yaml"])
    header = sbatch_lines(script)
    for line in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu",
                 "--account=proj42", "--qos=high", "--job-name=big", "--time=2-00:00:00",
                 "--constraint=a100", "--exclusive", "--requeue", "--signal=B:USR1@300"):
        assert line in header, line
    assert "\nTAPE_GPUS_PER_NODE=8\n" in script and "\nTAPE_PROCS_PER_NODE=8\n" in script
    assert opts.world_size == 32


def test_gpus_of_a_gres_type_are_asked_for_as_slurm_takes_them(tmp_path, monkeypatch):
    """Clusters with typed GPU GRES want `--gpus-per-node=a100:8`: tape-submit takes that form
    (one trainer per GPU, 8) and renders it for training and evaluation; other GRES (a disk)
    still go through --sbatch-arg."""
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    rc, out, err = run_submit(["--config", str(config), "--nodes", "2", "--gpus-per-node",
                               "a100:8", "--sbatch-arg=--gres=nvme:1,gpumem:2", "--eval-after",
                               "--dry-run", "--no-preflight"])
    assert rc == 0, err
    train, _, evaluation = out.partition(submit.EVAL_SEPARATOR)
    for script in (train, evaluation):
        assert "#SBATCH --gpus-per-node=a100:8\n" in script and "\nTAPE_GPUS_PER_NODE=8\n" in script
    assert "#SBATCH --gres=nvme:1,gpumem:2\n" in train and "\nTAPE_PROCS_PER_NODE=8\n" in train
    err = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(err):
        submit.main(["--config", str(config), "--gpus-per-node", "a100:", "--dry-run"])
    assert exited.value.code == 2 and "argument --gpus-per-node: 'a100:' is not a number of " \
        "GPUs (8) or a GRES type and a number (a100:8)" in err.getvalue(), err.getvalue()
    rc, out, err = run_submit(["--config", str(config), "--gpus-per-node", "-1", "--dry-run"])
    assert rc == 1 and "--gpus-per-node must be an integer >= 0, got -1" in err, err


def test_eval_render_one_task_with_a_nodes_gpus_and_arguments():
    opts = ClusterOptions(nodes=4, gpus_per_node=8, partition="gpu", job_name="big")
    script = render_eval_script((TEMPLATES / "eval.sbatch").read_text(), opts,
                                ["--checkpoint", "/runs/a", "--out", "/runs/a/eval",
                                 "--lengths", "256", "512"], time="00:20:00")
    header = sbatch_lines(script)
    for line in ("--job-name=big-eval", "--nodes=1", "--ntasks=1", "--gpus-per-node=8",
                 "--partition=gpu", "--time=00:20:00"):
        assert line in header, line
    assert "EVAL_ARGS=(--checkpoint /runs/a --out /runs/a/eval --lengths 256 512)" in script
    assert "\nTAPE_GPUS_PER_NODE=8\n" in script          # torchrun --nproc_per_node=8
    assert strip_blocks(script) == strip_blocks((TEMPLATES / "eval.sbatch").read_text())
    cpu = render_eval_script((TEMPLATES / "eval.sbatch").read_text(), ClusterOptions(),
                             ["--checkpoint", "/runs/a"])
    assert "--gpus-per-node" not in "".join(sbatch_lines(cpu))
    assert "\nTAPE_GPUS_PER_NODE=0\n" in cpu                       # 1 process


def test_missing_marker_is_an_error_naming_the_template():
    broken = train_template().replace(SETTINGS_END, "# settings end")
    with pytest.raises(RenderError, match=r"my\.sbatch: expected one '# >>> run settings'"):
        render_train_script(broken, ClusterOptions(), ["--config", "x"], source="my.sbatch")
    doubled = train_template().replace(HEADER_BEGIN, HEADER_BEGIN + "\n" + HEADER_BEGIN, 1)
    with pytest.raises(RenderError, match="found 2 and 1"):
        render_train_script(doubled, ClusterOptions(), ["--config", "x"])


SCRIPTS = sorted(p.name for p in TEMPLATES.glob("*.sbatch"))


def test_every_script_is_checked_here():
    assert SCRIPTS == ["eval.sbatch", "prepare.sbatch", "train.sbatch"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("name", SCRIPTS)
def test_templates_are_valid_bash(name):
    proc = subprocess.run(["bash", "-n", str(TEMPLATES / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_share_the_conventions(name):
    """One marked header and settings block each (what rendering replaces), requeueable jobs
    appending to one log per job, the interpreter from TAPE_PYTHON, log lines naming the script,
    job and restart, and a refusal outside Slurm."""
    text = (TEMPLATES / name).read_text()
    header = sbatch_lines(text)
    # Re-rendering the blocks with their own contents gives the script back: the markers are
    # where replace_blocks expects them, and every #SBATCH line is inside the header block.
    lines = text.splitlines()
    settings = lines[lines.index(next(ln for ln in lines if ln.startswith(SETTINGS_BEGIN))) + 1:
                     lines.index(next(ln for ln in lines if ln.startswith(SETTINGS_END)))]
    assert replace_blocks(text, name, [f"#SBATCH {ln}" for ln in header], settings) == text
    for line in ("--requeue", "--open-mode=append", "--output=logs/slurm/%x-%j.out"):
        assert line in header, (name, line)
    assert "--nodes=1" in header or name == "train.sbatch"
    assert 'TAPE_PYTHON=${TAPE_PYTHON:-python3}' in text
    assert (f'log() {{ echo "[{name} $(date -u +%Y-%m-%dT%H:%M:%SZ) job=${{SLURM_JOB_ID:-?}} '
            "restart=") in text
    assert f'echo "{name}: not inside a Slurm job; submit it with sbatch' in text
    assert "ERROR: no arguments" in text or "ERROR: no training arguments" in text


def test_prepare_script_warns_before_the_time_limit():
    header = sbatch_lines((TEMPLATES / "prepare.sbatch").read_text())
    signal = [ln for ln in header if ln.startswith("--signal=")]
    assert signal == ["--signal=B:USR1@90"]
    # The warning must come with room to spare: slurmctld checks deadlines every 30 s.
    seconds = int(signal[0].split("@")[1])
    limit = parse_time_limit(next(ln for ln in header if ln.startswith("--time="))[7:])
    assert 60 <= seconds < limit


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\ntrain:\n  run_dir: runs/exp1\n")
    return path


def test_tape_submit_dry_run_prints_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    rc, out, err = run_submit(["--config", str(config), "train.max_steps=7", "--nodes", "2",
                               "--time", "01:00:00", "--sbatch-arg=--exclusive",
                               "--eval-after", "--eval-lengths", "128", "256",
                               "--eval-arg=--max-tokens=512", "--max-restarts", "0", "--dry-run",
                               "--no-preflight"])
    assert rc == 0, err
    assert "\nTAPE_MAX_RESTARTS=0\n" in out
    train, _, evaluation = out.partition(submit.EVAL_SEPARATOR)
    assert train.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2\n" in train and "#SBATCH --job-name=tape-run\n" in train
    assert "#SBATCH --exclusive\n" in train
    assert f"#SBATCH --chdir={tmp_path}\n" in train
    assert f"#SBATCH --output={tmp_path}/logs/slurm/%x-%j.out\n" in train
    assert f"TRAIN_ARGS=(--config {config} train.max_steps=7)" in train
    run_dir = tmp_path / "runs" / "exp1"
    assert (f"EVAL_ARGS=(--checkpoint {run_dir} --out {run_dir}/eval --lengths 128 256 "
            "--max-tokens=512)" in evaluation)
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("extra,match", [
    (["train.no_such_key=1"], "train.no_such_key"),
    (["--time", "4h"], "--time '4h'"),
    (["--nodes", "0"], "--nodes must be an integer >= 1"),
    (["--max-restarts", "-2"], "--max-restarts must be an integer >= 0"),
    (["--time", "UNLIMITED"], "--time 'UNLIMITED' means no time limit to Slurm"),
    (["--time", "99999999"], "--time '99999999' is 5999999940 s, more than sbatch can hold"),
    (["--eval-after", "--eval-time", "0"], "--eval-time '0' is zero"),
    (["--time", "2-00", "--signal-grace", "70000"], "--signal-grace 70000 s is more than"),
    (["--sbatch-arg=--sig=B:USR1@5"], "--sig (sbatch reads it as --signal) is set by"),
    (["--sbatch-arg=--node=2"], "--node is ambiguous, an abbreviation of --nodefile, "),
    (["--partition", ""], "--partition '' is empty"),
])
def test_tape_submit_rejects_bad_config_or_options_before_submitting(tmp_path, monkeypatch,
                                                                     extra, match):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path)
    rc, out, err = run_submit(["--config", str(config), *extra, "--dry-run"])
    assert rc == 1 and out == ""
    assert match in err
    # one line, before the preflight (which would say "preflight for ...")
    assert err.count("\n") == 1 and err.startswith("tape-submit: error: "), err


def test_tape_submit_without_sbatch_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    config = write_config(tmp_path)
    rc, out, err = run_submit(["--config", str(config)])
    assert rc == 1 and "sbatch not found on PATH" in err


# ---------------------------------------------------------------------------------------------
# Submitting against stand-ins for sbatch, scontrol and squeue (the real ones: test_slurm_cluster)
# ---------------------------------------------------------------------------------------------
FAKE_SBATCH = r"""#!/bin/bash
echo "sbatch $*" >> "$FAKE_DIR/calls"
env | grep '^SBATCH_' | sort > "$FAKE_DIR/sbatch_env"
if [[ $1 == --test-only ]]; then   # FAKE_NO_NODE_FITS: no node has what the job asks for
    [[ -z ${FAKE_NO_NODE_FITS:-} ]] || {
        echo "allocation failure: Requested node configuration is not available" >&2; exit 1; }
    echo "sbatch: Job 99 to start at 2026-01-01T00:00:00 using 16 processors on nodes n[1-2]" >&2
    exit 0
fi
if [[ -n ${FAKE_SBATCH_FAIL:-} && " $* " == *"$FAKE_SBATCH_FAIL"* ]]; then
    echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2
    exit 1
fi
n=$(( $(cat "$FAKE_DIR/next_id" 2>/dev/null || echo 40) + 1 ))
echo "$n" > "$FAKE_DIR/next_id"
[[ -n ${FAKE_SBATCH_BANNER:-} ]] && echo "$FAKE_SBATCH_BANNER"
echo "$n${FAKE_SBATCH_CLUSTER:+;$FAKE_SBATCH_CLUSTER}"
"""
FAKE_SCONTROL = r"""#!/bin/bash
[[ "$*" == "show partition --oneliner"* && -n ${FAKE_PARTITIONS:-} ]] || exit 1
printf '%s\n' "$FAKE_PARTITIONS"
"""
FAKE_SQUEUE = r"""#!/bin/bash
[[ " $* " == *" --name="* ]] && printf '%s' "${FAKE_QUEUE:-}"
exit 0
"""
PARTITION = ("PartitionName={name} AllowGroups=ALL Default={default} MaxNodes={max_nodes} "
             "MaxTime={max_time} MinNodes=0 Nodes=n[1-4] State=UP TotalCPUs=8 TotalNodes=4")


@pytest.fixture
def slurm_client(tmp_path, monkeypatch):
    """sbatch/scontrol/squeue stand-ins first on PATH, driven by FAKE_* variables; returns the
    file their calls are recorded in."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL),
                       ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    for name in ("FAKE_SBATCH_FAIL", "FAKE_PARTITIONS", "FAKE_QUEUE", "SBATCH_PARTITION",
                 "FAKE_SBATCH_BANNER", "FAKE_SBATCH_CLUSTER", "FAKE_NO_NODE_FITS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "calls"


def submit_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--config", str(write_config(tmp_path)), "--nodes", "2", "--time", "01:00:00",
            "--log-dir", "logs/slurm", "--no-preflight", *extra]


def test_a_refused_submission_leaves_no_script_or_log_directory(tmp_path, slurm_client,
                                                                monkeypatch):
    monkeypatch.setenv("FAKE_SBATCH_FAIL", ".train.sbatch")
    rc, out, err = run_submit(submit_args(tmp_path, "--partition", "nope"))
    assert rc == 1 and out == ""
    assert "Invalid partition name specified\ntape-submit: nothing was submitted\n" in err
    assert not (tmp_path / "logs").exists()   # it was created for the script, and removed
    # A log directory that was there already stays, with what it held; only our script goes.
    (tmp_path / "logs" / "slurm").mkdir(parents=True)
    (tmp_path / "logs" / "slurm" / "old-7.out").write_text("an earlier job's log\n")
    rc, out, err = run_submit(submit_args(tmp_path))
    assert rc == 1
    assert [p.name for p in (tmp_path / "logs" / "slurm").iterdir()] == ["old-7.out"]
    # Negative control: an accepted job keeps its rendered script next to its log.
    monkeypatch.delenv("FAKE_SBATCH_FAIL")
    rc, out, err = run_submit(submit_args(tmp_path))
    assert rc == 0 and out == "41\n", err
    assert len(list((tmp_path / "logs" / "slurm").glob("tape-run.*.train.sbatch"))) == 1


def test_a_job_no_node_can_hold_is_refused_before_it_is_queued(tmp_path, slurm_client,
                                                               monkeypatch):
    """--cpus-per-task 64 where no node has 64 CPUs (nor the partition in all: a 1-node
    partition of 48): sbatch queued it and it pended for ever (PartitionConfig; measured on
    22.05, where `sbatch --test-only` refuses it). Now nothing is queued, no script or log
    directory is left; a job that fits is submitted after the same question (the control)."""
    monkeypatch.setenv("FAKE_NO_NODE_FITS", "1")
    rc, out, err = run_submit(submit_args(tmp_path, "--cpus-per-task", "64", "--gpus-per-node",
                                          "a100:8"))
    assert rc == 1 and out == "", err
    assert ("tape-submit: error: sbatch --test-only: allocation failure: Requested node "
            "configuration is not available: no node of the partition has what each node of "
            "this job asks for (--cpus-per-task 64, --gpus-per-node a100:8, and any "
            "--sbatch-arg") in err, err
    assert "nothing was submitted" in err and not (tmp_path / "logs").exists()
    assert [c.split()[1] for c in slurm_client.read_text().splitlines()] == ["--test-only"]
    # The dry run asks too (where sbatch is): the script is printed, exit 1.
    rc, out, err = run_submit(submit_args(tmp_path, "--cpus-per-task", "64", "--dry-run"))
    assert rc == 1 and out.startswith("#!/bin/bash\n"), err
    assert "no node of the partition has what each node of this job asks for (--cpus-per-task " \
        "64, and any --sbatch-arg" in err and "a submit would refuse this job" in err, err
    assert "to submit the script by hand" not in err
    slurm_client.unlink()
    monkeypatch.delenv("FAKE_NO_NODE_FITS")
    rc, out, err = run_submit(submit_args(tmp_path))
    assert rc == 0 and out == "41\n", err
    assert [c.split()[1] for c in slurm_client.read_text().splitlines()] == [
        "--test-only", "--parsable"]


def test_the_job_id_is_read_from_the_last_line_of_sbatch_parsable(tmp_path, slurm_client,
                                                                  monkeypatch):
    """`sbatch --parsable` prints `<id>;<cluster>` on a multi-cluster setup, and a site's sbatch
    wrapper may print a line of its own first: the job is queued either way, and its id is
    the last line's first field (a banner line first used to read as "no job id", and
    tape-submit said nothing was submitted about a queued job)."""
    monkeypatch.setenv("FAKE_SBATCH_BANNER", "Submitting to the gpu partition (site wrapper)")
    monkeypatch.setenv("FAKE_SBATCH_CLUSTER", "tapetest")
    rc, out, err = run_submit(submit_args(tmp_path, "--eval-after"))
    assert rc == 0 and out == "41\n42\n", err
    assert "--dependency=afterok:41 " in slurm_client.read_text()


def test_an_array_job_says_each_task_has_a_log_of_its_own(tmp_path, slurm_client):
    """`%j` in the log's name is each array task's own job id: with --array=0-1 submitted as
    job 10, task 0 logged to <name>-11.out and task 1 to <name>-10.out (measured), so the
    array's id names one task's log, not the first's. Without --array: that one log."""
    rc, out, err = run_submit(submit_args(tmp_path, "--sbatch-arg=--array=0-1"))
    assert rc == 0 and out == "41\n", err
    assert (f"logs {tmp_path}/logs/slurm/tape-run-<job id>.out, one per array task (its own "
            f"job id: squeue -r --jobs=41 --format='%i %A')") in err, err
    rc, out, err = run_submit(submit_args(tmp_path, "--sbatch-arg=--arr=0-1"))  # abbreviated
    assert "one per array task" in err, err
    rc, out, err = run_submit(submit_args(tmp_path))
    assert f", log {tmp_path}/logs/slurm/tape-run-43.out" in err, err


def test_a_refused_evaluation_says_the_training_is_queued_and_how_to_chain_it(
        tmp_path, slurm_client, monkeypatch):
    monkeypatch.setenv("FAKE_SBATCH_FAIL", "--dependency=afterok:41")
    rc, out, err = run_submit(submit_args(tmp_path, "--eval-after"))
    assert rc == 1 and out == "41\n", err
    (eval_file,) = (tmp_path / "logs" / "slurm").glob("tape-run.*.eval.sbatch")
    assert (f"training job 41 is queued without its evaluation; once the cause is fixed, chain "
            f"it by hand: sbatch --dependency=afterok:41 --kill-on-invalid-dep=yes {eval_file} "
            f"(or `scancel 41`)") in err


def test_a_job_the_partition_would_never_start_is_refused_before_anything_is_written(
        tmp_path, slurm_client, monkeypatch):
    monkeypatch.setenv("FAKE_PARTITIONS", "\n".join([
        PARTITION.format(name="debug", default="YES", max_nodes="UNLIMITED",
                         max_time="00:30:00"),
        PARTITION.format(name="long", default="NO", max_nodes="2", max_time="2-00:00:00")]))
    cases = [
        (["--time", "00:45:00"], "--time 00:45:00 is longer than partition debug's "
                                 "MaxTime=00:30:00: Slurm would keep the job pending "
                                 "(PartitionTimeLimit) and never start it"),
        (["--time", "00:20:00", "--nodes", "5"], "--nodes 5 is more than partition debug gives "
                                                 "one job (TotalNodes=4)"),
        (["--partition", "long", "--nodes", "3"], "--nodes 3 is more than partition long gives "
                                                  "one job (MaxNodes=2)"),
        (["--time", "00:20:00", "--eval-after", "--eval-time", "02:00:00"],
         "--eval-time 02:00:00 is longer than partition debug's MaxTime=00:30:00"),
    ]
    for extra, message in cases:
        rc, out, err = run_submit(submit_args(tmp_path, *extra))
        assert rc == 1 and out == "", err
        assert message in err and "--ignore-partition-limits" in err, err
        assert not (tmp_path / "logs").exists() and not slurm_client.exists()
    monkeypatch.setenv("SBATCH_PARTITION", "long")   # sbatch's own default partition
    rc, out, err = run_submit(submit_args(tmp_path, "--nodes", "3"))
    assert rc == 1 and "partition long gives one job (MaxNodes=2)" in err
    monkeypatch.delenv("SBATCH_PARTITION")
    # Negative controls: within the limits, or a partition scontrol does not show (sbatch
    # names it then), or no answer from scontrol: submitted.
    for extra in (["--time", "00:30:00", "--nodes", "4"],
                  ["--partition", "long", "--time", "1-00:00:00", "--nodes", "2"],
                  ["--partition", "other", "--time", "9-00:00:00"]):
        rc, out, err = run_submit(submit_args(tmp_path, *extra))
        assert rc == 0 and out.strip().isdigit(), (extra, err)
    # Where a QOS lifts the partition's limits, the user says so.
    rc, out, err = run_submit(submit_args(tmp_path, "--time", "00:45:00",
                                          "--ignore-partition-limits"))
    assert rc == 0 and out.strip().isdigit(), err
    monkeypatch.delenv("FAKE_PARTITIONS")
    rc, out, err = run_submit(submit_args(tmp_path, "--time", "9-00:00:00", "--nodes", "9"))
    assert rc == 0, err


def test_a_second_job_for_a_queued_or_running_run_is_warned_about(tmp_path, slurm_client,
                                                                  monkeypatch):
    import os
    import socket

    from tape_train.train.run_lock import LOCK_NAME

    monkeypatch.setenv("FAKE_QUEUE", "41 PENDING\n")
    rc, out, err = run_submit(submit_args(tmp_path))
    assert rc == 0 and out == "41\n", err
    assert ("tape-submit: warning: you already have job(s) named tape-run in the queue: "
            "41 (PENDING); if one trains the same run dir") in err
    # A dependency on purpose (to run after it) is not warned about.
    rc, out, err = run_submit(submit_args(tmp_path, "--sbatch-arg=--dependency=afterany:41"))
    assert rc == 0 and "warning" not in err, err
    # ... nor one written as sbatch also takes it, abbreviated (getopt_long).
    rc, out, err = run_submit(submit_args(tmp_path, "--sbatch-arg=--dep=afterany:41"))
    assert rc == 0 and "warning" not in err, err
    # A run holding the run directory now (here: a live process on this host).
    monkeypatch.setenv("FAKE_QUEUE", "")
    run_dir = tmp_path / "runs" / "exp1"
    run_dir.mkdir(parents=True)
    (run_dir / LOCK_NAME).write_text(
        f'{{"host": "{socket.gethostname()}", "pid": {os.getppid()}, '
        f'"started": "2026-01-01T00:00:00Z"}}')
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run"))
    assert rc == 0, err
    assert (f"tape-submit: warning: run directory {run_dir} is in use by another run") in err
    assert "(this job, if it starts before that run ends, fails its start-up checks)" in err
    # Negative control: nothing queued, no lock: no warning.
    (run_dir / LOCK_NAME).unlink()
    rc, out, err = run_submit(submit_args(tmp_path))
    assert rc == 0 and "warning" not in err, err


def test_dry_run_says_how_to_submit_the_script_by_hand(tmp_path, slurm_client):
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run"))
    assert rc == 0 and out.startswith("#!/bin/bash\n")
    assert (f"tape-submit: dry run, nothing submitted; to submit the script by hand: mkdir -p "
            f"{tmp_path}/logs/slurm && sbatch <file>\n") in err
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run", "--eval-after"))
    assert "is a second file: sbatch --dependency=afterok:<training job id>" in err
    # sbatch was only asked whether a node can hold the job (--test-only), nothing queued.
    assert not (tmp_path / "logs").exists()
    assert {c.split()[1] for c in slurm_client.read_text().splitlines()} == {"--test-only"}


def test_an_interpreter_missing_here_is_warned_about(tmp_path, slurm_client):
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run", "--python", "/no/venv/bin/python"))
    assert rc == 0
    assert ("tape-submit: warning: --python /no/venv/bin/python: no such interpreter here; every "
            "node needs it at that path") in err
    # One that runs but lacks the package (here: a stand-in Python that finds nothing).
    no_package = tmp_path / "bare-python"
    no_package.write_text("#!/bin/bash\nexit 1\n")
    no_package.chmod(0o755)
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run", "--python", str(no_package)))
    assert rc == 0
    assert (f"tape-submit: warning: --python {no_package} cannot import tape_train here") in err
    # Negative control: this interpreter (it has tape_train).
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run", "--python", sys.executable))
    assert "warning" not in err, err


def test_sbatch_input_variables_do_not_override_the_rendered_script(tmp_path, slurm_client,
                                                                     monkeypatch):
    """An SBATCH_* variable of the user's shell outranks the script's #SBATCH line (Slurm:
    command line > environment > script): one standing for a rendered option is not passed to
    sbatch, and said; one for an option not rendered (no --partition given) still applies.
    The dry run warns that a by-hand sbatch would be overridden."""
    env_file = tmp_path / "sbatch_env"
    monkeypatch.setenv("SBATCH_TIMELIMIT", "7-00:00:00")
    monkeypatch.setenv("SBATCH_SIGNAL", "B:USR1@10")
    monkeypatch.setenv("SBATCH_PARTITION", "site-default")
    monkeypatch.setenv("SBATCH_WCKEY", "mine")     # no --wckey rendered: passed on
    rc, out, err = run_submit(submit_args(tmp_path, "--eval-after"))
    assert rc == 0 and len(out.split()) == 2, err
    assert ("tape-submit: SBATCH_TIMELIMIT=7-00:00:00 is set here: not passed to sbatch, where "
            "it would override the script's #SBATCH --time") in err
    assert "SBATCH_SIGNAL=B:USR1@10 is set here" in err and "SBATCH_PARTITION" not in err
    assert env_file.read_text() == "SBATCH_PARTITION=site-default\nSBATCH_WCKEY=mine\n"
    # --partition rendered: the variable goes too.
    rc, out, err = run_submit(submit_args(tmp_path, "--partition", "gpu"))
    assert rc == 0 and "SBATCH_PARTITION=site-default is set here" in err, err
    assert env_file.read_text() == "SBATCH_WCKEY=mine\n"
    # An --sbatch-arg abbreviated as sbatch takes it (--wck: --wckey) is that option too.
    rc, out, err = run_submit(submit_args(tmp_path, "--sbatch-arg=--wck=w1"))
    assert rc == 0 and "SBATCH_WCKEY=mine is set here: not passed to sbatch" in err, err
    assert env_file.read_text() == "SBATCH_PARTITION=site-default\n"
    rc, out, err = run_submit(submit_args(tmp_path, "--dry-run"))
    assert rc == 0 and out.startswith("#!/bin/bash"), err
    assert ("tape-submit: warning: SBATCH_TIMELIMIT=7-00:00:00 in this environment overrides "
            "the script's #SBATCH --time when you sbatch it by hand") in err
    # Negative control: none set, nothing said, and sbatch gets no SBATCH_* variable.
    for var in ("SBATCH_TIMELIMIT", "SBATCH_SIGNAL", "SBATCH_PARTITION", "SBATCH_WCKEY"):
        monkeypatch.delenv(var)
    rc, out, err = run_submit(submit_args(tmp_path))
    assert rc == 0 and "SBATCH_" not in err and env_file.read_text() == "", err


MINIMAL_SLURM_CONF = """ClusterName=probe
SlurmctldHost=localhost
SlurmctldPort=1
MessageTimeout=1
TCPTimeout=1
AuthType=auth/munge
AuthInfo=socket=/nonexistent/munge.socket
NodeName=n1 CPUs=1
PartitionName=p Nodes=n1 Default=YES
"""


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs sbatch (slurm-client)")
def test_sbatch_itself_reads_the_rendered_header_as_intended(tmp_path):
    """sbatch's own reading of a rendered header, without a cluster: a slurm.conf naming a
    controller on a closed port (and no munge) lets it parse the script (`sbatch -vvvv` logs
    each argument it found in an #SBATCH line and the options it set) and then fail to
    submit. Measured with
    22.05: unquoted, `--comment=run #2` was read as `--comment=run`; quoted it stays whole.
    The time limit with spaces around it is rendered without them (` 90`: Invalid --time)."""
    args = ["--comment=run #2", "--mail-user=a b@x", "--comment=it's", "--constraint=a|b"]
    header = train_header(ClusterOptions(time=" 90 ", extra_sbatch=args,
                                         workdir=str(tmp_path), log_dir=str(tmp_path)))
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n" + "\n".join(header) + "\ntrue\n")
    (tmp_path / "slurm.conf").write_text(MINIMAL_SLURM_CONF)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))}
    proc = subprocess.run(["sbatch", "-vvvv", str(script)], capture_output=True, text=True,
                          env={**env, "SLURM_CONF": str(tmp_path / "slurm.conf")}, timeout=60)
    found = re.findall(r'Found in script, argument "(.*)"', proc.stderr)
    assert found, proc.stderr
    assert "Invalid" not in proc.stderr, proc.stderr
    for arg in args + ["--time=90"]:
        assert arg in found, (arg, found)


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs sbatch (slurm-client)")
def test_sbatch_itself_takes_the_next_line_for_a_missing_value(tmp_path):
    """What the check on a value-less --sbatch-arg rests on: sbatch reads `--comment` and a
    next `--exclusive` line as the comment `--exclusive`."""
    (tmp_path / "slurm.conf").write_text(MINIMAL_SLURM_CONF)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))}
    env["SLURM_CONF"] = str(tmp_path / "slurm.conf")
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --comment\n#SBATCH --exclusive\ntrue\n")
    said = subprocess.run(["sbatch", "-vvvv", str(script)], capture_output=True, text=True,
                          env=env, timeout=60).stderr
    assert re.search(r"comment +: --exclusive", said), said


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs sbatch (slurm-client)")
def test_sbatch_itself_takes_an_abbreviation_for_the_option(tmp_path):
    """What the --sbatch-arg checks rest on: sbatch reads `--sig=` in an #SBATCH line as
    --signal (the one option it abbreviates), and refuses `--node=` (several)."""
    (tmp_path / "slurm.conf").write_text(MINIMAL_SLURM_CONF)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))}
    env["SLURM_CONF"] = str(tmp_path / "slurm.conf")
    said = {}
    for arg in ("--sig=B:USR1@7", "--node=2"):
        script = tmp_path / "job.sbatch"
        script.write_text(f"#!/bin/bash\n#SBATCH {arg}\ntrue\n")
        said[arg] = subprocess.run(["sbatch", "-vvvv", str(script)], capture_output=True,
                                   text=True, env=env, timeout=60).stderr
    assert re.search(r"signal +: B:USR1@7", said["--sig=B:USR1@7"]), said
    assert "'--node=2' is ambiguous" in said["--node=2"], said
    with pytest.raises(RenderError, match="--sig \\(sbatch reads it as --signal\\)"):
        ClusterOptions(extra_sbatch=["--sig=B:USR1@7"])
    with pytest.raises(RenderError, match="--node is ambiguous"):
        ClusterOptions(extra_sbatch=["--node=2"])
