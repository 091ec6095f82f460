"""A real Slurm cluster on this one machine, for tests: munged, slurmctld and N slurmd daemons.

`SlurmCluster` installs Debian's `slurmctld slurmd slurm-client munge` if they are missing,
writes a cgroup-free configuration under a temporary directory (state, spool, logs, pid files,
munge socket and key all live there), starts one munged, one slurmctld and one slurmd per
emulated node (`NodeName=<prefix>[1-N]`, Debian's build allows several slurmd per host), adds
`/etc/hosts` lines so that node names resolve to loopback addresses, and tears everything down
by pid — restoring `/etc/hosts` byte for byte — even when a test fails.

Every address is on loopback (127.0.0.0/8): slurmd listens on 127.0.0.1, node names resolve to
127.0.1.K. Daemons run in the foreground as our own children, so stopping them never needs a
process name. Teardown is robust: `stop()` runs from `__exit__` whatever the test did; while
the cluster runs, SIGTERM becomes KeyboardInterrupt (so pytest still tears down); and each
daemon asks the kernel for SIGTERM should the test process die outright (PR_SET_PDEATHSIG).
/etc/hosts lines left by such a death carry a marker and are removed at the next start.
One cluster at a time per machine: a second (another pytest on the same machine) would share
/etc/hosts and the node names; it finds the machine-wide lock (`LOCK_PATH`) held and raises
`SlurmUnavailable`. /etc/hosts is rewritten in place without truncating it first (our lines
follow the original bytes, which stay where they are), so no reader ever sees it empty.
Facts this relies on are recorded in `shared/notes/slurm.md`.

Usage::

    with SlurmCluster(tmp_dir, num_nodes=4) as cluster:
        job_id = cluster.sbatch(["-N2", "script.sbatch"])
        info = cluster.wait_for_job(job_id, timeout=120)

`SlurmUnavailable` is raised (with the reason) when the cluster cannot run here: not root, no
apt-get to install missing packages, or the daemons fail to come up. Tests turn it into a skip.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# Binaries each package provides; the cluster needs all of them.
REQUIRED_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel",
                     "munged", "mungekey")
# Job states after which a job will not run again by itself (see `squeue --states`).
FINAL_JOB_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
# Marks our /etc/hosts lines, so lines left by a crashed earlier run can be recognised.
HOSTS_MARKER = "# tape-train slurm test fixture"
# Held (flock) while a cluster runs: one per machine.
LOCK_PATH = Path("/tmp/tape-train-slurm-cluster.lock")
# Ports for the daemons are drawn from this range; train.sbatch derives MASTER_PORT from the
# job id in 15000-29999 and the kernel's ephemeral range starts at 32768, so none collide.
PORT_RANGE = (12000, 14900)


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Overwrite ``path`` with ``data`` in place (/etc/hosts is often a bind mount: no rename),
    writing before truncating the rest: the unchanged prefix stays readable throughout."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def _load_prctl():
    """libc's prctl, resolved now: the child of a fork must not load libraries."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each daemon between fork and exec: the kernel sends it SIGTERM if the test
    process dies without tearing down (SIGKILL, a crash), so no daemon outlives the tests."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


class SlurmUnavailable(RuntimeError):
    """The local cluster cannot run on this machine; the message says why (used as skip reason)."""


@dataclass(frozen=True)
class JobInfo:
    """What `scontrol show job` reports about one job (a subset)."""

    job_id: int
    state: str          # e.g. COMPLETED, FAILED, PENDING, RUNNING
    exit_code: str      # "rc:signal", e.g. "0:0"
    restart_count: int
    node_list: str
    raw: str            # the full `scontrol show job -o` line, for assertion messages


def _sbin_path() -> str:
    """PATH with the sbin directories added (non-login root shells may lack them)."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    for extra in ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        if extra not in parts:
            parts.append(extra)
    return os.pathsep.join(p for p in parts if p)


def _missing_binaries(path: str) -> list[str]:
    return [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]


def ensure_slurm_installed(log=print) -> None:
    """Install Debian's Slurm and munge packages if any binary is missing.

    Raises SlurmUnavailable when not root, when apt-get is absent, or when the install fails.
    """
    path = _sbin_path()
    missing = _missing_binaries(path)
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"Slurm binaries {missing} are missing and installing them "
                               "needs root (the local Slurm cluster runs its daemons as root)")
    if shutil.which("apt-get", path=path) is None:
        raise SlurmUnavailable(f"Slurm binaries {missing} are missing and there is no apt-get "
                               "to install Debian's slurmctld/slurmd/slurm-client/munge")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", PATH=path)
    log(f"[slurm-fixture] installing {' '.join(PACKAGES)} (missing: {', '.join(missing)})")
    for cmd in (["apt-get", "update"],
                ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:"
                                   f"\n{proc.stderr[-2000:]}")
    still_missing = _missing_binaries(path)
    if still_missing:
        raise SlurmUnavailable(f"after installing {PACKAGES}, still missing: {still_missing}")


def _ports_free(ports: list[int]) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


def _pick_port_block(count: int, rng: random.Random) -> int:
    """First port of `count` consecutive free TCP ports inside PORT_RANGE."""
    for _ in range(200):
        base = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - count)
        if _ports_free(list(range(base, base + count))):
            return base
    raise SlurmUnavailable(f"no {count} consecutive free ports in {PORT_RANGE}")


class SlurmCluster:
    """munged + slurmctld + `num_nodes` slurmd daemons under `workdir`, all on loopback.

    Args:
        workdir: an empty directory owned by the test (e.g. from tmp_path_factory); it holds the
            configuration, state, spool, logs and pid files, and the munge socket and key.
        num_nodes: emulated nodes, named `<node_prefix>1..N`, all in partition `partition`.
        cpus_per_node: CPUs each node declares (the machine's real core count does not matter:
            `SlurmdParameters=config_overrides`).
        cred_expire: munge credential lifetime in seconds; a requeued job starts no sooner than
            cred_expire + 1 s, so tests keep it small (Slurm's minimum is 10).
        node_prefix: node name prefix; chosen not to clash with real host names.
        prolog_flags: slurm.conf's `PrologFlags` (e.g. "Contain": every job gets an `extern`
            step at allocation, as sites running pam_slurm_adopt have); None leaves it unset.
    """

    def __init__(self, workdir: Path, num_nodes: int = 4, cpus_per_node: int = 2,
                 cred_expire: int = 10, node_prefix: str = "ttnode", partition: str = "debug",
                 seed: int = 0, prolog_flags: str | None = None):
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if cred_expire < 10:
            raise ValueError(f"cred_expire must be >= 10 s (Slurm's minimum), got {cred_expire}")
        self.workdir = Path(workdir).resolve()
        self.num_nodes = num_nodes
        self.cpus_per_node = cpus_per_node
        self.cred_expire = cred_expire
        self.node_prefix = node_prefix
        self.partition = partition
        self.prolog_flags = prolog_flags
        # Seeded by the workdir too, so two clusters started in one session differ in ports.
        self._rng = random.Random(f"{seed}:{self.workdir}:{os.getpid()}")
        self.node_names = [f"{node_prefix}{k}" for k in range(1, num_nodes + 1)]
        self.conf_path = self.workdir / "etc" / "slurm.conf"
        self.log_dir = self.workdir / "log"
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._hosts_original: bytes | None = None
        self._hosts_path = Path("/etc/hosts")
        self._started = False
        self._previous_sigterm = None
        self._lock_file = None

    # ----------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, ready_timeout: float = 60.0) -> None:
        """Install if needed, configure, start the daemons and wait until every node is idle."""
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local Slurm cluster needs root (munged, slurmd run as "
                                   "root and /etc/hosts gets the node names)")
        ensure_slurm_installed(log=self._log)
        self._take_machine_lock()
        self._started = True
        self._catch_sigterm()
        try:
            self._write_config()
            self._add_hosts_lines()
            self._start_munged()
            self._start_daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf_path)])
            self._wait_for_controller(ready_timeout)
            for name in self.node_names:
                self._start_daemon(f"slurmd-{name}",
                                   ["slurmd", "-D", "-f", str(self.conf_path), "-N", name])
            self._wait_for_idle_nodes(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel jobs, stop every daemon we started (by pid), restore /etc/hosts. Idempotent."""
        if not self._started:
            return
        self._started = False
        try:
            if any(p.poll() is None for n, p in self._procs if n == "slurmctld"):
                self._cancel_all_jobs()
        finally:
            # Reverse order: slurmd before slurmctld before munged.
            for name, proc in reversed(self._procs):
                self._terminate(name, proc)
            self._procs.clear()
            self._restore_hosts()
            self._release_sigterm()
            self._release_machine_lock()

    # ----------------------------------------------------------------------------- commands
    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands (and for jobs: sbatch exports it)."""
        return dict(os.environ, SLURM_CONF=str(self.conf_path), PATH=_sbin_path())

    def run(self, args: list[str], check: bool = True, timeout: float = 60.0,
            env: dict[str, str] | None = None, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; output captured as text."""
        merged = self.env if env is None else {**self.env, **env}
        proc = subprocess.run(args, env=merged, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(args)}` exited {proc.returncode}\nstdout:\n"
                               f"{proc.stdout}\nstderr:\n{proc.stderr}\n{self.diagnostics()}")
        return proc

    def sbatch(self, args: list[str], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> int:
        """Submit with `sbatch --parsable <args>`; returns the job id."""
        out = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip()
        return int(out.split(";")[0])

    def job_info(self, job_id: int) -> JobInfo | None:
        """The job's state from slurmctld, or None when it is no longer known."""
        proc = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if proc.returncode != 0:
            return None
        fields = dict(tok.split("=", 1) for tok in proc.stdout.split() if "=" in tok)
        return JobInfo(job_id=job_id, state=fields.get("JobState", "?"),
                       exit_code=fields.get("ExitCode", "?"),
                       restart_count=int(fields.get("Restarts", "0")),
                       node_list=fields.get("NodeList", ""), raw=proc.stdout.strip())

    def _forgotten(self, job_id: int) -> bool:
        """Whether scontrol says the job id is not one it knows (not a transient failure)."""
        proc = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        return proc.returncode != 0 and "Invalid job id" in proc.stderr

    def wait_for_job(self, job_id: int, timeout: float, poll: float = 1.0,
                     states: frozenset[str] = FINAL_JOB_STATES) -> JobInfo:
        """Poll until the job is in one of `states`; TimeoutError (with diagnostics) if not."""
        deadline = time.monotonic() + timeout
        info = None
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info is not None and info.state in states:
                return info
            if info is None and self._forgotten(job_id):
                raise LookupError(f"job {job_id}: slurmctld no longer knows it (purged, or "
                                  f"never submitted)\n{self.diagnostics()}")
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s; last: "
                           f"{info.raw if info else 'unknown'}\n{self.diagnostics()}")

    def step_end_times(self, job_id: int) -> dict[str, list[str]]:
        """When each step of the job ended, from every slurmd's log: step ("batch", "extern",
        "0", ...) -> the timestamps (ISO, sortable) of its end lines, one per node and run of
        the job, in time order. 22.05 logs `[<job>.<step>] done with job`; 24.11 `[<job>.<step>]
        done with step` (extern) and `[<job>.<step>] stepd_cleanup: done with step (rc[...]...)`."""
        done = re.compile(rf"^\[([0-9T:.-]+)\] \[{job_id}\.(\w+)\] "
                          r"(?:stepd_cleanup: )?done with (?:job|step)\b")
        return self._step_log_times(done)

    def step_signals(self, job_id: int, signum: int) -> dict[str, list[str]]:
        """Which steps of the job slurmstepd was asked to send signal `signum` to, from every
        slurmd's debug log: step -> the timestamps of its `_handle_signal_container for <step>
        uid=U signal=N` lines (22.05 and 24.11 alike; 24.11 adds `flag=0x...`), one per node.
        The request itself: on 24.11 an extern step whose `sleep` a signal killed lives on
        until the job ends, so its end time no longer shows the signal (22.05: it ended)."""
        asked = re.compile(rf"^\[([0-9T:.-]+)\] \[{job_id}\.(\w+)\] debug:\s+"
                           rf"_handle_signal_container for \S+ uid=\d+ signal={signum}\b")
        return self._step_log_times(asked)

    def _step_log_times(self, pattern: re.Pattern) -> dict[str, list[str]]:
        """step -> sorted timestamps of the slurmd log lines `pattern` matches (groups: the
        timestamp, the step)."""
        found: dict[str, list[str]] = {}
        for log in self.log_dir.glob("slurmd-*.log"):
            if log.name.endswith(".stdout.log"):
                continue
            for line in log.read_text(errors="replace").splitlines():
                match = pattern.match(line)
                if match:
                    found.setdefault(match.group(2), []).append(match.group(1))
        return {step: sorted(times) for step, times in found.items()}

    def version(self) -> tuple[int, int]:
        """(major, minor) of the installed Slurm, from `sinfo --version` ("slurm-wlm 24.11.5" on Debian)."""
        out = self.run(["sinfo", "--version"]).stdout
        match = re.search(r"(\d+)\.(\d+)", out)
        if match is None:
            raise RuntimeError(f"`sinfo --version` printed no version: {out!r}")
        return int(match.group(1)), int(match.group(2))

    def diagnostics(self, tail_lines: int = 30) -> str:
        """The last lines of every daemon log, for failure messages."""
        chunks = []
        for log in sorted(self.log_dir.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail_lines:]
            chunks.append(f"--- {log.name} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(chunks)

    # ----------------------------------------------------------------------------- internals
    def _log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def _catch_sigterm(self) -> None:
        """While the cluster runs, SIGTERM (a CI runner stopping pytest) raises
        KeyboardInterrupt, so pytest still tears the fixture down and /etc/hosts is restored."""
        self._previous_sigterm = None
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_sigterm(signum, frame):
                raise KeyboardInterrupt("SIGTERM while the local Slurm cluster was running")
            self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def _release_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _write_config(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "munge"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket directory that others cannot search.
        (self.workdir / "munge").chmod(0o755)
        base = _pick_port_block(self.num_nodes + 1, self._rng)
        ctld_port, first_node_port = base, base + 1
        last_node_port = first_node_port + self.num_nodes - 1
        self.munge_socket = self.workdir / "munge" / "munge.socket"
        if len(str(self.munge_socket)) > 100:   # sun_path holds 108 bytes
            raise ValueError(f"workdir {self.workdir} is too long for the munge socket path "
                             f"({len(str(self.munge_socket))} > 100 characters)")
        host = socket.gethostname().split(".")[0]
        w = self.workdir
        nodes = f"{self.node_prefix}[1-{self.num_nodes}]" if self.num_nodes > 1 \
            else self.node_names[0]
        ports = f"[{first_node_port}-{last_node_port}]" if self.num_nodes > 1 \
            else str(first_node_port)
        lines = [
            "# Written by tests/slurm_cluster.py: a throw-away cluster on loopback, no cgroups.",
            "ClusterName=tapetest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmctldPidFile={w}/run/slurmctld.pid",
            f"SlurmdPidFile={w}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdLogFile={w}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            # debug: slurmstepd logs each signal request it handles, per step (step_signals).
            "SlurmdDebug=debug",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerParameters=bf_interval=1,sched_interval=2",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            # Job records kept for 2 h, the longest module run and more: one of 40 min on a
            # loaded machine outlived MinJobAge=600, and a test waiting for an early job that
            # had ended long before polled a job id the controller had forgotten. (22.05 reads
            # 0, "never purge" in its manual, as "must be at least 2": purged after 2 s.)
            "MinJobAge=7200",
            "ReturnToService=2",
            "JobRequeue=1",
            "MailProg=/bin/true",
            f"NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports} "
            f"CPUs={self.cpus_per_node} RealMemory=2000 State=UNKNOWN",
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        if self.prolog_flags:
            lines.append(f"PrologFlags={self.prolog_flags}")
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _add_hosts_lines(self) -> None:
        original = self._hosts_path.read_bytes()
        kept = [ln for ln in original.decode().splitlines(keepends=True)
                if HOSTS_MARKER not in ln]
        if len(kept) != len(original.decode().splitlines(keepends=True)):
            self._log("[slurm-fixture] removed /etc/hosts lines left by an earlier run")
        base = "".join(kept)
        self._hosts_original = base.encode()
        if base and not base.endswith("\n"):
            base += "\n"
        ours = "".join(f"127.0.1.{k} {name} {HOSTS_MARKER}\n"
                       for k, name in enumerate(self.node_names, start=1))
        try:
            _rewrite_in_place(self._hosts_path, (base + ours).encode())
        except OSError as exc:
            self._hosts_original = None
            raise SlurmUnavailable(f"cannot add the node names to {self._hosts_path}: {exc}")

    def _restore_hosts(self) -> None:
        if self._hosts_original is None:
            return
        _rewrite_in_place(self._hosts_path, self._hosts_original)
        self._hosts_original = None

    def _take_machine_lock(self) -> None:
        import fcntl

        f = open(LOCK_PATH, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise SlurmUnavailable(f"another local test cluster runs on this machine ({holder} "
                                   f"holds {LOCK_PATH}); one at a time: they would share "
                                   f"/etc/hosts and the node names") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        self._lock_file = f

    def _release_machine_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the flock
            self._lock_file = None

    def _start_munged(self) -> None:
        key = self.workdir / "munge" / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], env=self.env, check=True,
                       capture_output=True, timeout=30)
        key.chmod(0o400)
        self._start_daemon("munged", [
            "munged", "--foreground", "--force",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.workdir / 'run' / 'munged.pid'}",
            f"--log-file={self.log_dir / 'munged.log'}",
            f"--seed-file={self.workdir / 'munge' / 'munged.seed'}",
        ])
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not create {self.munge_socket}\n"
                                       f"{self.diagnostics()}")
            time.sleep(0.1)

    def _start_daemon(self, name: str, argv: list[str]) -> None:
        out = open(self.log_dir / f"{name}.stdout.log", "ab")
        # A new session: a Ctrl-C in the test terminal reaches pytest, which then tears down.
        proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)
        out.close()
        self._procs.append((name, proc))

    def _check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{name} exited with code {proc.returncode} at start-up"
                                       f"\n{self.diagnostics()}")

    def _wait_for_controller(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            if self.run(["scontrol", "ping"], check=False, timeout=10).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"slurmctld did not answer `scontrol ping` in {timeout} s"
                                       f"\n{self.diagnostics()}")
            time.sleep(0.2)

    def _wait_for_idle_nodes(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            self._check_alive()
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == self.num_nodes and all(s == "idle" for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"nodes not idle after {timeout} s: {states}\n"
                                       f"{self.diagnostics()}")
            time.sleep(0.2)

    def _cancel_all_jobs(self, timeout: float = 30.0) -> None:
        """scancel every job and wait for their processes to go (slurmd kills by proctrack)."""
        self.run(["scancel", f"--partition={self.partition}"], check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["squeue", "-h", "-o", "%i %T"], check=False).stdout
            if not any(re.search(r"\b(RUNNING|COMPLETING|PENDING|CONFIGURING|REQUEUED)\b", ln)
                       for ln in out.splitlines()):
                return
            time.sleep(0.5)
        self._log(f"[slurm-fixture] jobs still listed after scancel:\n{out}")

    def _terminate(self, name: str, proc: subprocess.Popen, timeout: float = 15.0) -> None:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._log(f"[slurm-fixture] {name} (pid {proc.pid}) ignored SIGTERM; killing it")
            proc.kill()
            proc.wait(timeout=timeout)
