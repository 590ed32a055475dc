"""The ``stalwart`` command line: one entry point, one module per sub-command.

Each module in :data:`COMMANDS` exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed args, returning the exit code) as the parser default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from stalwart import exits

COMMANDS = ["dev", "crd", "validate", "local", "agent", "operator", "demo", "drill"]


#: What ``--log-level`` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(value: str) -> str:
    """``--log-level``'s value, upper-cased; a bad one is argparse's usage error (exit 2) naming the choices."""
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)} (any case), got {value!r}")
    return value.upper()


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``message``,
    and ``exception`` when there is one. The message keeps its context (job, node, rank, round, epoch)."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime
        import json

        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                   timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def version() -> str:
    """The installed distribution's version (``unknown`` when run from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("stalwart")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart", description="Fault-tolerant distributed PyTorch training on Kubernetes: the operator, "
                                     "the pods' agent, a local cluster, fault drills and the demo.")
    parser.add_argument("--version", action="version", version=f"stalwart {version()}")
    parser.add_argument("--log-level", default="INFO", type=log_level, metavar="LEVEL",
                        help=f"logging level: {', '.join(LOG_LEVELS)} (default INFO)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text lines, or one JSON object per line (time, level, logger, message) for a log "
                             "collector (default text)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"stalwart.cli.{name}").register(sub)
    _describe(parser)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Every sub-command below ``parser`` (``"local up"``...), with its parser and its one-line help."""
    found: dict[str, tuple[argparse.ArgumentParser, str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, child in action.choices.items():
                found[name] = (child, helps.get(name, ""))
                found |= {f"{name} {k}": v for k, v in subcommands(child).items()}
    return found


def _describe(parser: argparse.ArgumentParser) -> None:
    # `stalwart crd --help` says what `stalwart --help` says of crd, where the command gives no description.
    for child, help_ in subcommands(parser).values():
        if not child.description and help_:
            child.description = help_[0].upper() + help_[1:] + ("" if help_.endswith(".") else ".")


#: The commands that run as a pod's or a cluster's long-lived process (the agent, the operator) or hold a job's
#: streams (the drill): each leaves through :func:`stalwart.exits.leave`, so it is gone within a bound of
#: deciding to exit, whatever a library's finaliser does. The others (the local cluster's, the demo's) end
#: their own child processes on the way out and exit as usual.
BOUNDED_EXIT = frozenset({"agent", "operator", "drill"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if args.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    code: int = args.func(args)
    return code


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``stalwart`` program: :func:`main`, then the exit (bounded for :data:`BOUNDED_EXIT`)."""
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if w in COMMANDS), "")
    try:
        code = main(words)
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    if command in BOUNDED_EXIT:
        exits.leave(code)
    sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
