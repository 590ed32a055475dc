"""``stalwart validate -f FILE``: check TrainingJob manifests without a cluster.

Exit 0 when every document of every file is a valid TrainingJob; otherwise exit 1 and print one line per
problem, ``FILE[#DOC]: field.path: message`` (``#DOC``, 1-based, only for files with several documents).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = ("Check TrainingJob manifests without a cluster. Exit 0 when every document of every file is a "
               "valid TrainingJob; otherwise exit 1 and print one line per problem: "
               "FILE[#DOC]: field.path: message (#DOC, 1-based, only for files with several documents).")


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "validate", help="validate TrainingJob manifests (exit 1 and one line per problem)",
        description=DESCRIPTION)
    parser.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                        help="manifest file (multi-document YAML); '-' reads standard input; repeatable")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stalwart.api.validation import Problem, text_problems

    problems: list[Problem] = []
    documents = 0
    for name in args.filename:
        try:
            if name == "-":
                text = sys.stdin.read()
            else:
                with open(name, encoding="utf-8") as handle:
                    text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(Problem(name, None, "", f"cannot read: {exc}"))
            continue
        count, found = text_problems(name, text)
        documents += count
        problems.extend(found)
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(f"{documents} TrainingJob{'s' if documents != 1 else ''} valid", file=sys.stderr)
    return 0
