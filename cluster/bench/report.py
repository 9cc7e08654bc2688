"""Summaries of load phases, and the bench's outputs: a table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.bench.load import PhaseResult


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(phase: PhaseResult) -> dict:
    """Client-side latency and throughput, and the server's speculation counters, for a phase.
    Per-round figures are weighted by each request's rounds."""
    done = [r for r in phase.requests if r.ok]
    gaps = [g for r in done for g in r.chunk_gaps_s]
    spec = [r.speculation for r in done if r.speculation]
    rounds = sum(s["rounds"] for s in spec)
    drafted, accepted = sum(s["drafted_tokens"] for s in spec), sum(s["accepted_tokens"] for s in spec)
    tokens = sum(r.output_tokens for r in done)

    def per_round(key: str) -> float:
        return sum(s.get(key, 0.0) * s["rounds"] for s in spec) / rounds if rounds else 0.0

    ms = 1000
    return {
        "requests": len(phase.requests), "failed": len(phase.requests) - len(done),
        "errors": sorted({r.error for r in phase.requests if r.error})[:5],
        "wall_s": round(phase.wall_s, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / phase.wall_s, 2) if phase.wall_s else 0.0,
        "latency_p50_ms": round(percentile([r.latency_s for r in done], 50) * ms, 1),
        "latency_p99_ms": round(percentile([r.latency_s for r in done], 99) * ms, 1),
        "ttft_p50_ms": round(percentile([r.ttft_s for r in done], 50) * ms, 1),
        "ttft_p99_ms": round(percentile([r.ttft_s for r in done], 99) * ms, 1),
        "itl_p50_ms": round(percentile(gaps, 50) * ms, 2),
        "itl_p99_ms": round(percentile(gaps, 99) * ms, 2),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tokens_per_round": round(tokens / rounds, 3) if rounds else 0.0,
        "mean_verify_batch": round(per_round("mean_verify_batch"), 3),
        "mean_draft_batch": round(sum(s["mean_draft_batch"] * s["rounds"] for s in spec if s["drafted_tokens"])
                                  / max(1, sum(s["rounds"] for s in spec if s["drafted_tokens"])), 3),
        "round_ms": round(per_round("round_ms"), 3),
        "mean_k": round(per_round("mean_k"), 3),
        "coordination_ms_per_round": round(per_round("coordination_ms_per_round"), 3),
        **{key: round(per_round(key), 3) for key in ("hop_ms_per_round", "replica_wait_ms_per_round",
                                                     "router_ms_per_round", "lookahead_hit_rate",
                                                     "draft_hidden_share")},
        "by_kind": _by_kind(spec),
        "forced_share": round(sum(s.get("forced_tokens", 0) for s in spec) / tokens, 4) if tokens else 0.0,
    }


def _by_kind(spec: list[dict]) -> dict:
    """Rounds that drafted, drafted and accepted tokens, and acceptance, by where the drafts
    came from (the draft pool's model, prompt lookup), summed over the phase's requests."""
    kinds: dict[str, dict] = {}
    for counts in (s.get("by_kind", {}) for s in spec):
        for kind, fields in counts.items():
            total = kinds.setdefault(kind, {"rounds": 0, "drafted_tokens": 0, "accepted_tokens": 0})
            for field in total:
                total[field] += fields[field]
    for total in kinds.values():
        drafted = total["drafted_tokens"]
        total["acceptance_rate"] = round(total["accepted_tokens"] / drafted, 4) if drafted else 0.0
    return kinds


COLUMNS = [("concurrency", "C", "{}"), ("sampling", "sampling", "{}"), ("mode", "mode", "{}"),
           ("output_tokens_per_s", "tok/s", "{:.1f}"),
           ("latency_p50_ms", "lat p50", "{:.0f}"), ("latency_p99_ms", "lat p99", "{:.0f}"),
           ("ttft_p50_ms", "ttft p50", "{:.0f}"), ("itl_p50_ms", "itl p50", "{:.1f}"),
           ("itl_p99_ms", "itl p99", "{:.1f}"), ("acceptance_rate", "accept", "{:.3f}"),
           ("tokens_per_round", "tok/rnd", "{:.2f}"), ("mean_k", "k", "{:.2f}"),
           ("mean_verify_batch", "vbatch", "{:.2f}"),
           ("coordination_ms_per_round", "coord ms", "{:.1f}"), ("hop_ms_per_round", "hops ms", "{:.1f}"),
           ("replica_wait_ms_per_round", "rwait ms", "{:.1f}"), ("router_ms_per_round", "rtr ms", "{:.1f}"),
           ("lookahead_hit_rate", "hit", "{:.2f}"), ("draft_hidden_share", "hidden", "{:.2f}"),
           ("forced_share", "forced", "{:.2f}")]


def table(rows: list[dict]) -> str:
    """One line a row, each column as wide as its widest cell (9 at least); a row without a
    column's key shows a dash there."""
    cells = [[fmt.format(row[key]) if key in row else "-" for key, _, fmt in COLUMNS] for row in rows]
    widths = [max([9, len(title)] + [len(line[i]) for line in cells]) for i, (_, title, _) in enumerate(COLUMNS)]
    lines = [" ".join(f"{title:>{width}}" for (_, title, _), width in zip(COLUMNS, widths, strict=True))]
    for line in cells:
        lines.append(" ".join(f"{cell:>{width}}" for cell, width in zip(line, widths, strict=True)))
    return "\n".join(lines)


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def plot(report: dict, path: Path) -> str | None:
    """Throughput and p50 latency against concurrency, every mode, a line per mode and
    sampling setting (greedy solid, sampled dashed). Returns why the plot was skipped, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'specserve[bench]')"
    phases = report["closed_loop"]
    if not phases:
        return "skipped: no closed-loop phase"
    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for sampling in dict.fromkeys(run.get("sampling", "greedy") for run in phases):
        runs = [run for run in phases if run.get("sampling", "greedy") == sampling]
        style = "-" if sampling == "greedy" else "--"
        for mode in [m for m in runs[0]["modes"] if all(m in run for run in runs)]:
            color = colors.setdefault(mode, plt.get_cmap("tab20")(len(colors) % 20))
            label = f"{mode.replace('_', ' ')} ({sampling})"
            xs = [run["concurrency"] for run in runs]
            throughput.plot(xs, [run[mode]["output_tokens_per_s"] for run in runs], style, marker="o", color=color,
                            label=label)
            latency.plot(xs, [run[mode]["latency_p50_ms"] for run in runs], style, marker="o", color=color,
                         label=label)
    throughput.set(xlabel="concurrent clients", ylabel="output tokens/s", title="Throughput")
    latency.set(xlabel="concurrent clients", ylabel="request latency p50 (ms)", title="Latency")
    for axes in (throughput, latency):
        axes.grid(alpha=0.3)
    latency.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return None
