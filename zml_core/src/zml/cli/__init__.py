"""The ``zml`` command line.

``zml demo``                     the main job: a simulated fleet, a burst of traffic, where it went
``zml sim serve CONFIG``         serve a config's loopback nodes as simulated vLLM nodes
``zml sim replay TRACE``         replay a request trace in virtual time, compare routings
``zml serve``                    the gateway: an OpenAI-compatible endpoint over the config's fleet
``zml route --policy P --model M [--explain]``   which node would take a request now, and why
``zml policy check``             validate the config and list its policies
``zml fleet status``             probe every node (/health, /metrics) and show live state

Every command that reads a configuration takes ``--config PATH`` (default: ``$ZML_CONFIG``, else
``./zml.toml``), except ``zml sim serve CONFIG``, which takes it as an argument. Errors
are printed as one clear message and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from zml.cli.values import positive_float, positive_int
from zml.errors import ZMLError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``zml`` command."""
    parser = argparse.ArgumentParser(
        prog="zml", description="Route LLM requests across an accelerator fleet by policy."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config_help = "the zml.toml to use (default: $ZML_CONFIG, else ./zml.toml)"
    demo = sub.add_parser("demo", help="run traffic through a simulated fleet and show routing")
    demo.add_argument("--dir", help="where to write the demo's zml.toml (default: a temp dir)")
    demo.add_argument("--requests", type=positive_int, default=16,
                      help="requests in the concurrent burst (default 16)")
    demo.add_argument("--time-scale", type=positive_float, default=1.0,
                      help="multiply every simulated delay (default 1.0)")

    sim = sub.add_parser("sim", help="the simulated fleet")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True, metavar="SUBCOMMAND")
    serve = sim_sub.add_parser("serve", help="serve the config's loopback nodes until Ctrl-C")
    serve.add_argument("config", help="a zml.toml whose loopback [[nodes]] to serve")
    serve.add_argument("--time-scale", type=positive_float, default=1.0,
                       help="multiply every simulated delay (default 1.0; 0.05 is 20x faster)")
    from zml.cli.replay import add_replay_parser

    add_replay_parser(sim_sub)

    gateway = sub.add_parser("serve", help="serve the OpenAI-compatible gateway (docs: gateway)")
    gateway.add_argument("--config", help=config_help)
    gateway.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    gateway.add_argument("--port", type=int, default=8400, help="port (default 8400)")
    gateway.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")

    route = sub.add_parser("route", help="dry run: which node would take a request now")
    route.add_argument("--policy", help="a policy name from the config (default: no policy)")
    route.add_argument("--model", required=True)
    route.add_argument("--accelerator", help="pin one family instead of a policy (0.2 style)")
    route.add_argument("--explain", action="store_true", help="show the evaluation trace")
    route.add_argument("--probe", action="store_true",
                       help="read each node's /metrics first, so live load counts")
    route.add_argument("--config", help=config_help)

    policy = sub.add_parser("policy", help="policies")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True,
                                       metavar="SUBCOMMAND")
    check = policy_sub.add_parser("check", help="validate the config and list its policies")
    check.add_argument("--config", help=config_help)

    fleet = sub.add_parser("fleet", help="the fleet")
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")
    status = fleet_sub.add_parser("status", help="probe every node and show its state")
    status.add_argument("--config", help=config_help)
    _plugin_commands(sub)
    return parser


def _plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Let installed plugins add subcommands (hook ``zml_register_commands``)."""
    import logging

    from zml.plugins.manager import process_manager

    for impl in process_manager().impls("zml_register_commands"):
        try:
            impl.function(sub)
        except Exception as exc:  # a broken plugin must not take the built-in commands down
            logging.getLogger("zml.plugins").warning(
                "plugin %r failed to add its commands: %s", impl.plugin_name, exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zml`` command; returns the exit status."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning  # (restored when the command returns)
            return _run(argv)
    except KeyboardInterrupt:  # also while the command's modules are still being imported
        return 130  # as a shell reports Ctrl-C: 128 + SIGINT


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                      lineno: int, file: Any = None, line: str | None = None) -> None:
    """A warning as a command shows it: ``zml: warning: ...``, one line, not the
    ``warnings`` module's source path and code line (``ZML_PLUGINS`` naming a missing
    plugin, say)."""
    print(f"zml: warning: {message}", file=sys.stderr)


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from zml.cli.output import CommandError, print_error, stderr_console

    try:
        handler = getattr(args, "handler", None)
        if handler is not None:
            return int(handler(args))
        if args.command == "demo":
            from zml.cli.demo import run_demo

            return run_demo(directory=args.dir, burst=args.requests, time_scale=args.time_scale)
        if args.command == "serve":
            from zml.gateway.server import serve

            return serve(args.config, host=args.host, port=args.port, workers=args.workers)
        from zml.cli import commands

        if args.command == "sim":
            return commands.sim_serve(args.config, time_scale=args.time_scale)
        if args.command == "route":
            return commands.route(args.config, args.policy, args.model, args.accelerator,
                                  explain=args.explain, probe=args.probe)
        if args.command == "policy":
            return commands.policy_check(args.config)
        if args.command == "fleet":
            return commands.fleet_status(args.config)
    except ZMLError as exc:
        print_error(stderr_console(), type(exc).__name__, str(exc))
        return 2
    except CommandError as exc:
        print_error(stderr_console(), "", str(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    return 2  # pragma: no cover - argparse rejects unknown commands first


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
