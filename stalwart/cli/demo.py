"""``stalwart demo``: the README's main command (see :mod:`stalwart.demo`)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="run the whole path on a local cluster: helm install, a TrainingJob, two faults, recovery",
        description="Start the local cluster, install the Helm chart, run examples/minimal.yaml (2 workers + "
                    "1 spare), inject a rank exception and later kill a worker pod, show `kubectl get tj` "
                    "as it goes, and end with the job Succeeded and the measured recovery times.")
    p.add_argument("--dir", type=Path, default=None,
                   help="directory of the local cluster (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running at the end, for kubectl")
    p.add_argument("--steps", type=int, default=300, help="training steps of the job (default 300)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default 600)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stalwart.demo import DemoError, DemoOptions, run_demo

    try:
        opts = DemoOptions(directory=args.dir or Path("."), keep=args.keep, steps=args.steps,
                           timeout=args.timeout, fail_at_step=args.steps // 5, kill_at_step=args.steps // 2)
    except ValueError as e:
        print(f"stalwart demo: {e}", file=sys.stderr)
        return 2
    directory = args.dir or Path(tempfile.mkdtemp(prefix="stalwart-demo-"))
    opts = dataclasses.replace(opts, directory=directory)
    try:
        result = run_demo(opts)
    except DemoError as e:
        print(f"stalwart demo: {e} (cluster files and logs: {directory})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if result.phase != "Succeeded":
        print(f"stalwart demo: the job ended {result.phase} (cluster files and logs: {directory})", file=sys.stderr)
        return 1
    if args.dir is None and not args.keep:
        # A temporary directory of our own, with nothing left running in it.
        shutil.rmtree(directory, ignore_errors=True)
    return 0
