"""``python -m example_project demo``: run the shop end to end (see README.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .demo import DemoOptions, run


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="python -m example_project")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="two workers and beat capture orders; one is paused, one killed; prints a summary",
    )
    demo.add_argument("--orders", type=int, default=30, help="orders to capture (default 30)")
    demo.add_argument(
        "--workdir",
        type=Path,
        help="directory for the SQLite file, broker folder and logs (default: a temp dir)",
    )
    demo.add_argument("--keep", action="store_true", help="keep the temp dir after success")
    demo.add_argument(
        "--timeout", type=float, default=150.0, help="give up after this many seconds"
    )
    args = parser.parse_args(argv)
    if args.orders < 10:
        parser.error("--orders must be at least 10 (the story needs work in flight)")
    return run(DemoOptions(args.orders, args.workdir, args.keep, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
