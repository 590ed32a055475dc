"""``stalwart dev etcd``: a real etcd server on loopback for manual development."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any


def register(sub: Any) -> None:
    dev = sub.add_parser("dev", help="development helpers")
    dsub = dev.add_subparsers(dest="dev_command", required=True, metavar="WHAT")
    etcd = dsub.add_parser("etcd", help="run a real etcd server on loopback until interrupted")
    etcd.add_argument("--data-dir", help="data directory (default: a temporary one, removed on exit)")
    etcd.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    etcd.set_defaults(func=run_etcd)


def run_etcd(args: argparse.Namespace) -> int:
    from stalwart.local.etcd import EtcdServer

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = EtcdServer(args.data_dir, client_port=args.port)
    server.start()
    try:
        print(f"etcd is serving on {server.endpoint}", flush=True)
        print(f"export STALWART_ETCD_ENDPOINTS={server.endpoint}", flush=True)
        while not stop.wait(1.0):
            if server.process is None or server.process.poll() is not None:
                print("etcd exited", flush=True)
                return 1
    finally:
        server.cleanup()
    return 0
