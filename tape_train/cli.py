"""Console entry points. Each one imports its subsystem lazily so `--help` stays fast.

Every command answers ``--version`` here, before its subsystem is imported; neither that nor
``--help`` imports torch (tests/test_train_startup.py holds them to it).

Exit codes, the same for every command: 0 done; 2 a command line argparse refuses (an unknown,
missing or malformed option: ``usage:`` and ``<command>: error: ...``); 1 every other error,
one ``<command>: error: ...`` line naming the path, key or value at fault: a file or checkpoint
that is missing, damaged or incomplete, an option value the command checks itself, a full
disk, a failed run; 130 Ctrl-C (SIGINT), 141 a closed stdout (SIGPIPE). tape-train adds 75
(stopped on SIGUSR1/SIGTERM after a checkpoint: requeue).
"""

from __future__ import annotations

import importlib
import os
import sys


def _run(module: str, torch_here: bool = True) -> None:
    """``torch_here``: the command computes with torch on this machine (not tape-data or
    tape-submit, whose environment may be meant for other nodes)."""
    args = sys.argv[1:]
    own = args[:args.index("--")] if "--" in args else args  # after "--": another program's
    if "--version" in own:
        from tape_train import __version__

        print(f"{os.path.basename(sys.argv[0])} {__version__}")
        sys.exit(0)
    if torch_here and "--help" not in own and "-h" not in own:
        from tape_train.machine_cache import isa_limit_error

        if error := isa_limit_error():
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
            sys.exit(1)
    try:
        code = importlib.import_module(module).main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of stdout went away (`tape-model info tiny | head -1`): end as a command
        # killed by SIGPIPE does, without a traceback or a failed flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + 13)  # 13: SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C where the command has no handler of its own (tape-eval, tape-export, start-up
        # of any): one line, not a traceback through whatever was running. What they write
        # for a reader appears whole or not at all (files.write_atomic, export directories
        # renamed into place), so there is nothing half-written to mention.
        print(f"{os.path.basename(sys.argv[0])}: interrupted (Ctrl-C)", file=sys.stderr,
              flush=True)
        sys.exit(128 + 2)  # 2: SIGINT
    sys.exit(code)


def model_main() -> None:
    _run("tape_train.model.cli")


def tokenizer_main() -> None:
    _run("tape_train.data.tokenizer_cli", torch_here=False)


def data_main() -> None:
    _run("tape_train.data.cli", torch_here=False)


def train_main() -> None:
    _run("tape_train.train.cli")


def eval_main() -> None:
    _run("tape_train.eval.cli")


def submit_main() -> None:
    _run("tape_train.cluster.submit", torch_here=False)


def export_main() -> None:
    _run("tape_train.inference.export")


def generate_main() -> None:
    _run("tape_train.inference.generate")
