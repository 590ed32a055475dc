"""``stalwart crd``: print the TrainingJob CustomResourceDefinition (what ``crds/trainingjob.yaml`` holds)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("crd", help="print the TrainingJob CustomResourceDefinition")
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                        help="output format (default yaml)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stalwart.api.crd import crd_json, crd_yaml

    sys.stdout.write(crd_yaml() if args.output == "yaml" else crd_json())
    return 0
