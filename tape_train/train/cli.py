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
import sys

from tape_train.config import ConfigError, load_run_config


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"tape-train: config error: {exc}", file=sys.stderr)
        return 1
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from tape_train.train.loop import Trainer

    return Trainer(cfg, resume_from=args.resume_from,
                   allow_config_change=args.allow_config_change).run()


if __name__ == "__main__":
    sys.exit(main())
