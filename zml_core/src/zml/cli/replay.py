"""``zml sim replay TRACE --config zml.toml``: replay a trace in virtual time, compare routings.

Each ``--policy NAME`` and ``--strategy NAME`` is one row, replayed on a fresh copy of the
config's fleet (node models built from ``[[nodes]]`` and their ``sim`` tables): policy rows
through the production core on a virtual clock (:mod:`zml.sim.virtual`), strategy rows on the
replay engine (:mod:`zml.sim.rows`). ``--live`` sends the policy rows in real time to the
config's nodes instead (:mod:`zml.sim.live`). Without
``--policy`` or ``--strategy``, every policy of the config and every baseline strategy is replayed. Bad input (a
missing or malformed trace, an unknown policy or strategy, a rate scale <= 0, an infinite
``--slo-ms``, a ``--json`` or ``--plot`` path that cannot be written, a ``--plot`` that does not
end in ``.png`` or ``.html``, a ``.png`` plot without matplotlib) is one clear message and exit
status 2, found before anything is replayed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from zml.errors import InvalidRequestError, PolicyConfigError

__all__ = ["add_replay_parser", "check_output_path", "run_replay"]

RATE_SCALE_MIN = 0.001
"""The slowest ``--rate-scale``: a trace a thousand times slower."""
RATE_SCALE_MAX = 1000.0
"""The fastest ``--rate-scale``: a trace a thousand times faster."""


def add_replay_parser(sim_sub: Any) -> None:
    """Add ``replay`` to the ``zml sim`` subcommands."""
    p = sim_sub.add_parser("replay", help="replay a request trace in virtual time against the "
                           "config's fleet and compare policies and strategies")
    p.add_argument("trace", help="an Azure CSV, Mooncake JSONL or zml JSONL trace")
    p.add_argument("--config", help="the zml.toml whose [[nodes]] to model (default: "
                   "$ZML_CONFIG, else ./zml.toml)")
    p.add_argument("--policy", action="append", default=[], metavar="NAME",
                   help="a row routed by this policy of the config (repeatable)")
    p.add_argument("--strategy", action="append", default=[], metavar="NAME",
                   help="a row routed by a baseline strategy: round_robin, random, least_busy, "
                   "latency_based (repeatable)")
    p.add_argument("--rate-scale", type=float, default=1.0, metavar="X",
                   help="multiply the arrival rate (2: the trace twice as fast; "
                   f"{RATE_SCALE_MIN:g} to {RATE_SCALE_MAX:g})")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--model", help="the model of rows that name none (default: the config's "
                   "only model)")
    p.add_argument("--slo-ms", type=float, metavar="MS", help="TTFT target for rows without "
                   "one (default: the first policy's latency_target_ms)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT", help="draw TTFT CDFs and family shares to OUT, "
                   "which ends in .png (needs matplotlib) or .html")
    p.add_argument("--seed", type=int, default=0, help="seed of the routers' random choices")
    p.add_argument("--live", action="store_true", help="send the trace in real time to the "
                   "config's nodes (simulated or real) with zml.AsyncClient instead of "
                   "modelling them (policy rows)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="--live: requests in flight at most (default 64)")
    p.add_argument("--time-scale", type=float, default=None, metavar="X",
                   help="--live: the --time-scale the simulated nodes run with (waits are "
                   "scaled by it, figures reported in the trace's seconds)")
    p.set_defaults(handler=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    """The command's body; returns the exit status (ZMLErrors are printed by ``zml.cli``)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )

    from zml.config import discover_path, load_registry, suggest
    from zml.policy import validate_policy_tables
    from zml.sim.replay import ReplayRun
    from zml.sim.report import check_plot, plot, replay_document, rich_table, summarize
    from zml.sim.rows import plan_rows, run_row
    from zml.sim.traces import read_trace
    from zml.strategies import STRATEGIES

    if not (math.isfinite(args.rate_scale) and args.rate_scale > 0):
        raise InvalidRequestError(f"--rate-scale must be a number > 0, got {args.rate_scale!r}",
                                  param="rate_scale")
    if not RATE_SCALE_MIN <= args.rate_scale <= RATE_SCALE_MAX:
        raise InvalidRequestError(
            f"--rate-scale must be from {RATE_SCALE_MIN:g} to {RATE_SCALE_MAX:g}, got "
            f"{args.rate_scale:g}: beyond, the trace's times lose their precision (every "
            "request at once, or hours apart) and the figures mean nothing", param="rate_scale")
    if args.limit is not None and args.limit < 1:
        raise InvalidRequestError(f"--limit must be >= 1, got {args.limit!r}", param="limit")
    for flag, given in (("--concurrency", args.concurrency), ("--time-scale", args.time_scale)):
        if given is not None and not args.live:
            raise InvalidRequestError(
                f"{flag} applies only to a --live replay (a modelled one has no requests in "
                f"flight nor node time scale): add --live, or leave {flag} out",
                param=flag[2:].replace("-", "_"))
    args.concurrency = 64 if args.concurrency is None else args.concurrency
    args.time_scale = 1.0 if args.time_scale is None else args.time_scale
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise InvalidRequestError(f"--time-scale must be a number > 0, got {args.time_scale!r}",
                                  param="time_scale")
    if args.concurrency < 1:
        raise InvalidRequestError(f"--concurrency must be >= 1, got {args.concurrency!r}",
                                  param="concurrency")
    if args.slo_ms is not None and not (math.isfinite(args.slo_ms) and args.slo_ms > 0):
        raise InvalidRequestError(f"--slo-ms must be a finite number > 0, got {args.slo_ms!r}",
                                  param="slo_ms")
    for flag, out_path in (("--json", args.json), ("--plot", args.plot)):
        if out_path is not None:
            check_output_path(flag, out_path)
    if args.plot is not None:
        check_plot(args.plot, load=False)  # the extension now; matplotlib before the trace
    for name in args.strategy:
        if name not in STRATEGIES:
            hint = suggest(name, STRATEGIES)
            raise InvalidRequestError(
                f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}"
                + (f" (did you mean {hint!r}?)" if hint else ""), param="strategy")
    path = discover_path(args.config)
    if path is None:
        raise PolicyConfigError("no zml.toml found: pass --config PATH (or set ZML_CONFIG)",
                                field="config")
    registry = load_registry(path)
    if not registry.nodes:
        raise PolicyConfigError(f"{path}: no [[nodes]] to replay against", field="nodes")
    policies = validate_policy_tables(registry)
    for name in args.policy:
        if name not in policies:
            hint = suggest(name, policies)
            known = ", ".join(policies) or "none"
            raise PolicyConfigError(f"{path}: no policy {name!r} (policies: {known})"
                                    + (f"; did you mean {hint!r}?" if hint else ""),
                                    field="policy", value=name, suggestion=hint)
    models = sorted({m for n in registry.nodes for m in n.models})
    model = args.model
    if model is None:
        if len(models) != 1:
            raise InvalidRequestError(f"the config serves several models ({', '.join(models)}); "
                                      "pass --model for trace rows that name none", param="model")
        model = models[0]
    elif model not in models:
        raise InvalidRequestError(f"no node of the config serves --model {model!r} (models: "
                                  f"{', '.join(models)})", param="model")
    if args.plot is not None:
        check_plot(args.plot)  # a .png needs matplotlib: say so now, not after the replay
    arrivals = list(read_trace(args.trace, limit=args.limit))
    if not arrivals:
        raise InvalidRequestError(f"{args.trace}: the trace has no requests", param="trace")

    chosen_policies = args.policy or ([] if args.strategy else list(policies))
    chosen_strategies = args.strategy or ([] if args.policy or args.live else list(STRATEGIES))
    if args.live and args.strategy:
        raise InvalidRequestError(
            "--live replays policy rows only (a baseline strategy is a virtual-time row); "
            "drop --strategy, or give a policy of the config a strategy and pass --policy",
            param="strategy")
    rows = plan_rows(policies, chosen_policies, chosen_strategies, args.slo_ms)

    console = Console(stderr=True)
    runs: list[ReplayRun] = []
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        for row in rows:
            task = progress.add_task(f"{row.kind} {row.name}", total=len(arrivals))

            def advance(n: int, task: TaskID = task) -> None:
                progress.update(task, completed=n)

            if args.live:
                runs.append(_live_row(path, registry, row.name, row.slo_ms, arrivals, model,
                                      args, advance))
            else:
                runs.append(run_row(row, arrivals, registry, policies, default_model=model,
                                    rate_scale=args.rate_scale, seed=args.seed,
                                    progress=advance))
    wall = time.perf_counter() - started
    results = [summarize(run) for run in runs]
    virtual = max(run.virtual_s for run in runs)
    out = Console()
    if not out.is_terminal:  # a file or a pipe: do not squeeze the table into 80 columns
        out = Console(width=max(out.width, 200))
    mode = "s of trace time live" if args.live else "s virtual"
    out.print(rich_table(results, title=f"{args.trace}: {len(arrivals):,} requests x "
                         f"{args.rate_scale:g} rate, {virtual:,.0f} {mode} in {wall:.1f} s"))
    try:
        if args.json:
            doc = replay_document(str(args.trace), len(arrivals), wall, virtual, results)
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
            out.print(f"results written to {args.json}")
        if args.plot:
            plot(runs, args.plot)
            out.print(f"plot written to {args.plot}")
    except OSError as exc:  # checked before the replay, but the folder may have changed since
        raise InvalidRequestError(f"cannot write {exc.filename or 'the output'}: "
                                  f"{exc.strerror or exc}", param="output") from None
    return 0


def check_output_path(flag: str, value: str) -> None:
    """Refuse an output path that cannot be written (before the replay, not after it).

    Raises:
        InvalidRequestError: ``value`` is empty, a directory, in a folder that does not exist or
            is not writable, or an existing file that is not writable.
    """
    path = Path(value)
    parent = path.parent
    problem: str | None = None
    try:
        if not value:
            problem = "is empty; name the file to write"
        elif value.endswith(os.sep) or path.is_dir():
            example = path / ("results.json" if flag == "--json" else "plot.html")
            problem = f"is a directory, not a file; name a file in it, e.g. {str(example)!r}"
        elif not parent.is_dir():
            what = "is not a folder" if parent.exists() else "does not exist"
            problem = f"cannot be created: {str(parent)!r} {what}"
        elif not os.access(parent, os.W_OK | os.X_OK):
            problem = f"cannot be created: the folder {str(parent)!r} is not writable"
        elif path.exists() and not os.access(path, os.W_OK):
            problem = "exists and is not writable"
    except (OSError, ValueError) as exc:  # a name too long, a NUL character...
        problem = f"is not a usable path ({getattr(exc, 'strerror', None) or exc})"
    if problem is not None:
        raise InvalidRequestError(f"{flag} {value!r} {problem}", param=flag.lstrip("-"))


def _live_row(path: Any, registry: Any, name: str, slo_ms: float | None, arrivals: Any,
              model: str, args: argparse.Namespace, progress: Any) -> Any:
    """One policy row sent in real time with a fresh AsyncClient (its own fleet state)."""
    import asyncio

    from zml import AsyncClient
    from zml.sim.live import replay_live

    async def main() -> Any:
        async with AsyncClient(config=path) as client:
            return await replay_live(
                arrivals, client, registry, name=name, kind="policy", policy=name,
                default_model=model, rate_scale=args.rate_scale, time_scale=args.time_scale,
                concurrency=args.concurrency, slo_ms=slo_ms, progress=progress)

    return asyncio.run(main())
