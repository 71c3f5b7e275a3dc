"""Turn a run's records into the numbers, the printed table, the JSON file and the plot.

Latencies are over the *completed* requests of the window (a failed request has no
meaningful latency), but the counts next to them always show offered, failed and
outstanding requests, so a run that "looks fast" because half its requests failed reads
as what it is. ITL samples are pooled over requests (every gap of every completed
request); TPOT is one number per request (``goodput.tpot_seconds``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shared.metrics import summarize
from stage5_server.bench.goodput import (
    ITL_POLICY,
    Outcome,
    completion_only_rate,
    count_window,
    goodput_per_second,
    meets_slo,
    tpot_seconds,
)
from stage5_server.bench.serve import BenchRun


def _ms(values: list[float]) -> dict[str, float]:
    return {k: v * 1e3 for k, v in summarize(values).items()}


def summarize_run(run: BenchRun) -> dict[str, Any]:
    """Every number of one run, the config, and every request's timeline (JSON-ready)."""
    cfg, slo = run.config, run.config.slo
    start, end = run.window_start, run.window_end
    window_s = end - start
    outcomes, completed, per_request = [], [], []
    for rec in run.records:
        tl = rec.timeline()
        itls = tl.itls
        tpot = tpot_seconds(rec.token_times[0] if rec.token_times else None,
                            rec.token_times[-1] if rec.token_times else None, rec.output_tokens)
        passed = rec.ok and meets_slo(tl.ttft, itls, tpot, slo)
        in_window = not rec.warmup and rec.send_time is not None and start <= rec.send_time <= end
        if in_window:
            outcomes.append(Outcome(rec.send_time, rec.end_time, rec.ok, passed))
        done_in_window = in_window and rec.ok and rec.end_time is not None and rec.end_time <= end
        if done_in_window:
            completed.append((rec, tl, itls, tpot))
        per_request.append({**rec.as_dict(), "in_window": in_window, "ttft_s": tl.ttft, "tpot_s": tpot,
                            "e2e_s": tl.e2e, "passed_slo": bool(done_in_window and passed)})
    counts = count_window(outcomes, start, end)
    ok_window = window_s > 0
    goodput = goodput_per_second(counts, window_s) if ok_window else math.nan
    out_tokens = sum(r.output_tokens for r, *_ in completed)
    prompt_tokens = sum((r.prompt_tokens if r.prompt_tokens is not None else (r.prompt_len or 0))
                        for r, *_ in completed)
    errors = Counter(r.error for r in run.records
                     if not r.warmup and r.error is not None and r.send_time is not None and r.send_time <= end)
    return {
        "date": run.started_at,
        "model": run.model,
        "config": {**{k: v for k, v in asdict(cfg).items() if k not in ("slo", "dataset", "api_key")},
                   "api_key": "***" if cfg.api_key else None, "dataset": asdict(cfg.dataset)},
        "slo": asdict(slo),
        "slo_text": slo.describe(),
        "itl_policy": ITL_POLICY,
        "window": {"start_s": start, "end_s": end, "seconds": window_s,
                   "fixed_length": cfg.window_seconds is not None},
        "counts": {**counts.as_dict(), "warmup": sum(r.warmup for r in run.records),
                   "no_itl_sample": sum(1 for _, _, itls, _ in completed if not itls)},
        "goodput_req_s": goodput,
        "wrong_denominator_req_s": (completion_only_rate(counts.offered, counts.completed, counts.passed, window_s)
                                    if ok_window else math.nan),
        "request_throughput_req_s": counts.completed / window_s if ok_window else math.nan,
        "output_token_throughput_tok_s": out_tokens / window_s if ok_window else math.nan,
        "total_token_throughput_tok_s": (out_tokens + prompt_tokens) / window_s if ok_window else math.nan,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": prompt_tokens,
        "ttft_ms": _ms([tl.ttft for _, tl, _, _ in completed if tl.ttft is not None]),
        "itl_ms": _ms([g for _, _, itls, _ in completed for g in itls]),
        "tpot_ms": _ms([t for *_, t in completed if t is not None]),
        "e2e_ms": _ms([tl.e2e for _, tl, _, _ in completed if tl.e2e is not None]),
        "server_phases_ms": _server_phases([r for r, *_ in completed]),
        "errors": dict(errors.most_common(10)),
        "requests": per_request,
    }


SERVER_PHASES = ("frontend_in", "queue", "prefill", "decode", "frontend_out", "server_ttft")


def _server_phases(records: list) -> dict[str, dict[str, float]]:
    """Summaries of the server-reported phases (empty when the server reports none)."""
    reported = [r.server_timeline for r in records if r.server_timeline]
    if not reported:
        return {}
    return {name: _ms([t[name] for t in reported if t.get(name) is not None]) for name in SERVER_PHASES}


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def format_result(res: dict[str, Any]) -> str:
    """The printed report of one run."""
    c, cfg = res["counts"], res["config"]
    rate = cfg["request_rate"]
    lines = [
        "=" * 22 + " Serving benchmark " + "=" * 22,
        f"{'Model / endpoint:':<40}{res['model']} / {cfg['endpoint']}",
        f"{'Dataset:':<40}{cfg['dataset']['name']} (seed {cfg['seed']})",
        f"{'Request rate (req/s):':<40}{'inf (burst)' if math.isinf(rate) else _fmt(rate)}"
        + (f", max concurrency {cfg['max_concurrency']}" if cfg["max_concurrency"] else ""),
        f"{'Measured window (s):':<40}{_fmt(res['window']['seconds'], '.3f')}"
        + (" (fixed)" if res["window"]["fixed_length"] else " (until the last measured request ended)"),
        f"{'Warm-up requests (not counted):':<40}{c['warmup']}",
        f"{'Offered in window:':<40}{c['offered']}",
        f"{'  completed:':<40}{c['completed']}",
        f"{'    passed every SLO:':<40}{c['passed']}",
        f"{'  failed (errors):':<40}{c['failed']}",
        f"{'  outstanding at window end:':<40}{c['outstanding']}",
        f"{'SLO:':<40}{res['slo_text']}",
        f"{'Goodput (passing completions/s):':<40}{_fmt(res['goodput_req_s'])}",
        f"{'    (wrong: offered x pass/completed):':<40}{_fmt(res['wrong_denominator_req_s'])}",
        f"{'Request throughput (completed/s):':<40}{_fmt(res['request_throughput_req_s'])}",
        f"{'Output token throughput (tok/s):':<40}{_fmt(res['output_token_throughput_tok_s'])}",
        f"{'Total token throughput (tok/s):':<40}{_fmt(res['total_token_throughput_tok_s'])}",
        "-" * 63,
        f"{'latency (ms)':<16}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        s = res[key]
        lines.append(f"{label:<16}" + "".join(f"{_fmt(s[q]):>11}" for q in ("mean", "p50", "p90", "p99")))
    phases = res.get("server_phases_ms") or {}
    if phases:
        lines.append(f"{'server phase (ms)':<16}")
        for name in SERVER_PHASES:
            s = phases[name]
            lines.append(f"  {name:<14}" + "".join(f"{_fmt(s[q]):>11}" for q in ("mean", "p50", "p90", "p99")))
    lines.append("-" * 63)
    lines.append(f"ITL policy: {res['itl_policy']} ({c['no_itl_sample']} such request(s) here).")
    for msg, n in res["errors"].items():
        lines.append(f"error x{n}: {msg}")
    lines.append("=" * 63)
    return "\n".join(lines)


def format_sweep_table(rows: list[dict[str, Any]]) -> str:
    """The goodput curve: one row per (scheduler setting, request rate)."""
    # Narrow enough for a page (under 84 columns): the setting as budget/seqs, e.g. "1024/16".
    head = (f"{'tokens/seqs':<12}{'rate':>6}{'offered':>8}{'passed':>7}{'failed':>7}{'outst':>6}"
            f"{'goodput/s':>10}{'p99 TTFT':>9}{'p99 ITL':>8}{'tok/s':>8}")
    out = [head, "-" * len(head)]
    for row in rows:
        res = row["result"]
        c = res["counts"]
        rate = res["config"]["request_rate"]
        setting = res.get("setting") or {}
        label = (f"{setting['max_num_batched_tokens']}/{setting['max_num_seqs']}" if setting
                 else row.get("setting", "-"))
        out.append(f"{label:<12}{'inf' if math.isinf(rate) else _fmt(rate, 'g'):>6}"
                   f"{c['offered']:>8}{c['passed']:>7}{c['failed']:>7}{c['outstanding']:>6}"
                   f"{_fmt(res['goodput_req_s']):>10}{_fmt(res['ttft_ms']['p99'], '.1f'):>9}"
                   f"{_fmt(res['itl_ms']['p99'], '.1f'):>8}{_fmt(res['output_token_throughput_tok_s'], '.0f'):>8}")
    return "\n".join(out)


def _jsonable(obj: Any) -> Any:
    """NaN and inf are not JSON: write them as null and the string "inf"."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def save_result(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(_jsonable(payload), indent=1, allow_nan=False))


def _cdf(ax, values: list[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_results(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Latency CDFs (TTFT, ITL, E2E) per run; goodput vs request rate when several rates ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = {r["result"]["config"]["request_rate"] for r in rows}
    ncols = 4 if len(rates) > 1 else 3
    # Readable at a page's width (about 700 px): four panels as 2 x 2, three in a row.
    if ncols == 4:
        fig, grid = plt.subplots(2, 2, figsize=(9, 7))
        axes = list(grid.flat)
    else:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    for row in rows:
        res = row["result"]
        rate = res["config"]["request_rate"]
        label = f"{row.get('setting', '')} rate={'inf' if math.isinf(rate) else format(rate, 'g')}".strip()
        done = [q for q in res["requests"] if q["in_window"] and q["ok"]]
        _cdf(axes[0], [q["ttft_s"] * 1e3 for q in done if q["ttft_s"] is not None], label)
        _cdf(axes[1], [(b - a) * 1e3 for q in done for a, b in zip(q["token_times"], q["token_times"][1:])], label)
        _cdf(axes[2], [q["e2e_s"] * 1e3 for q in done if q["e2e_s"] is not None], label)
    for ax, name in zip(axes, ("TTFT", "ITL", "E2E latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of completed requests")
        ax.grid(alpha=0.3)
    if ncols == 4:
        by_setting: dict[str, list[tuple[float, float]]] = {}
        for row in rows:
            res = row["result"]
            by_setting.setdefault(row.get("setting", "run"), []).append(
                (res["config"]["request_rate"], res["goodput_req_s"]))
        finite = [r for r in rates if not math.isinf(r)]
        inf_x = (max(finite) * 2) if finite else 1.0
        for setting, pts in by_setting.items():
            pts = sorted((inf_x if math.isinf(x) else x, y) for x, y in pts)
            axes[3].plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=setting)
        axes[3].set_xlabel("request rate (req/s; a burst at 2x the highest)")
        axes[3].set_ylabel("goodput (passing req/s)")
        axes[3].grid(alpha=0.3)
        axes[3].legend(fontsize=7)
    axes[0].legend(fontsize=7)
    if title:  # a figure names the command that made it
        import textwrap

        fig.suptitle(textwrap.fill(title, 120), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
