"""Plots of `scripts/bench.py --json` results:

  python scripts/plot_bench.py results.json [more.json ...] [--out-dir docs]

- bench_throughput.png: output tokens/s against the number of sequences, engine and transformers,
  per (model, dtype, device) among the offline records (the latest record of a point wins);
- bench_step_split.png: host and device time per step() call of the first group's largest run
  (left), and of a mean decode step against the number of sequences (right), on log axes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm_jax.cli.args import ArgumentParser, run_cli  # noqa: E402

Groups = dict[tuple[str, str, str], dict[int, dict[str, Any]]]


def group_offline(paths: Sequence[str]) -> Groups:
    """(model, dtype, device_kind) -> {num_seqs: latest offline record}."""
    groups: Groups = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data if isinstance(data, list) else [data]:
            if r.get("mode") == "offline":
                groups.setdefault((r["model"], r["dtype"], r["device_kind"]), {})[r["num_seqs"]] = r
    return groups


def plot_throughput(groups: Groups, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (model, dtype, device), by_n in groups.items():
        ns, tag = sorted(by_n), f"{model} {dtype} ({device})"
        line, = ax.plot(ns, [by_n[n]["engine"]["output_tok_s"] for n in ns], "o-",
                        label=f"minivllm-jax — {tag}")
        if hf := [(n, by_n[n]["hf"]["output_tok_s"]) for n in ns if by_n[n].get("hf")]:
            ax.plot(*zip(*hf), "s--", color=line.get_color(), alpha=0.7, label=f"transformers — {tag}")
    ax.set(xlabel="number of sequences", ylabel="output tokens / s", title="Offline throughput")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_split(groups: Groups, out: Path) -> None:
    by_n = next(iter(groups.values()))
    ns, biggest = sorted(by_n), by_n[max(by_n)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("device", "device (waiting for the step's results)"), ("host", "host")):
        ax1.plot([1e3 * s[key] for s in biggest["steps"]], ".-", label=label)
    ax1.set(yscale="log", xlabel="engine step() call", ylabel="ms per step")
    ax1.set_title(f"{biggest['model']} {biggest['dtype']} ({biggest['device_kind']}), "
                  f"{biggest['num_seqs']} seqs", fontsize=9)
    ax1.grid(True, alpha=0.3, which="both")
    ax1.legend(fontsize=7)
    width = 0.38
    for offset, key in ((-width / 2, "device"), (width / 2, "host")):
        bars = ax2.bar([x + offset for x in range(len(ns))],
                       [by_n[n]["split"]["decode"][key] for n in ns], width, label=key)
        ax2.bar_label(bars, fmt="%.1f", fontsize=7)
    ax2.set_xticks(range(len(ns)), [str(n) for n in ns])
    ax2.set(yscale="log", xlabel="number of sequences", ylabel="mean ms per decode step")
    ax2.set_title("Decode steps: host vs device", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = ArgumentParser(description="plot scripts/bench.py --json results")
    p.add_argument("json", nargs="+")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "docs"))
    args = p.parse_args(argv)
    groups = group_offline(args.json)
    if not groups:
        raise ValueError("no offline records in the given files")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench_throughput.png", out_dir / "bench_step_split.png"]
    plot_throughput(groups, paths[0])
    plot_split(groups, paths[1])
    print(*(f"wrote {path}" for path in paths), sep="\n")
    return paths


if __name__ == "__main__":
    sys.exit(run_cli(main))
