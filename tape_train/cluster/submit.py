"""`tape-submit`: render launch/slurm/train.sbatch for a run config and submit it with sbatch.

    tape-submit --config configs/train/<recipe>.yaml [key=value ...] \\
        --nodes 4 --gpus-per-node 8 --partition gpu --account proj --time 2-00:00:00 \\
        [--eval-after] [--dry-run]

The config and overrides are checked with the project's config loader before anything is
queued, and passed to tape-train unchanged. Then `tape-train --dry-run` runs here for the
job's layout (data, tokenizer, resume on this node count, memory: the preflight, its plan and
problems on stderr; `--no-preflight` skips it). `--dry-run` runs that preflight too, prints the
rendered script on stdout (with `--eval-after` the evaluation script follows after a separator
line) and submits nothing; sbatch need not be installed. The script is printed even when the
preflight found a problem, but the exit code is then 1, as a submit would refuse the job.
Without `--dry-run` a preflight problem refuses the job (exit 1, nothing queued); otherwise
the rendered scripts are kept next to the logs (`<log-dir>/<job-name>.<time>.*.sbatch`),
the training job is submitted, and its id is printed on stdout (the evaluation job's id on a
second line with `--eval-after`); progress messages go to stderr.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

from tape_train.cluster.render import (
    ClusterOptions,
    RenderError,
    default_template_dir,
    parse_gpus_per_node,
    parse_time_limit,
    read_template,
    render_eval_script,
    render_train_script,
    sbatch_arg_option,
)
from tape_train.cluster.run_args import TrainArgsError, resolve_run_dir
from tape_train.cluster.sbatch_options import AmbiguousOption, sbatch_long_option
from tape_train.files import write_atomic
from tape_train.hints import example_on_missing

EVAL_TIME = "01:00:00"
EVAL_SEPARATOR = "# ---- eval.sbatch, submitted with --dependency=afterok:<training job id> ----"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tape-submit",
        description="Render launch/slurm/train.sbatch for a run config and submit it.",
        epilog="Overrides (dotted key=value) after the options are passed to tape-train.")
    p.add_argument("--config", required=True,
                   help="run config YAML, or the name of a shipped one (demo, 125m: "
                        "configs/train/<name>.yaml), passed to tape-train unchanged")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, e.g. train.max_steps=1000")
    g = p.add_argument_group("allocation")
    g.add_argument("--nodes", type=int, default=1, help="nodes, one torchrun each (default: 1)")
    g.add_argument("--gpus-per-node", type=_gpus_per_node, default=(None, 0),
                   metavar="[TYPE:]N", help="GPUs per node, with their GRES type where the "
                   "cluster wants one (a100:8); 0 (default) runs on CPU nodes with gloo")
    g.add_argument("--procs-per-node", type=int, default=1,
                   help="CPU nodes only: trainer processes per node (default: %(default)s)")
    g.add_argument("--cpus-per-task", type=int, default=8,
                   help="CPUs per node for that node's trainer processes (default: %(default)s)")
    g.add_argument("--time", default="04:00:00",
                   help="time limit, e.g. 90, 04:00:00, 2-00:00:00 (default: %(default)s)")
    g.add_argument("--partition", help="#SBATCH --partition (default: the cluster's)")
    g.add_argument("--account", help="#SBATCH --account (default: the cluster's)")
    g.add_argument("--qos", help="#SBATCH --qos (default: the cluster's)")
    g.add_argument("--job-name", help="default: tape-<config file stem>")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="=--OPTION=VALUE",
                   help="extra sbatch option, one #SBATCH line each (repeatable); write it "
                        "attached: --sbatch-arg=--constraint=a100")
    r = p.add_argument_group("run behaviour")
    r.add_argument("--signal-grace", type=int, default=300,
                   help="seconds before the time limit at which the job checkpoints (USR1; "
                        "default: %(default)s)")
    r.add_argument("--log-dir", default="logs/slurm",
                   help="per-job logs and rendered scripts (default: %(default)s)")
    r.add_argument("--socket-ifname", default="",
                   help="network interface for gloo/NCCL (e.g. ib0); lo for one-machine tests")
    r.add_argument("--python", default=sys.executable,
                   help="interpreter on the nodes (default: the one running tape-submit)")
    r.add_argument("--min-free-gb", type=float, default=10.0,
                   help="preflight: free disk required in the run directory (GB; default: "
                        "%(default)g)")
    r.add_argument("--max-requeues", type=int, default=100,
                   help="stop requeueing after this many restarts (default: %(default)s)")
    r.add_argument("--max-stalled-requeues", type=int, default=3,
                   help="stop requeueing after this many restarts in a row that added no "
                        "checkpoint (0: no limit; default: %(default)s)")
    r.add_argument("--max-restarts", type=int, default=3,
                   help="restart the workers of every node in the job after a rank crashed or "
                        "hung, resuming from the newest checkpoint, up to this many times; "
                        "after the first, only if the attempt before saved a new checkpoint "
                        "(0: a crash ends the job; default: %(default)s)")
    r.add_argument("--train-module", default="tape_train.train.cli",
                   help="module torchrun runs with -m (default: the trainer)")
    r.add_argument("--template-dir", type=Path, default=None,
                   help="directory holding train.sbatch and eval.sbatch (default: launch/slurm)")
    e = p.add_argument_group("evaluation after training")
    e.add_argument("--eval-after", action="store_true",
                   help="also submit eval.sbatch with --dependency=afterok:<training job>")
    e.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                   help="context lengths for tape-eval (default: the run's eval.lengths, "
                        "else L, 2L, 4L, 8L of train.seq_len, as tape-eval takes them)")
    e.add_argument("--eval-out", default=None, help="default: <run_dir>/eval")
    e.add_argument("--eval-time", default=EVAL_TIME,
                   help="time limit of the evaluation job (default: %(default)s)")
    e.add_argument("--eval-arg", action="append", default=[], metavar="=--OPTION=VALUE",
                   help="extra tape-eval argument (repeatable), attached: "
                        "--eval-arg=--max-tokens=8192")
    p.add_argument("--dry-run", action="store_true",
                   help="run the preflight, print the script(s), submit nothing (exit 1 if the "
                        "preflight found a problem)")
    f = p.add_argument_group("preflight (before sbatch, and with --dry-run)")
    f.add_argument("--no-preflight", action="store_true",
                   help="skip `tape-train --dry-run` for the target layout: submit (or print "
                        "the script) without it")
    f.add_argument("--ignore-partition-limits", action="store_true",
                   help="submit a job longer or wider than its partition's MaxTime/MaxNodes "
                        "(scontrol show partition) allows, e.g. where a QOS lifts them; without "
                        "it such a job is refused, as Slurm would keep it pending for ever")
    f.add_argument("--gpu-name", default=None,
                   help="GPU model of the nodes (e.g. H100) for the memory and time plan when "
                        "this machine has no such GPU")
    return example_on_missing(p, "tape-submit --config configs/train/demo.yaml --nodes 2 "
                                 "--time 01:00:00 --dry-run")


def _gpus_per_node(text: str) -> tuple[str | None, int]:
    try:
        return parse_gpus_per_node(text)
    except RenderError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--gpus-per-node ")) from None


def _job_name(config: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    return "tape-" + re.sub(r"[^A-Za-z0-9_.-]", "-", Path(config).stem)


# sbatch's input environment variables, by the option each stands for. Slurm ranks them above
# the script's #SBATCH lines (command line > environment > script): one set in the user's
# shell (a site profile's SBATCH_PARTITION, an SBATCH_TIMELIMIT, an SBATCH_SIGNAL) would
# silently replace what tape-submit rendered -- the USR1 warning before the time limit
# included, without which the job is killed without a checkpoint.
SBATCH_ENV_OPTIONS = {
    "SBATCH_JOB_NAME": "--job-name", "SBATCH_TIMELIMIT": "--time",
    "SBATCH_PARTITION": "--partition", "SBATCH_ACCOUNT": "--account", "SBATCH_QOS": "--qos",
    "SBATCH_SIGNAL": "--signal", "SBATCH_REQUEUE": "--requeue", "SBATCH_NO_REQUEUE": "--requeue",
    "SBATCH_OPEN_MODE": "--open-mode", "SBATCH_GPUS_PER_NODE": "--gpus-per-node",
    "SBATCH_GPUS": "--gpus-per-node", "SBATCH_GRES": "--gres", "SBATCH_CONSTRAINT": "--constraint",
    "SBATCH_EXCLUSIVE": "--exclusive", "SBATCH_RESERVATION": "--reservation",
    "SBATCH_MEM_PER_NODE": "--mem", "SBATCH_MEM_PER_CPU": "--mem-per-cpu",
    "SBATCH_MEM_PER_GPU": "--mem-per-gpu", "SBATCH_CPUS_PER_GPU": "--cpus-per-gpu",
    "SBATCH_WCKEY": "--wckey", "SBATCH_CLUSTERS": "--clusters",
}


def script_options(script: str) -> set[str]:
    """The long options of a rendered script's ``#SBATCH`` lines (``--time``, ...), by the
    option sbatch reads each as (an --sbatch-arg's ``--wck=x`` is ``--wckey``)."""
    found = set()
    for m in re.finditer(r"^#SBATCH\s+--([A-Za-z0-9-]+)", script, re.M):
        try:
            found.add("--" + (sbatch_long_option(m.group(1)) or m.group(1)))
        except AmbiguousOption:
            found.add("--" + m.group(1))
    return found


def overriding_environment(scripts: list[str], environ=None) -> dict[str, str]:
    """The sbatch input variables set in ``environ`` (default: this process's) that would
    override an option the ``scripts`` render: ``{variable: option}``."""
    environ = os.environ if environ is None else environ
    rendered = set().union(*map(script_options, scripts))
    return {var: option for var, option in SBATCH_ENV_OPTIONS.items()
            if var in environ and option in rendered}


def _sbatch(args: list[str], drop_env: dict[str, str] | None = None) -> int:
    """Run `sbatch --parsable ...` and return the job id; RuntimeError with sbatch's message.
    ``drop_env``: input variables not passed to sbatch (``overriding_environment``)."""
    env = {k: v for k, v in os.environ.items() if k not in (drop_env or {})}
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch {' '.join(args)} failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    # `<id>` or `<id>;<cluster>` on its own line, the last one: a site's sbatch wrapper may
    # print a line of its own before it.
    ids = re.findall(r"^(\d+)(?:;\S*)?$", proc.stdout, re.M)
    if not ids:
        raise RuntimeError(f"sbatch printed no job id: {proc.stdout!r}")
    return int(ids[-1])


def never_starts(script: str, opts: ClusterOptions, drop_env: dict[str, str]) -> str | None:
    """Why Slurm would never start the job ``script`` (its text), or None: no node of the
    partition has what one node of the job asks for (its CPUs, GPUs, a --constraint, memory).
    sbatch refuses most such jobs itself, but queued one asking for more than the partition
    has in all, which pended for ever (PartitionConfig); `sbatch --test-only` refuses both
    (measured, 22.05). No answer in time, or any other, is left to sbatch itself."""
    from tape_train.train.run_lock import SLURM_QUERY_TIMEOUT_S

    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    try:
        proc = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True,
                              text=True, env=env, timeout=SLURM_QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    said = proc.stderr.strip().splitlines()
    if proc.returncode == 0 or not any("Requested node configuration is not available" in line
                                       for line in said):
        return None
    gpus = (f", --gpus-per-node {opts.gpu_type + ':' if opts.gpu_type else ''}"
            f"{opts.gpus_per_node}" if opts.gpus_per_node else "")
    return (f"sbatch --test-only: {said[-1]}: no node of the partition has what each node of "
            f"this job asks for (--cpus-per-task {opts.cpus_per_task}{gpus}, and any "
            f"--sbatch-arg such as --constraint or --mem); queued, it would pend for ever "
            f"(PartitionConfig)")


def _slurm_answer(argv: list[str]) -> str | None:
    """stdout of a Slurm query, or None when there is no answer (not installed, failing, slow):
    the checks that use it only catch early what sbatch or the job would show later."""
    from tape_train.train.run_lock import _run_bounded

    answer = _run_bounded(argv)
    if isinstance(answer, str) or answer[0] != 0:
        return None
    return answer[1]


def _slurm_seconds(text: str) -> int | None:
    """A partition's MaxTime in seconds; None when unlimited or not a time."""
    try:
        return parse_time_limit(text)
    except RenderError:
        return None


def partition_limit_errors(partition: str | None, jobs: list[tuple[str, int, str]]
                           ) -> list[str]:
    """What the partition's limits would keep pending for ever: a job asking for more time
    (MaxTime) or nodes (MaxNodes, TotalNodes) than the partition gives is accepted by sbatch
    on clusters that do not enforce partition limits at submission (EnforcePartLimits=NO, the
    default), then pends with reason PartitionTimeLimit / PartitionNodeLimit and never starts.
    ``jobs`` is ``[(time flag, nodes, time limit)]``; ``partition`` None means the default
    partition. Nothing is said when scontrol cannot answer or several partitions are given."""
    if partition and "," in partition:
        return []
    out = _slurm_answer(["scontrol", "show", "partition", "--oneliner",
                         *([partition] if partition else [])])
    if not out:
        return []
    rows = [dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
            for line in out.splitlines()]
    row = next((r for r in rows if (r.get("PartitionName") == partition if partition
                                    else r.get("Default") == "YES")), None)
    if row is None:
        return []
    name = row["PartitionName"]
    errors = []
    max_time = row.get("MaxTime", "UNLIMITED")
    time_limit = _slurm_seconds(max_time)
    node_limits = [(int(row[key]), f"{key}={row[key]}") for key in ("MaxNodes", "TotalNodes")
                   if row.get(key, "").isdigit()]
    for flag, nodes, time_text in jobs:
        if time_limit is not None and parse_time_limit(time_text, flag) > time_limit:
            errors.append(f"{flag} {time_text} is longer than partition {name}'s MaxTime="
                          f"{max_time}: Slurm would keep the job pending (PartitionTimeLimit) "
                          f"and never start it; ask for {max_time} or less, or another "
                          f"partition (--partition)")
        for limit, said in node_limits:
            if nodes > limit:
                errors.append(f"--nodes {nodes} is more than partition {name} gives one job "
                              f"({said}): Slurm would keep the job pending (PartitionNodeLimit) "
                              f"and never start it; ask for {limit} or fewer, or another "
                              f"partition (--partition)")
                break
    return errors


def duplicate_warnings(job_name: str, run_dir: Path, check_lock: bool = True) -> list[str]:
    """A second job for a run that is already queued or running: both are accepted, and the
    one that starts second fails its start-up checks while the other holds the run directory.
    Said at submission, from the run directory's lock (``check_lock``: not when the preflight
    runs, which says it) and the user's queued jobs of this name (the run directory of a
    pending job is not visible to Slurm: the name is the hint)."""
    from tape_train.train.run_lock import lock_refusal

    found = []
    refusal = lock_refusal(run_dir) if check_lock else None
    if refusal:
        found.append(f"{refusal} (this job, if it starts before that run ends, fails its "
                     f"start-up checks)")
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (some containers): squeue cannot be asked
        user = None
    out = user and _slurm_answer(["squeue", "--noheader", f"--user={user}",
                                  f"--name={job_name}", "--format=%i %T"])
    queued = [line.split() for line in (out or "").splitlines() if len(line.split()) == 2]
    if queued:
        jobs = ", ".join(f"{job} ({state})" for job, state in queued)
        found.append(f"you already have job(s) named {job_name} in the queue: {jobs}; if one "
                     f"trains the same run dir ({run_dir}), only one of them can run at a time "
                     f"(the one that starts second fails its start-up checks; nothing is lost): "
                     f"`scancel` the one you do not want, or give this run its own "
                     f"train.run_dir and --job-name")
    return found


def _finds_tape_train(python: str) -> bool:
    """Whether ``python`` finds the tape_train package (without importing it: no torch start-up);
    True when the question cannot be asked (only a clear no is worth a warning)."""
    try:
        proc = subprocess.run([python, "-c", "import importlib.util, sys; "
                               "sys.exit(importlib.util.find_spec('tape_train') is None)"],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return proc.returncode != 1


def _remove_created(path: Path, existed: Path) -> None:
    """Remove the empty directories from ``path`` up to (not including) ``existed``."""
    while path != existed and existed in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent


def preflight(args: argparse.Namespace, opts: ClusterOptions, train_args: list[str]) -> int:
    """`tape-train --dry-run` for the job's layout (nodes x processes per node), here, before
    sbatch (or for `--dry-run`): a bad input or a run that cannot resume on this node count is
    refused now, not after the job waited in the queue. The plan goes to stderr; 0 if the job
    may be submitted, else 1."""
    from tape_train.cluster.run_args import parse_train_args
    from tape_train.config import load_run_config
    from tape_train.train.preflight import format_report, run_preflight

    parsed = parse_train_args(train_args)
    cfg = load_run_config(parsed.config, parsed.overrides)
    report = run_preflight(cfg, world_size=opts.nodes * opts.procs,
                           gpus_per_node=opts.gpus_per_node, resume_from=parsed.resume_from,
                           allow_config_change=parsed.allow_config_change, gpu_name=args.gpu_name,
                           ranks_per_node=opts.procs)
    out, err = format_report(report, prefix="tape-submit")
    sys.stderr.write(f"tape-submit: preflight for {opts.nodes} node(s) x {opts.procs} "
                     f"process(es):\n{out}{err}")
    if report.problems:
        if args.dry_run:
            print(f"tape-submit: preflight found {len(report.problems)} problem(s): a submit "
                  f"would refuse this job (--no-preflight submits anyway); the script follows "
                  f"on stdout for inspection, exit code 1", file=sys.stderr)
        else:
            print(f"tape-submit: preflight found {len(report.problems)} problem(s); nothing "
                  f"was submitted (--no-preflight submits anyway)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    # A warning of the options (a short --signal-grace) is one line in the command's own
    # format, not Python's `<file>:<line>: UserWarning: ...`.
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_args, **_kw: print(
            f"tape-submit: warning: {message}", file=sys.stderr)
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    workdir = Path.cwd()
    train_args = ["--config", args.config, *args.overrides]
    try:
        run_dir = resolve_run_dir(train_args, base_dir=workdir)
        if not args.log_dir.strip():  # the scripts and Slurm's logs would land in workdir
            raise ValueError(f"--log-dir {args.log_dir!r} is empty (an unset shell variable?): "
                             f"name the directory of the scripts and logs, e.g. --log-dir "
                             f"logs/slurm (--log-dir . for this one)")
        log_dir = (workdir / args.log_dir).resolve()
        opts = ClusterOptions(
            nodes=args.nodes, gpu_type=args.gpus_per_node[0],
            gpus_per_node=args.gpus_per_node[1],
            procs_per_node=args.procs_per_node, cpus_per_task=args.cpus_per_task,
            time=args.time, partition=args.partition, account=args.account, qos=args.qos,
            job_name=_job_name(args.config, args.job_name), signal_grace=args.signal_grace,
            log_dir=str(log_dir), workdir=str(workdir), socket_ifname=args.socket_ifname,
            python=args.python, min_free_gb=args.min_free_gb, max_requeues=args.max_requeues,
            max_stalled_requeues=args.max_stalled_requeues, max_restarts=args.max_restarts,
            train_module=args.train_module, extra_sbatch=args.sbatch_arg)
        template_dir = args.template_dir or default_template_dir()
        train_path = template_dir / "train.sbatch"
        train_script = render_train_script(read_template(train_path), opts, train_args,
                                           source=str(train_path))
        eval_script = None
        if args.eval_after:
            parse_time_limit(args.eval_time, "--eval-time")
            eval_out = Path(args.eval_out) if args.eval_out else run_dir / "eval"
            eval_args = ["--checkpoint", str(run_dir), "--out", str(workdir / eval_out)]
            yours = (["--lengths", *map(str, args.eval_lengths)] if args.eval_lengths
                     else []) + args.eval_arg
            from tape_train.cluster.run_args import parse_train_args
            from tape_train.config import load_run_config
            from tape_train.eval.cli import check_arguments

            parsed = parse_train_args(train_args)
            try:  # tape-eval's own rules, with the run's eval: section, now, not after training
                check_arguments(eval_args + yours,
                                run=load_run_config(parsed.config, parsed.overrides))
            except ValueError as exc:
                raise ValueError(f"--eval-lengths/--eval-arg: tape-eval {' '.join(yours)}: "
                                 f"{exc}") from None
            eval_args += yours
            eval_path = template_dir / "eval.sbatch"
            eval_script = render_eval_script(read_template(eval_path), opts, eval_args,
                                             time=args.eval_time, source=str(eval_path))
        else:
            given = [flag for flag, value, default in (
                ("--eval-lengths", args.eval_lengths, None), ("--eval-out", args.eval_out, None),
                ("--eval-time", args.eval_time, EVAL_TIME), ("--eval-arg", args.eval_arg, []))
                if value != default]
            if given:
                raise ValueError(f"{', '.join(given)}: only used by the evaluation job of "
                                 f"--eval-after, which is not given: add --eval-after, or drop "
                                 f"{'them' if len(given) > 1 else 'it'}")
        # A QOS may let a job past its partition's limits (Flags=PartitionTimeLimit, ...).
        errors = [] if args.ignore_partition_limits else partition_limit_errors(
            args.partition or os.environ.get("SBATCH_PARTITION"),
            [("--time", opts.nodes, opts.time)]
            + ([("--eval-time", 1, args.eval_time)] if args.eval_after else []))
        if errors:
            raise ValueError("; ".join(errors) + " (where a QOS lifts the partition's limits: "
                             "--ignore-partition-limits)")
    except (RenderError, TrainArgsError, ValueError) as exc:
        # ConfigError is a ValueError: it names the config file, line and key.
        print(f"tape-submit: error: {exc}", file=sys.stderr)
        return 1
    if shutil.which(args.python) is None:
        warnings.warn(f"--python {args.python}: no such interpreter here; every node needs it "
                      f"at that path, or the job fails its start-up checks (slurmstepd: error: "
                      f"execve(): {args.python}: No such file or directory)")
    elif not _finds_tape_train(args.python):
        warnings.warn(f"--python {args.python} cannot import tape_train here (with this "
                      f"environment, which the job inherits): unless the nodes' interpreter "
                      f"can, the job fails its start-up checks (No module named 'tape_train'); "
                      f"give the Python of the environment tape-train is installed in")
    # The trainer's own checks; another --train-module has its own arguments.
    check = not args.no_preflight and args.train_module == "tape_train.train.cli"
    # Each --sbatch-arg by the option sbatch reads it as (--dep=... is --dependency).
    extra_options = {sbatch_arg_option(arg) for arg in opts.extra_sbatch}
    if "dependency" not in extra_options:
        for message in duplicate_warnings(opts.job_name, run_dir, check_lock=not check):
            warnings.warn(message)
    scripts = [train_script] + ([eval_script] if eval_script is not None else [])
    overriding = overriding_environment(scripts)
    if args.dry_run:
        for var, option in overriding.items():
            warnings.warn(f"{var}={os.environ[var]} in this environment overrides the script's "
                          f"#SBATCH {option} when you sbatch it by hand (Slurm ranks the "
                          f"environment above the script); unset it first")
        # The checks a submit would make, so that a dry run says whether the job would be
        # queued; the script is printed either way (it is what a submit would render).
        code = preflight(args, opts, train_args) if check else 0
        refusal = never_starts(train_script, opts, overriding) if shutil.which("sbatch") else None
        if refusal:
            print(f"tape-submit: error: {refusal}: a submit would refuse this job",
                  file=sys.stderr)
            code = 1
        sys.stderr.flush()
        sys.stdout.write(train_script)
        if eval_script is not None:
            sys.stdout.write(f"\n{EVAL_SEPARATOR}\n{eval_script}")
        sys.stdout.flush()
        if code:
            return code  # no invitation to submit what the preflight refused
        # Slurm opens the log before the script runs and does not create its directory: a
        # script submitted by hand without it fails at once and writes nothing.
        print(f"tape-submit: dry run, nothing submitted; to submit the script by hand: mkdir -p "
              f"{shlex.quote(str(log_dir))} && sbatch <file>"
              + ("" if eval_script is None else
                 "; the evaluation script (after the '# ---- eval.sbatch' line) is a second "
                 "file: sbatch --dependency=afterok:<training job id> "
                 "--kill-on-invalid-dep=yes <eval file>"), file=sys.stderr)
        return code

    if shutil.which("sbatch") is None:
        print("tape-submit: error: sbatch not found on PATH; run on a Slurm login node, or use "
              "--dry-run to print the script", file=sys.stderr)
        return 1
    if check:
        code = preflight(args, opts, train_args)
        if code:
            return code
    existed = next(p for p in (log_dir, *log_dir.parents) if p.exists())
    log_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create the --output directory
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    train_file = log_dir / f"{opts.job_name}.{stamp}.train.sbatch"
    write_atomic(train_file, train_script)
    try:
        for var, option in overriding.items():
            print(f"tape-submit: {var}={os.environ[var]} is set here: not passed to sbatch, "
                  f"where it would override the script's #SBATCH {option} (Slurm ranks the "
                  f"environment above the script)", file=sys.stderr)
        refusal = never_starts(train_script, opts, overriding)
        if refusal:
            raise RuntimeError(refusal)
        job_id = _sbatch([str(train_file)], overriding)
    except RuntimeError as exc:
        # Nothing was queued: no script is kept that looks submitted, no empty log directory.
        train_file.unlink(missing_ok=True)
        _remove_created(log_dir, existed)
        print(f"tape-submit: error: {exc}\ntape-submit: nothing was submitted", file=sys.stderr)
        return 1
    eval_file = log_dir / f"{opts.job_name}.{stamp}.eval.sbatch"
    try:
        # %j in the log name is each array task's own job id (not the array's, measured).
        log_line = (f"logs {log_dir}/{opts.job_name}-<job id>.out, one per array task (its own "
                    f"job id: squeue -r --jobs={job_id} --format='%i %A')"
                    if "array" in extra_options
                    else f"log {log_dir}/{opts.job_name}-{job_id}.out")
        print(f"tape-submit: training job {job_id}: {opts.nodes} node(s) x {opts.procs} "
              f"process(es), run dir {run_dir}, {log_line}", file=sys.stderr)
        print(job_id, flush=True)
        if eval_script is not None:
            write_atomic(eval_file, eval_script)
            # Without kill-on-invalid-dep a failed training job would leave the evaluation
            # pending forever (DependencyNeverSatisfied).
            eval_id = _sbatch([f"--dependency=afterok:{job_id}", "--kill-on-invalid-dep=yes",
                               str(eval_file)], overriding)
            print(f"tape-submit: evaluation job {eval_id} runs after {job_id} succeeds",
                  file=sys.stderr)
            print(eval_id, flush=True)
    except RuntimeError as exc:
        print(f"tape-submit: error: {exc}", file=sys.stderr)
        print(f"tape-submit: training job {job_id} is queued without its evaluation; once the "
              f"cause is fixed, chain it by hand: sbatch --dependency=afterok:{job_id} "
              f"--kill-on-invalid-dep=yes {shlex.quote(str(eval_file))} (or `scancel {job_id}`)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
