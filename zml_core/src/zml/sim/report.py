"""The results of a replay: one row per policy or strategy, as JSON, a rich table and plots.

Kept apart from the engine so that any driver producing :class:`zml.sim.replay.Outcome` lists
(virtual-time replay, a live run against real nodes) reports the same figures the same way.

Per row (``summarize``):

* ``requests``, ``completed``, ``errors`` (count per ``final_error``);
* ``ttft_ms`` p50/p90/p99 and ``e2e_ms`` p50/p99, over completed requests (linear
  interpolation between closest ranks; null when none completed);
* ``slo_attainment``: the share of *all* requests whose TTFT met ``slo_ms`` (errors are
  misses; null when there is no target);
* ``share_by_family``: the share of all requests placed on each family;
* ``prefix_cache_hit_rate``: prompt tokens served from prefix caches / prompt tokens prefilled,
  over the fleet (a ``--live`` run: as the nodes' usage reports it, null when it does not);
* ``cost_usd``: the sum of the requests' attributed costs (the default cost model of
  ``response.routing.cost``: ``cost_per_1k_tokens`` x tokens, else ``cost_per_hour`` x the time
  the request held its slot / ``max_concurrency``), and ``usd_per_1m_output_tokens`` (over
  the output tokens of completed requests).

The JSON document (``replay_document``)::

    {"trace": str, "requests": int, "wall_s": float, "virtual_s": float,
     "results": [{"name", "kind", "requests", "completed", "errors", "ttft_ms", "e2e_ms",
                  "slo_ms", "slo_attainment", "share_by_family", "prefix_cache_hit_rate",
                  "cost_usd", "usd_per_1m_output_tokens"}, ...]}
"""

from __future__ import annotations

import html
import importlib
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zml.errors import InvalidRequestError, ZMLError
from zml.sim.model import hit_rate
from zml.sim.replay import Outcome, ReplayRun

__all__ = ["PLOT_FORMATS", "PlotUnavailable", "check_plot", "percentile", "plot",
           "replay_document", "rich_table", "summarize"]

PLOT_FORMATS: tuple[str, ...] = (".png", ".html")
"""The extensions :func:`plot` writes (in any case): a matplotlib PNG, or a self-contained
HTML page."""


class PlotUnavailable(ZMLError):
    """``--plot OUT.png`` needs matplotlib (``pip install 'zmlai[plot]'``)."""


def check_plot(path: str, *, flag: str = "--plot", load: bool = True) -> None:
    """Refuse a plot :func:`plot` cannot write, before any work is done: its extension is not
    one of :data:`PLOT_FORMATS` (none, or ``.txt``, ``.svg``...), or it is a ``.png`` and
    matplotlib cannot be imported (only checked when ``load``).

    Raises:
        InvalidRequestError: the extension is missing or not ``.png`` / ``.html``.
        PlotUnavailable: a ``.png`` and no matplotlib.
    """
    suffix = Path(path).suffix
    accepted = " or ".join(PLOT_FORMATS)
    if suffix.lower() not in PLOT_FORMATS:
        problem = (f"has no extension; name a {accepted} file, e.g. {path + '.html'!r}"
                   if not suffix else
                   f"has an unsupported extension {suffix!r}; name a {accepted} file, e.g. "
                   f"{path[: -len(suffix)] + '.html'!r}")
        raise InvalidRequestError(f"{flag} {path!r} {problem}", param=flag.lstrip("-"))
    if load and suffix.lower() == ".png":
        _pyplot(path, flag)


def _pyplot(path: str, flag: str = "--plot") -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or :class:`PlotUnavailable`."""
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise PlotUnavailable(
            f"{flag} {path}: PNG plots need matplotlib; install it with "
            "`pip install 'zmlai[plot]'`, or write an .html plot instead") from None


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of already sorted values, linearly interpolated."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _ms(values: Sequence[float], qs: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in qs:
        v = percentile(values, q)
        out[f"p{q:g}"] = None if v is None else round(v * 1000.0, 3)
    return out


def summarize(run: ReplayRun, slo_ms: float | None = None) -> dict[str, Any]:
    """One result row of the JSON schema (module docstring)."""
    slo = run.slo_ms if slo_ms is None else slo_ms
    outcomes = run.outcomes
    total = len(outcomes)
    done: list[Outcome] = [o for o in outcomes if o.e2e_s is not None]
    ttft = sorted(o.ttft_s for o in done if o.ttft_s is not None)
    e2e = sorted(o.e2e_s for o in done if o.e2e_s is not None)
    errors = Counter(o.error for o in outcomes if o.error is not None)
    families = Counter(o.family for o in outcomes if o.family is not None)
    met = None
    if slo is not None:
        limit = slo / 1000.0
        met = sum(1 for t in ttft if t <= limit) / total if total else 0.0
    cost = sum(o.cost_usd for o in outcomes)
    out_tokens = sum(o.arrival.output_tokens for o in done)
    return {
        "name": run.name,
        "kind": run.kind,
        "requests": total,
        "completed": len(done),
        "errors": dict(sorted(errors.items())),
        "ttft_ms": _ms(ttft, (50, 90, 99)),
        "e2e_ms": _ms(e2e, (50, 99)),
        "slo_ms": slo,
        "slo_attainment": None if met is None else round(met, 6),
        "share_by_family": {f: round(c / total, 6) for f, c in families.items()} if total else {},
        "prefix_cache_hit_rate": _hit_rate(run),
        "cost_usd": round(cost, 6),
        "usd_per_1m_output_tokens": round(cost / out_tokens * 1e6, 6) if out_tokens else None,
    }


def _hit_rate(run: ReplayRun) -> float | None:
    if "prefix_cache_hit_rate" in run.extra:  # a live run: what the nodes reported, if any
        live = run.extra["prefix_cache_hit_rate"]
        return None if live is None else round(float(live), 6)  # type: ignore[arg-type]
    return round(hit_rate([n.model for n in run.fleet.nodes]), 6)


def replay_document(trace: str, requests: int, wall_s: float, virtual_s: float,
                    rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {"trace": trace, "requests": requests, "wall_s": round(wall_s, 3),
            "virtual_s": round(virtual_s, 3), "results": list(rows)}


def _fmt(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def rich_table(rows: Sequence[dict[str, Any]], title: str = "replay") -> Any:
    """A ``rich.table.Table`` of the rows."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("row", "requests", "completed", "errors", "TTFT p50/p90/p99 ms", "e2e p50/p99 ms",
                "SLO met", "share by family", "prefix hit", "cost $", "$/1M out"):
        table.add_column(col, justify="left" if col in ("row", "errors", "share by family")
                         else "right")
    for r in rows:
        t, e = r["ttft_ms"], r["e2e_ms"]
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        share = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["share_by_family"].items()))
        slo = r["slo_attainment"]
        table.add_row(
            f"{r['name']} ({r['kind']})", f"{r['requests']:,}", f"{r['completed']:,}", errors,
            f"{_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])}",
            f"{_fmt(e['p50'])} / {_fmt(e['p99'])}",
            "—" if slo is None else f"{slo:.1%} ≤{r['slo_ms']:g}ms",
            share, "—" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.1%}", _fmt(r["cost_usd"], 2),
            _fmt(r["usd_per_1m_output_tokens"], 3),
        )
    return table


def _cdf(run: ReplayRun) -> tuple[list[float], list[float]]:
    ttft = sorted(o.ttft_s * 1000.0 for o in run.outcomes if o.e2e_s is not None and o.ttft_s is not None)
    n = len(run.outcomes) or 1
    return ttft, [(i + 1) / n for i in range(len(ttft))]


def _shares(run: ReplayRun) -> tuple[list[float], dict[str, list[float]]]:
    """Per-family share of the requests placed, in up to 60 time buckets of >= 50 requests
    on average; a bucket with no arrival repeats the previous bucket's shares."""
    buckets = max(1, min(60, len(run.outcomes) // 50))
    span = max((o.start_s for o in run.outcomes), default=0.0) or 1.0
    width = span / buckets
    counts: dict[str, list[int]] = {}
    totals = [0] * buckets
    for o in run.outcomes:
        b = min(int(o.start_s / width), buckets - 1)
        totals[b] += 1
        if o.family is not None:
            counts.setdefault(o.family, [0] * buckets)[b] += 1
    xs = [(b + 0.5) * width for b in range(buckets)]
    shares: dict[str, list[float]] = {}
    for family, values in sorted(counts.items()):
        row: list[float] = []
        for c, t in zip(values, totals, strict=True):
            row.append(c / t if t else (row[-1] if row else 0.0))
        shares[family] = row
    return xs, shares


def plot(runs: Sequence[ReplayRun], path: str) -> None:
    """Draw TTFT CDFs per row and per-family share over time: ``.png`` (matplotlib) or
    ``.html`` (a self-contained page with inline SVG, no dependency), at exactly ``path``.

    Raises:
        InvalidRequestError: ``path`` does not end in ``.png`` or ``.html`` (:func:`check_plot`).
        PlotUnavailable: a ``.png`` and no matplotlib.
    """
    check_plot(path, load=False)
    target = Path(path)
    if target.suffix.lower() == ".html":
        target.write_text(_html(runs), encoding="utf-8")
        return
    plt: Any = _pyplot(path)
    fig, axes = plt.subplots(1 + len(runs), 1, figsize=(9, 3.2 * (1 + len(runs))), squeeze=False)
    ax = axes[0][0]
    for run in runs:
        xs, ys = _cdf(run)
        ax.plot(xs, ys, label=run.name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("share of all requests")
    ax.set_title("TTFT CDF (errors never reach 1.0)")
    ax.legend()
    families = sorted({o.family for run in runs for o in run.outcomes if o.family is not None})
    color = {f: _COLORS[i % len(_COLORS)] for i, f in enumerate(families)}
    for k, run in enumerate(runs, 1):
        ax = axes[k][0]
        xs, shares = _shares(run)
        if shares:
            ax.stackplot(xs, *shares.values(), labels=list(shares),
                         colors=[color[f] for f in shares])
            ax.legend(loc="upper right")
        ax.set_title(f"{run.name}: share of requests per family over time")
        ax.set_xlabel("virtual time (s)")
        ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(target, dpi=80, format="png")
    plt.close(fig)


_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def _svg_lines(series: list[tuple[str, list[float], list[float]]], w: int, h: int,
               log_x: bool, xlabel: str) -> str:
    import math

    pts = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys, strict=True)]
    if not pts:
        return "<p>no data</p>"
    fx = (lambda v: math.log10(max(v, 1e-3))) if log_x else (lambda v: v)
    x0 = min(fx(x) for x, _ in pts)
    x1 = max(fx(x) for x, _ in pts)
    span = (x1 - x0) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h + 30}">',
             f'<rect x="0" y="0" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for k, (label, xs, ys) in enumerate(series):
        step = max(1, len(xs) // 800)
        coords = " ".join(f"{(fx(x) - x0) / span * w:.1f},{h - y * h:.1f}"
                          for x, y in list(zip(xs, ys, strict=True))[::step])
        color = _COLORS[k % len(_COLORS)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>')
        parts.append(f'<text x="{8 + 150 * k}" y="{h + 20}" fill="{color}">{html.escape(label)}</text>')
    lo = 10 ** x0 if log_x else x0
    hi = 10 ** x1 if log_x else x1
    parts.append(f'<text x="4" y="14" font-size="11">{html.escape(xlabel)}: {lo:,.0f} … {hi:,.0f}'
                 f'{" (log)" if log_x else ""}</text></svg>')
    return "".join(parts)


def _html(runs: Sequence[ReplayRun]) -> str:
    body = ["<h2>TTFT CDF (share of all requests; errors never reach 1.0)</h2>",
            _svg_lines([(r.name, *_cdf(r)) for r in runs], 800, 300, True, "TTFT ms")]
    for run in runs:
        xs, shares = _shares(run)
        body.append(f"<h2>{html.escape(run.name)}: share of requests per family over time</h2>")
        body.append(_svg_lines([(f, xs, ys) for f, ys in shares.items()], 800, 200, False,
                               "virtual s"))
    rows = json.dumps([summarize(r) for r in runs], indent=1)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>zml sim replay</title>"
            "</head><body style='font-family:sans-serif'>" + "".join(body) +
            f"<h2>results</h2><pre>{html.escape(rows)}</pre></body></html>")
