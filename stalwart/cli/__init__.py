"""The ``stalwart`` command line: one entry point, one module per sub-command.

Each module in :data:`COMMANDS` exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed args, returning the exit code) as the parser default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

COMMANDS = ["dev", "crd", "validate", "local", "agent", "operator", "demo", "drill"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stalwart", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"stalwart.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
