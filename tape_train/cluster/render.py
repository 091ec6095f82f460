"""Render `launch/slurm/*.sbatch` from cluster options: the templates are the scripts themselves.

Each batch script has two marked blocks::

    # >>> sbatch header ...        the #SBATCH lines (defaults for plain `sbatch` use)
    # <<< sbatch header
    # >>> run settings ...         shell variables: the command arguments and launch settings
    # <<< run settings

`render_train_script` / `render_eval_script` replace exactly those two blocks and keep every
other line, so the script body exists once, in the file users can also submit by hand.
"""

from __future__ import annotations

import re
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tape_train.cluster.sbatch_options import (
    SBATCH_OPTIONS_WITH_ARGUMENT,
    AmbiguousOption,
    sbatch_long_option,
)

HEADER_BEGIN, HEADER_END = "# >>> sbatch header", "# <<< sbatch header"
SETTINGS_BEGIN, SETTINGS_END = "# >>> run settings", "# <<< run settings"

# Slurm checks signal deadlines every 30 s, so a USR1 may come up to 30 s late (notes/slurm.md).
SLURM_SIGNAL_CHECK_SECONDS = 30
# Slurm's --time formats (time_str2secs() in src/common/parse_time.c): M, M:S, H:M:S, D-H,
# D-H:M, D-H:M:S, and D- (a day count alone, read as D-0). Each field may exceed its usual
# range: 99:99 is 99 min 99 s (01:41:00 once rounded up to whole minutes).
_TIME_FORMATS = tuple(re.compile(p, re.ASCII) for p in (  # ASCII: sbatch takes no other digits
    r"^(?P<m>\d+)$",
    r"^(?P<m>\d+):(?P<s>\d+)$",
    r"^(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)$",
    r"^(?P<d>\d+)-(?P<h>\d*)$",
    r"^(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+)$",
    r"^(?P<d>\d+)-(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)$",
))
# sbatch's --signal=<sig>@<time> keeps the time in 16 bits and refuses more.
MAX_SIGNAL_GRACE = 0xFFFF
# What Slurm reads as no time limit at all (0 too): no USR1 warning is ever sent then.
_NO_LIMIT = ("-1", "infinite", "unlimited")
# sbatch adds the seconds in a C int and then 59 to round up to minutes: a larger limit wraps
# around unseen (99999999 minutes became 19734-04:11:00).
MAX_TIME_LIMIT_SECONDS = 2**31 - 1 - 59
# The sbatch options tape-submit renders itself, and what sets each: an --sbatch-arg giving one
# again would win over it unseen (the later #SBATCH line counts), past the checks on its flag.
# Also the ones that undo a rendered line: --no-requeue (the script requeues itself) and
# --ntasks (more tasks than nodes: the job's steps are one task per node, a torchrun each).
RENDERED_SBATCH_OPTIONS = {
    "job-name": "--job-name", "nodes": "--nodes", "cpus-per-task": "--cpus-per-task",
    "time": "--time", "gpus-per-node": "--gpus-per-node", "partition": "--partition",
    "account": "--account", "qos": "--qos", "signal": "--signal-grace", "output": "--log-dir",
    "chdir": "the directory tape-submit runs in", "ntasks-per-node": "the script (one task "
    "per node)", "ntasks": "the script (one task per node, a torchrun starting --procs-per-node "
    "or --gpus-per-node processes)", "requeue": "the script", "no-requeue": "the script (it "
    "requeues itself on the time-limit warning)", "open-mode": "the script"}
# The sbatch options that ask for GPUs otherwise: the job would get GPUs the script does not
# start trainers for (--gres=gpu:3 with --gpus-per-node=2: 3 GPUs, steps and trainers on 2; with
# no --gpus-per-node, one trainer per node on cuda:0 alone; measured with GPU GRES, 22.05).
GPU_SBATCH_OPTIONS = ("gpus", "gpus-per-task", "gpus-per-socket", "gres", "tres-per-task")
# Values that end up on an `#SBATCH --key=value` line: no whitespace, no shell/sbatch quoting.
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.,:+@%/=-]+\Z")
# sbatch reads an #SBATCH value as one shell-like word (get_argument() in src/sbatch/opt.c, the
# same from 22.05 to 25.x): whitespace ends it and an unquoted '#' starts a comment (a run in
# `proj#2` would have run in `proj`), both kept inside double quotes; a backslash escapes the
# next character, differently between versions, so paths with '"' or '\' are refused.
_PATH_REFUSED = re.compile(r'["\\\n\r]')
# The same for an --sbatch-arg's value (a comment, a mail address, a feature expression).
_VALUE_REFUSED = _PATH_REFUSED


class RenderError(ValueError):
    """An option or template is invalid; the message names the option or file at fault."""


def parse_time_limit(text: str, flag: str = "--time") -> int:
    """Seconds in a Slurm time limit as sbatch reads it: M, M:S, H:M:S, D-, D-H, D-H:M or
    D-H:M:S, surrounding whitespace ignored. Raises RenderError naming ``flag`` for anything
    else, for no limit (0, -1, INFINITE, UNLIMITED: Slurm would never send the USR1 warning
    before the end) and for a limit sbatch cannot hold (over MAX_TIME_LIMIT_SECONDS)."""
    stripped = text.strip()
    if stripped.lower() in _NO_LIMIT:
        raise RenderError(f"{flag} {text!r} means no time limit to Slurm, which then never "
                          f"sends the USR1 warning the job checkpoints on before it ends: give "
                          f"a time limit, e.g. 2-00:00:00")
    for pattern in _TIME_FORMATS:
        match = pattern.match(stripped)
        if match:
            parts = {k: int(v) for k, v in match.groupdict().items() if v}
            seconds = (parts.get("d", 0) * 86400 + parts.get("h", 0) * 3600
                       + parts.get("m", 0) * 60 + parts.get("s", 0))
            if seconds <= 0:
                raise RenderError(f"{flag} {text!r} is zero, which Slurm reads as no time "
                                  f"limit: it then never sends the USR1 warning the job "
                                  f"checkpoints on before it ends; give a positive time limit")
            if seconds > MAX_TIME_LIMIT_SECONDS:
                raise RenderError(f"{flag} {text!r} is {seconds} s, more than sbatch can hold "
                                  f"({MAX_TIME_LIMIT_SECONDS} s, about 68 years): it would "
                                  f"wrap around to another limit unseen")
            return seconds
    raise RenderError(f"{flag} {text!r} is not a Slurm time limit: use minutes (90), MM:SS, "
                      "HH:MM:SS (04:00:00), D-HH (2-00), D-HH:MM or D-HH:MM:SS (1-12:00:00)")


@dataclass
class ClusterOptions:
    """Where and how big a job is; every field maps to one `#SBATCH` line or run setting.

    Attributes:
        nodes: nodes in the allocation (one torchrun per node).
        gpus_per_node: GPUs per node; 0 means CPU nodes (gloo) with `procs_per_node` trainers.
        gpu_type: the GPUs' GRES type (`--gpus-per-node=<type>:<n>`, e.g. `a100`), or None.
        procs_per_node: CPU only: trainer processes per node (torchrun --nproc_per_node).
        cpus_per_task: CPUs per node-task (shared by that node's trainer processes).
        time: Slurm time limit (see `parse_time_limit`).
        partition, account, qos: passed through when set.
        job_name: Slurm job name (also names the log file `<log_dir>/<job_name>-<jobid>.out`).
        signal_grace: seconds before the time limit at which Slurm sends USR1 to the batch
            shell; the trainer must checkpoint within it (and Slurm may be 30 s late).
        log_dir: directory for the per-job logs (created by tape-submit; absolute once rendered).
        workdir: the job's working directory (`--chdir`); relative config paths and run
            directories are relative to it.
        socket_ifname: network interface for gloo (and NCCL on GPU), e.g. `ib0`; empty lets
            torch choose; `lo` when every "node" is this one machine.
        python: interpreter with tape_train installed, on every node.
        min_free_gb: preflight: free space required in the run directory, in GB (10^9 bytes).
        max_requeues: the script stops requeueing itself after this many restarts.
        max_stalled_requeues: ... or after this many restarts in a row that added no new
            checkpoint (`tape_train.cluster.requeue_guard`; 0: no limit).
        max_restarts: in-job restarts (torchrun --max_restarts) after a rank crashed or hung;
            after the first, only if the attempt before saved a new checkpoint (0: none).
        train_module: the module torchrun runs with `-m` (the trainer; a fork may swap it).
        extra_sbatch: further sbatch options, e.g. `--constraint=a100`, one `#SBATCH` line each.
    """

    nodes: int = 1
    gpus_per_node: int = 0
    gpu_type: str | None = None
    procs_per_node: int = 1
    cpus_per_task: int = 8
    time: str = "04:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "tape-train"
    signal_grace: int = 300
    log_dir: str = "logs/slurm"
    workdir: str = "."
    socket_ifname: str = ""
    python: str = field(default_factory=lambda: sys.executable)
    min_free_gb: float = 10.0
    max_requeues: int = 100
    max_stalled_requeues: int = 3
    max_restarts: int = 3
    train_module: str = "tape_train.train.cli"
    extra_sbatch: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("nodes", "procs_per_node", "cpus_per_task"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("gpus_per_node", self.gpus_per_node, minimum=0)
        _check_int("signal_grace", self.signal_grace, minimum=1)
        _check_int("max_requeues", self.max_requeues, minimum=0)
        _check_int("max_stalled_requeues", self.max_stalled_requeues, minimum=0)
        _check_int("max_restarts", self.max_restarts, minimum=0)
        if self.gpus_per_node > 0 and self.procs_per_node not in (1, self.gpus_per_node):
            raise RenderError(f"--procs-per-node {self.procs_per_node} is for CPU nodes; with "
                              f"--gpus-per-node {self.gpus_per_node} there is one process per GPU")
        if self.gpu_type is not None and (self.gpus_per_node == 0 or not re.match(
                r"^[A-Za-z0-9_.-]+\Z", self.gpu_type)):
            raise RenderError(f"--gpus-per-node {self.gpu_type}:{self.gpus_per_node}: a GPU "
                              "type needs a number of GPUs >= 1 and a plain name (a100:8)")
        limit = parse_time_limit(self.time)
        self.time = self.time.strip()  # `--time= 90` is refused by sbatch
        if self.signal_grace > MAX_SIGNAL_GRACE:
            raise RenderError(f"--signal-grace {self.signal_grace} s is more than sbatch's "
                              f"--signal takes ({MAX_SIGNAL_GRACE} s, 0xffff): give at most "
                              f"{MAX_SIGNAL_GRACE}")
        if self.signal_grace >= limit:
            raise RenderError(f"--signal-grace {self.signal_grace} s must be shorter than the "
                              f"time limit --time {self.time} ({limit} s)")
        if self.signal_grace < 2 * SLURM_SIGNAL_CHECK_SECONDS:
            warnings.warn(f"--signal-grace {self.signal_grace} s: Slurm may deliver USR1 up to "
                          f"{SLURM_SIGNAL_CHECK_SECONDS} s late, leaving little time to "
                          "checkpoint", stacklevel=2)
        if not re.match(r"^[A-Za-z0-9_.-]+\Z", self.job_name):
            raise RenderError(f"--job-name {self.job_name!r}: use letters, digits, '_', '.', '-'")
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise RenderError(f"--{name} {value!r} is empty (an unset shell variable?): "
                                  f"name the {name}, or leave --{name} out for the cluster's "
                                  f"default")
            if value is not None and not _SAFE_VALUE.match(value):
                raise RenderError(f"--{name} {value!r} contains characters sbatch cannot take "
                                  "in a header line")
        if self.socket_ifname and not re.match(r"^[A-Za-z0-9_.^,!-]+\Z", self.socket_ifname):
            raise RenderError(f"--socket-ifname {self.socket_ifname!r} is not an interface "
                              "name (or NCCL-style list/prefix)")
        for name in ("log_dir", "workdir"):
            if _PATH_REFUSED.search(getattr(self, name)):
                raise RenderError(f"{name} {getattr(self, name)!r} contains a double quote, a "
                                  "backslash or a line break, which an #SBATCH line cannot hold")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z",
                        self.train_module):
            raise RenderError(f"--train-module {self.train_module!r} is not a module name")
        if not 0 <= self.min_free_gb < float("inf"):
            raise RenderError(f"--min-free-gb must be a finite number >= 0, got "
                              f"{self.min_free_gb}")
        if not self.python.strip():
            raise RenderError("--python is empty: give the interpreter with tape_train "
                              "installed on the nodes")
        for line in self.extra_sbatch:
            _check_sbatch_arg(line)
            name, has_value, value = line[2:].partition("=")
            if has_value and sbatch_long_option(name) == "time-min":
                # Slurm may lower the job's limit to --time-min to start it sooner: the USR1
                # warning then comes signal_grace before that limit.
                try:
                    floor = parse_time_limit(value, "--time-min")
                except RenderError:
                    continue  # 0 or a malformed one: sbatch's to judge
                if self.signal_grace >= floor:
                    raise RenderError(f"--sbatch-arg {line!r}: Slurm may lower the time limit "
                                      f"to {value} ({floor} s) to start the job sooner, no "
                                      f"longer than --signal-grace {self.signal_grace} s: "
                                      f"the USR1 warning would come at the start; give a "
                                      f"--time-min longer than the grace")

    @property
    def procs(self) -> int:
        """Trainer processes per node (torchrun --nproc_per_node)."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.procs_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise RenderError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def sbatch_arg_option(line: str) -> str | None:
    """The sbatch option an ``--sbatch-arg`` (``--name[=value]``) gives, by its full name
    (``--dep=afterok:1``: ``dependency``); None for one sbatch_options does not know. The
    argument must have passed ClusterOptions' checks (no ambiguous name)."""
    return sbatch_long_option(line[2:].partition("=")[0])


def _check_sbatch_arg(line: str) -> None:
    """One --sbatch-arg: a long option sbatch can read from an #SBATCH line, not one that
    tape-submit renders itself (given in full or abbreviated) or that asks for GPUs."""
    if not line.startswith("--"):
        raise RenderError(f"--sbatch-arg {line!r} must be one long option like "
                          "--constraint=a100")
    name, has_value, value = line[2:].partition("=")
    if any(c.isspace() for c in name):
        raise RenderError(f"--sbatch-arg {line!r}: the option name {name!r} contains whitespace; "
                          f"give one option per --sbatch-arg, its value attached with '=' "
                          f"(--sbatch-arg=--constraint=a100)")
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]*\Z", name):
        raise RenderError(f"--sbatch-arg {line!r}: {name!r} is not an option name; give one "
                          f"long option like --constraint=a100")
    if _VALUE_REFUSED.search(value):
        raise RenderError(f"--sbatch-arg {line!r}: the value contains a double quote, a "
                          f"backslash or a line break, which an #SBATCH line cannot hold")
    try:
        option = sbatch_long_option(name)
    except AmbiguousOption as exc:
        raise RenderError(f"--sbatch-arg {line!r}: --{name} is ambiguous, an abbreviation of "
                          f"{', '.join('--' + c for c in exc.candidates)} (sbatch 22.05-25.11 "
                          f"have some or all of them); write the option in full") from None
    if option is None:
        return  # a site's SPANK option, or a mistake sbatch itself will name
    said = f"--{name}" if option == name else f"--{name} (sbatch reads it as --{option})"
    # --gres=gpu:a100:8,nvme:1 or --tres-per-task=gres/gpu:1; not --gres=nvme:1.
    asked = {re.split(r"[:=]", item)[0].removeprefix("gres/").lower()
             for item in value.split(",")}
    if option in GPU_SBATCH_OPTIONS and (option.startswith("gpus") or "gpu" in asked):
        read_as = "" if option == name else f" (sbatch reads --{name} as --{option})"
        raise RenderError(f"--sbatch-arg {line!r}{read_as} asks for GPUs: give them with "
                          f"--gpus-per-node N (or TYPE:N, e.g. a100:8), which starts one "
                          f"trainer per GPU on each node")
    if option in RENDERED_SBATCH_OPTIONS:
        raise RenderError(f"--sbatch-arg {line!r}: {said} is set by "
                          f"{RENDERED_SBATCH_OPTIONS[option]}; a second #SBATCH line would "
                          f"override it unchecked")
    if not has_value and option in SBATCH_OPTIONS_WITH_ARGUMENT:
        raise RenderError(f"--sbatch-arg {line!r}: {said} takes a value, attached with '=' "
                          f"({line}=VALUE); without one sbatch takes the next #SBATCH line's "
                          f"option for its value, and that option is lost")


def _sbatch_arg_line(line: str) -> str:
    """An --sbatch-arg as its #SBATCH line's text: a value with a space, '#', a quote or any
    other character beyond the plain ones double-quoted (see _PATH_REFUSED)."""
    name, has_value, value = line.partition("=")
    if not has_value or not value or _SAFE_VALUE.match(value):
        return line
    return f'{name}="{value}"'


def train_header(opts: ClusterOptions) -> list[str]:
    """`#SBATCH` lines for the training job."""
    lines = [
        f"--job-name={opts.job_name}",
        f"--nodes={opts.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={opts.cpus_per_task}",
        f"--time={opts.time}",
    ]
    lines += _gpus(opts) + _placement(opts)
    lines += [
        f"--signal=B:USR1@{opts.signal_grace}",
        "--requeue",
        "--open-mode=append",
        _output(opts),
        f"--chdir={_sbatch_path(opts.workdir)}",
        *map(_sbatch_arg_line, opts.extra_sbatch),
    ]
    return [f"#SBATCH {line}" for line in lines]


def eval_header(opts: ClusterOptions, time: str) -> list[str]:
    """`#SBATCH` lines for the evaluation job: one task (torchrun) on one node, with as many
    GPUs as a training node has (one tape-eval process each)."""
    parse_time_limit(time)
    time = time.strip()
    lines = [
        f"--job-name={opts.job_name}-eval",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={opts.cpus_per_task}",
        f"--time={time}",
    ]
    lines += _gpus(opts) + _placement(opts)
    lines += [
        "--requeue",
        "--open-mode=append",
        _output(opts),
        f"--chdir={_sbatch_path(opts.workdir)}",
        *map(_sbatch_arg_line, opts.extra_sbatch),
    ]
    return [f"#SBATCH {line}" for line in lines]


def _sbatch_path(path: str) -> str:
    """``path`` as an #SBATCH value: double-quoted unless it is plain (see _PATH_REFUSED)."""
    return path if _SAFE_VALUE.match(path) else f'"{path}"'


def _output(opts: ClusterOptions) -> str:
    """The --output line: the log directory ('%' doubled: Slurm's pattern character), then
    the job name and id."""
    return f"--output={_sbatch_path(opts.log_dir.replace('%', '%%') + '/%x-%j.out')}"


def _gpus(opts: ClusterOptions) -> list[str]:
    """The --gpus-per-node line (`<type>:<n>` with a GPU type), none on CPU nodes."""
    if opts.gpus_per_node == 0:
        return []
    return [f"--gpus-per-node={f'{opts.gpu_type}:' if opts.gpu_type else ''}{opts.gpus_per_node}"]


def parse_gpus_per_node(text: str) -> tuple[str | None, int]:
    """`--gpus-per-node` as Slurm takes it, `N` or `TYPE:N` (`a100:8`): (type or None, N)."""
    match = re.match(r"^(?:([^:]+):)?(-?[0-9]+)$", text.strip())
    if not match:
        raise RenderError(f"--gpus-per-node {text!r} is not a number of GPUs (8) or a GRES "
                          f"type and a number (a100:8)")
    return match.group(1), int(match.group(2))


def _placement(opts: ClusterOptions) -> list[str]:
    return [f"--{name}={getattr(opts, name)}" for name in ("partition", "account", "qos")
            if getattr(opts, name) is not None]


def _assign(name: str, value: object) -> str:
    return f"{name}={shlex.quote(str(value))}"


def _array(name: str, items: list[str]) -> str:
    return f"{name}=({' '.join(shlex.quote(x) for x in items)})"


def train_settings(opts: ClusterOptions, train_args: list[str]) -> list[str]:
    """The run-settings block of train.sbatch: fixed values, no environment fallbacks."""
    return [
        _array("TRAIN_ARGS", train_args),
        _assign("TAPE_PYTHON", opts.python),
        _assign("TAPE_GPUS_PER_NODE", opts.gpus_per_node),
        _assign("TAPE_PROCS_PER_NODE", opts.procs),
        _assign("TAPE_SOCKET_IFNAME", opts.socket_ifname),
        _assign("TAPE_SIGNAL_GRACE", opts.signal_grace),
        _assign("TAPE_MIN_FREE_GB", opts.min_free_gb),
        _assign("TAPE_MAX_REQUEUES", opts.max_requeues),
        _assign("TAPE_MAX_STALLED_REQUEUES", opts.max_stalled_requeues),
        _assign("TAPE_MAX_RESTARTS", opts.max_restarts),
        _assign("TAPE_TRAIN_MODULE", opts.train_module),
    ]


def eval_settings(opts: ClusterOptions, eval_args: list[str]) -> list[str]:
    """The run-settings block of eval.sbatch: one process per GPU (one on CPU nodes)."""
    return [_array("EVAL_ARGS", eval_args), _assign("TAPE_PYTHON", opts.python),
            _assign("TAPE_GPUS_PER_NODE", opts.gpus_per_node)]


def replace_blocks(template: str, source: str, header: list[str], settings: list[str]) -> str:
    """Replace the marked header and settings blocks of `template` (read from `source`).

    The marker lines stay (so a rendered script can be rendered again); everything between
    them is replaced. Raises RenderError naming `source` when a marker is missing or repeated.
    """
    lines = template.splitlines()
    out = lines
    for begin, end, body in ((HEADER_BEGIN, HEADER_END, header),
                             (SETTINGS_BEGIN, SETTINGS_END, settings)):
        starts = [i for i, ln in enumerate(out) if ln.startswith(begin)]
        ends = [i for i, ln in enumerate(out) if ln.startswith(end)]
        if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
            raise RenderError(f"{source}: expected one '{begin}' line followed by one '{end}' "
                              f"line (found {len(starts)} and {len(ends)})")
        out = out[:starts[0] + 1] + body + out[ends[0]:]
    return "\n".join(out) + "\n"


def render_train_script(template: str, opts: ClusterOptions, train_args: list[str],
                        source: str = "train.sbatch") -> str:
    """train.sbatch with its header and settings rendered for `opts` and `train_args`."""
    return replace_blocks(template, source, train_header(opts), train_settings(opts, train_args))


def render_eval_script(template: str, opts: ClusterOptions, eval_args: list[str],
                       time: str = "01:00:00", source: str = "eval.sbatch") -> str:
    """eval.sbatch with its header and settings rendered for `opts` and `eval_args`."""
    return replace_blocks(template, source, eval_header(opts, time), eval_settings(opts, eval_args))


def default_template_dir() -> Path:
    """The shipped Slurm templates (the source tree's `launch/slurm/`, or the wheel's copy)."""
    from tape_train.resources import resource_dir

    return resource_dir("slurm")


def read_template(path: Path) -> str:
    if not path.is_file():
        raise RenderError(f"batch script template {path} not found (pass --template-dir "
                          "pointing at the repository's launch/slurm)")
    return path.read_text()
