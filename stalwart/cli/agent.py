"""``stalwart agent -- CMD...``: the worker pod's entrypoint (see :mod:`stalwart.agent.runner`)."""

from __future__ import annotations

import argparse
import logging
import sys

from stalwart import exits

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "agent", help="run this pod's rank processes (the worker container's entrypoint)",
        description="Join the job's rendezvous, run CMD as the pod's rank processes with torchrun's "
                    "environment, restart them on failure, report progress. Reads the STALWART_* pod "
                    "environment. Exit code: the job's outcome on this pod (see stalwart.api.exit_codes).")
    p.add_argument("--max-restarts", type=int, default=10,
                   help="process restarts this pod may do before it gives up (default 10)")
    p.add_argument("--term-grace", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL for the rank processes (default 30)")
    p.add_argument("--finish-grace", type=float, default=60.0,
                   help="seconds a rank process that returned from the training function may take to exit before "
                        "it is killed, its work kept (default 60)")
    p.add_argument("--last-call", type=float, default=5.0,
                   help="seconds a round waits for more nodes once min nodes are present (default 5)")
    p.add_argument("--node-ttl", type=int, default=None,
                   help="TTL in seconds of this node's rendezvous lease (default: the job's "
                        "rendezvous.leaseTTLSeconds, 10 for a job without the operator's record)")
    p.add_argument("--relay-linger", type=float, default=None,
                   help="seconds a rank's barrier request waits at this pod's relay for the pod's other ranks "
                        "(default 0.02; 0 sends each at once, as it comes)")
    p.add_argument("--spare-ranks", action="store_true",
                   help="on a spare pod, run the ranks as in-process spares (scripts using stalwart.restartable)")
    p.add_argument("--warm-spares", action="store_true",
                   help="keep the rank processes across rounds and start a spare's parked (also on when the "
                        "job's restartPolicy.inProcess.warmSpares is)")
    p.add_argument("--no-fork-server", action="store_true",
                   help="start every rank process fresh (by default a process of the pod imports torch once and "
                        "the ranks are forked from it; STALWART_FORK_SERVER=false in the container does the same)")
    p.add_argument("--no-standby", action="store_true",
                   help="keep no parked standby process in the pod (by default, with warm spares on, one waits "
                        "behind the ranks to take the place of one that dies; STALWART_STANDBY=false in the "
                        "container does the same)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the training command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stalwart.agent.runner import Agent
    from stalwart.agent.settings import PodSettings
    from stalwart.agent.tuning import AgentTuning

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("stalwart agent: give the training command after `--`", file=sys.stderr)
        return 2
    try:
        settings = PodSettings.from_env()
        options = AgentTuning(max_restarts=args.max_restarts, term_grace=args.term_grace,
                              finish_grace=args.finish_grace,
                              last_call_timeout=args.last_call, node_ttl=args.node_ttl,
                              spare_ranks=args.spare_ranks, warm_spares=args.warm_spares,
                              fork_server=settings.fork_server and not args.no_fork_server,
                              standby=settings.standby and not args.no_standby,
                              **({} if args.relay_linger is None else {"relay_linger": args.relay_linger}))
    except ValueError as e:  # the pod contract's PodEnvError among them
        print(f"stalwart agent: invalid settings:\n{e}", file=sys.stderr)
        return 2
    agent = Agent(settings, command, options)
    exits.set_context(f"job={settings.job} node={settings.node_id}")
    agent.install_signal_handlers()
    return agent.run(decided=exits.decided)
