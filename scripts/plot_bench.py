"""Plots from `scripts/bench.py --json` results.

  python scripts/plot_bench.py results.json [more.json ...] [--out-dir docs]

Writes two PNGs:
- bench_throughput.png: output tokens/s against the number of sequences, engine and transformers,
  one line pair per (model, dtype, device) among the offline records (the latest record wins when
  a point was measured twice).
- bench_step_split.png: per-step host and device time for the offline record with the most
  sequences of the first group (left), and the mean host and device time of a decode step against
  the number of sequences (right).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records.extend(data if isinstance(data, list) else [data])
    return records


def group_offline(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str], dict[int, dict]]:
    """(model, dtype, device_kind) -> {num_seqs: latest offline record}."""
    groups: dict[tuple[str, str, str], dict[int, dict]] = {}
    for r in records:
        if r.get("mode") == "offline":
            groups.setdefault((r["model"], r["dtype"], r["device_kind"]), {})[r["num_seqs"]] = r
    return groups


def plot_throughput(groups: dict[tuple[str, str, str], dict[int, dict]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (model, dtype, device), by_n in groups.items():
        ns = sorted(by_n)
        tag = f"{model} {dtype} ({device})"
        line, = ax.plot(ns, [by_n[n]["engine"]["output_tok_s"] for n in ns], "o-",
                        label=f"minivllm-jax — {tag}")
        hf = [(n, by_n[n]["hf"]["output_tok_s"]) for n in ns if by_n[n].get("hf")]
        if hf:
            ax.plot([n for n, _ in hf], [v for _, v in hf], "s--", color=line.get_color(),
                    alpha=0.7, label=f"transformers — {tag}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of sequences")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_split(groups: dict[tuple[str, str, str], dict[int, dict]], out: Path) -> None:
    """Host time is often three orders of magnitude below device time, so both panels use a log
    axis and draw host and device side by side rather than stacked."""
    by_n = next(iter(groups.values()))
    biggest = by_n[max(by_n)]
    steps = biggest["steps"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(steps)))
    ax1.plot(xs, [1e3 * s["device"] for s in steps], ".-",
             label="device (host waiting for the step's results)")
    ax1.plot(xs, [1e3 * s["host"] for s in steps], ".-", label="host (schedule, inputs, outputs)")
    ax1.set_yscale("log")
    ax1.set_xlabel("engine step() call")
    ax1.set_ylabel("ms per step")
    ax1.set_title(f"{biggest['model']} {biggest['dtype']} ({biggest['device_kind']}), "
                  f"{biggest['num_seqs']} seqs", fontsize=9)
    ax1.grid(True, alpha=0.3, which="both")
    ax1.legend(fontsize=7)
    ns = sorted(by_n)
    width = 0.38
    pos = list(range(len(ns)))
    for offset, key, label in ((-width / 2, "device", "device"), (width / 2, "host", "host")):
        vals = [by_n[n]["split"]["decode"][key] for n in ns]
        bars = ax2.bar([x + offset for x in pos], vals, width, label=label)
        ax2.bar_label(bars, fmt="%.1f", fontsize=7)
    ax2.set_xticks(pos, [str(n) for n in ns])
    ax2.set_yscale("log")
    ax2.set_xlabel("number of sequences")
    ax2.set_ylabel("mean ms per decode step")
    ax2.set_title("Decode steps: host vs device", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description="plot scripts/bench.py --json results")
    p.add_argument("json", nargs="+")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "docs"))
    args = p.parse_args(argv)
    groups = group_offline(load(args.json))
    if not groups:
        raise SystemExit("no offline records in the given files")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench_throughput.png", out_dir / "bench_step_split.png"]
    plot_throughput(groups, paths[0])
    plot_split(groups, paths[1])
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
