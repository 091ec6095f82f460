"""``tape-train --config <yaml> [section.key=value ...]``: train (or resume) one run.

Launch under ``torchrun`` for several processes (``launch/local.sh N ...`` on one machine) or
run directly for one process. Re-running the same command resumes from the latest complete
checkpoint of ``train.run_dir``.

Exit codes: 0 finished; 75 stopped on SIGUSR1/SIGTERM after a checkpoint (requeue); 130
stopped on Ctrl-C after a checkpoint; 1 error (bad config, failed checkpoint, too many
non-finite losses, ...).
"""

from __future__ import annotations

import argparse
import os
import sys

from tape_train.config import ConfigError, load_run_config
from tape_train.hints import example_on_missing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tape-train", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="overrides: dotted keys with YAML values, e.g. model.pe=rope train.lr=3e-4 "
               "eval.lengths=[256,512]")
    parser.add_argument("--config", required=True, help="run config YAML, or the name of a shipped one "
                                                       "(demo, 125m: configs/train/<name>.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--resume-from", default=None,
                        help="run dir, checkpoint root or checkpoint tag dir to resume from "
                             "(default: the latest complete checkpoint of train.run_dir)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even if model/data/batch settings differ from the "
                             "checkpoint's config")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    dry = parser.add_argument_group(
        "preflight", "--dry-run checks the config, rank grid, tokenizer, data, held-out "
        "lengths, run dir and resume, and prints the plan (memory per rank, FLOPs, step "
        "time), in seconds and without DeepSpeed; exit 1 on any problem")
    dry.add_argument("--dry-run", action="store_true", help="check and plan, do not train")
    dry.add_argument("--world-size", type=int, default=None,
                     help="plan for this many ranks (default: nodes x gpus-per-node, "
                          "else WORLD_SIZE, else 1)")
    dry.add_argument("--gpus-per-node", type=int, default=None,
                     help="plan for CUDA nodes with this many GPUs (0: CPU nodes)")
    dry.add_argument("--nodes", type=int, default=None,
                     help="with --gpus-per-node: world size = nodes x gpus-per-node "
                          "(default: 1 node)")
    dry.add_argument("--device-memory-gb", type=float, default=None,
                     help="memory per device to plan against (default: this machine's)")
    dry.add_argument("--gpu-name", default=None,
                     help="GPU model to plan for when this machine has none (e.g. H100)")
    dry.add_argument("--assume-mfu", type=float, default=None,
                     help="MFU assumed for the step-time estimate (default 0.4)")
    return example_on_missing(parser, "tape-train --config demo   (the demo recipe; `make demo` "
                                      "builds its data)")


def main(argv: list[str] | None = None) -> int:
    launcher = os.getppid()  # as early as can be: compared again once the watch is set up
    args = build_parser().parse_intermixed_args(argv)  # overrides may follow options
    try:
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as exc:
        from tape_train.devices import speaks_for_node

        if speaks_for_node():  # every rank meets it: said once per node, not once per rank
            print(f"tape-train: config error: {exc}", file=sys.stderr)
        return 1
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if args.dry_run:
        return dry_run(cfg, args)
    from tape_train.devices import LaunchError, check_launch_environment

    try:  # before anything starts: a WORLD_SIZE left in the shell, a mistyped RANK
        check_launch_environment()
    except LaunchError as exc:
        print(f"tape-train: error: {exc}", file=sys.stderr)
        return 1
    from tape_train.train.signals import StopRequest, launcher_watch_wanted, stop_with_launcher

    # Before torch and DeepSpeed are imported (seconds): a stop signal from here on is
    # remembered and ends the start-up at its next phase with exit 75, never a bare SIGTERM death.
    stop = StopRequest().install()
    # A launcher killed outright (SIGKILL) would leave this process training on: its death
    # is a SIGTERM here, the same stop (tape_train/train/signals.py).
    if launcher_watch_wanted():
        stop.launcher = launcher  # before: the watch may signal at once (launcher gone already)
        if not stop_with_launcher(launcher):
            stop.launcher = None
    from tape_train.train.distributed import end_rank
    from tape_train.train.loop import Trainer

    return end_rank(Trainer(cfg, resume_from=args.resume_from,
                            allow_config_change=args.allow_config_change, stop=stop,
                            choose_cpu_threads=True).run())


def dry_run(cfg, args: argparse.Namespace) -> int:
    """``--dry-run``: the resolved config, then the preflight plan; 1 if anything is wrong."""
    from tape_train.devices import LaunchError, launch_int
    from tape_train.train.preflight import (DEFAULT_ASSUMED_MFU, format_report,
                                            run_preflight)

    for flag, value, least in (("--nodes", args.nodes, 1),
                               ("--gpus-per-node", args.gpus_per_node, 0)):
        if value is not None and value < least:
            print(f"tape-train: {flag} must be >= {least}, got {value}", file=sys.stderr)
            return 1
    world = args.world_size
    if args.gpus_per_node:  # one node unless --nodes says more
        gpus = (args.nodes or 1) * args.gpus_per_node
        if world is not None and world > gpus:
            print(f"tape-train: --world-size {world} is more ranks than --nodes {args.nodes or 1}"
                  f" x --gpus-per-node {args.gpus_per_node} = {gpus} GPUs", file=sys.stderr)
            return 1
        world = gpus if world is None else world  # fewer ranks than GPUs: --world-size wins
    if world is not None and args.nodes and world % args.nodes:
        print(f"tape-train: --world-size {world} ranks do not split evenly over --nodes "
              f"{args.nodes}", file=sys.stderr)
        return 1
    if world is None:
        try:
            world = launch_int("WORLD_SIZE")
        except LaunchError as exc:
            print(f"tape-train: {exc}", file=sys.stderr)
            return 1
    if world < 1:
        print(f"tape-train: --world-size must be >= 1, got {world}", file=sys.stderr)
        return 1
    mfu = DEFAULT_ASSUMED_MFU if args.assume_mfu is None else args.assume_mfu
    if not 0 < mfu <= 1:
        print(f"tape-train: --assume-mfu must be in (0, 1], got {mfu}", file=sys.stderr)
        return 1
    memory = args.device_memory_gb
    if memory is not None and not 0 < memory < float("inf"):
        print(f"tape-train: --device-memory-gb must be a finite number > 0, got {memory}",
              file=sys.stderr)
        return 1
    print("# resolved config")
    print(cfg.to_yaml(), end="")
    print("# preflight plan")
    report = run_preflight(cfg, world_size=world, gpus_per_node=args.gpus_per_node,
                           resume_from=args.resume_from,
                           allow_config_change=args.allow_config_change,
                           device_memory_gb=args.device_memory_gb, gpu_name=args.gpu_name,
                           assumed_mfu=mfu,
                           ranks_per_node=max(1, world // args.nodes) if args.nodes else None)
    out, err = format_report(report)
    sys.stdout.write(out)
    sys.stdout.flush()
    sys.stderr.write(err)
    if report.problems:
        print(f"tape-train: preflight: {len(report.problems)} problem(s); nothing was started",
              file=sys.stderr)
        return 1
    print("preflight: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
