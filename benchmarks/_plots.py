"""The benchmarks' charts: docs/images/<name>.png, drawn from benchmarks/results/<name>.json.

A bench script run with ``--write`` records its table in docs/benchmarks.md, then hands the
figures it measured to :func:`publish`, which saves them as JSON and draws the chart. The
JSON is kept, so a chart can be redrawn (a label fixed, a scale changed) without rerunning a
benchmark: ``python benchmarks/_plots.py [name ...]`` redraws from benchmarks/results/.

matplotlib is optional (``pip install 'asyncstore[plots]'``) and imported only to draw, so
the benchmarks run without it. Charts are drawn with the Agg canvas, never a GUI backend,
under matplotlib's default style (a user's matplotlibrc does not leak in), and saved
without the PNG's "Software" text: the same JSON gives the same bytes on every run.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"

Results = dict[str, Any]

INSTALL_HINT = "pip install 'asyncstore[plots]'"

# Width and height in inches at DPI: 1000 x 450 pixels, a few tens of KB as a PNG, readable
# at the width of a documentation page.
SIZE = (10.0, 4.5)
DPI = 100

# One colour per role, the same in every chart: what asyncstore measured, the baseline it
# is compared with, and a limit that nothing can beat.
OURS, OURS_2, BASE, BASE_2, LIMIT = "#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#555555"


class PlotsUnavailable(RuntimeError):
    """Raised when a chart is asked for and matplotlib is not installed."""


def today() -> str:
    """The date a benchmark ran, as its section in docs/benchmarks.md shows it."""
    return time.strftime("%Y-%m-%d")


def save_results(name: str, results: Results, results_dir: Path = RESULTS) -> Path:
    """Write ``results`` to ``results_dir/<name>.json`` (sorted keys, so that a rerun on the
    same figures gives the same file) and return its path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return path


def draw(name: str, results: Results, images_dir: Path = IMAGES) -> Path:
    """Draw the chart of benchmark ``name`` from ``results`` into ``images_dir/<name>.png``.

    Raises:
        KeyError: ``name`` has no chart.
        PlotsUnavailable: matplotlib is not installed.
    """
    drawer = DRAWERS[name]
    matplotlib, figure_class, canvas_class = _matplotlib()
    # The default style, whatever the user's matplotlibrc says: the same file everywhere.
    with matplotlib.style.context("default"):
        fig = figure_class(figsize=SIZE, dpi=DPI, layout="constrained")
        canvas_class(fig)
        drawer(fig, results)
        images_dir.mkdir(parents=True, exist_ok=True)
        path = images_dir / f"{name}.png"
        # No "Software" text (it names matplotlib's version); PNGs carry no time otherwise.
        fig.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return path


def publish(name: str, results: Results) -> Path | None:
    """Save ``results`` as benchmarks/results/<name>.json and draw docs/images/<name>.png.

    Without matplotlib the JSON is still saved and a message says how to get the chart;
    returns the chart's path, or None when it could not be drawn.
    """
    saved = save_results(name, results)
    try:
        path = draw(name, results)
    except PlotsUnavailable as exc:
        print(f"{exc} Figures saved in {saved.relative_to(ROOT)}.", file=sys.stderr)
        return None
    print(f"Chart: {path.relative_to(ROOT)}", file=sys.stderr)
    return path


def _matplotlib() -> tuple[Any, Any, Any]:
    """matplotlib, its Figure class and the Agg canvas, imported on first use."""
    try:
        import matplotlib
        import matplotlib.style
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotsUnavailable(f"The benchmarks' charts need matplotlib: {INSTALL_HINT}") from exc
    return matplotlib, Figure, FigureCanvasAgg


# -- the charts ---------------------------------------------------------------------------


def _title(fig: Figure, text: str, results: Results) -> None:
    # The machine's first clause (CPU, cores, memory): the rest is in the JSON.
    machine = str(results["machine"]).split(";")[0]
    fig.suptitle(f"{text}\n{machine}, {results['date']}", fontsize=11)


def _label_bars(ax: Axes, container: Any, fmt: str) -> None:
    ax.bar_label(container, fmt=fmt, padding=2, fontsize=8)


def store_chart(fig: Figure, results: Results) -> None:
    """bench_store: small-object rates against requests in flight (the sequential botocore
    loop as a line), and the large object's MB/s beside the hand-written loop."""
    small, large = results["small"], results["large"]
    _title(
        fig,
        f"S3 store throughput: {small['objects']:,} objects of "
        f"{small['object_bytes'] / 1000:,.0f} KB, one {large['mib']:,} MiB object",
        results,
    )
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    rows = small["asyncstore"]
    inflight = [row["inflight"] for row in rows]
    for key, colour, baseline_colour, what in (
        ("get_per_s", OURS, BASE, "get"),
        ("put_per_s", OURS_2, BASE_2, "put"),
    ):
        left.plot(
            inflight,
            [row[key] for row in rows],
            marker="o",
            color=colour,
            label=f"asyncstore S3Store {what}",
        )
        left.axhline(
            small["baseline"][key],
            color=baseline_colour,
            linestyle="--",
            label=f"botocore sequential loop {what} (baseline)",
        )
    left.set_xscale("log", base=2)
    left.set_xticks(inflight, [str(i) for i in inflight])
    left.set_xlabel("requests in flight")
    left.set_ylabel("objects/s")
    tallest = max(max(row["get_per_s"], row["put_per_s"]) for row in rows)
    # Room above the lines for the legend.
    left.set_ylim(0, max(tallest, *small["baseline"].values()) * 1.45)
    left.set_title(f"{small['object_bytes'] / 1000:,.0f} KB objects", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="upper left", ncols=2)

    clients = [
        (
            f"hand-written aiobotocore\n(baseline; {large['baseline_put_inflight']} parts / "
            f"{large['baseline_get_inflight']} ranges)",
            large["baseline"],
            BASE,
        ),
        ("asyncstore put / get\n(defaults)", large["asyncstore"], OURS),
    ]
    width = 0.38
    for i, (label, figures, colour) in enumerate(clients):
        xs = [j + (i - 0.5) * width for j in range(2)]
        bars = right.bar(
            xs, [figures["put_mb_s"], figures["get_mb_s"]], width, color=colour, label=label
        )
        _label_bars(right, bars, "%.0f")
    right.set_xticks([0, 1], ["put", "get"])
    right.set_ylabel("MB/s")
    right.set_title(
        f"one {large['mib']:,} MiB object, {large['part_mib']} MiB parts "
        f"(median of {large['repeat']})",
        fontsize=10,
    )
    right.margins(y=0.2)
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=8, loc="upper left")


def checkpoint_chart(fig: Figure, results: Results) -> None:
    """bench_checkpoint: each writer's blocking time against its total, fp32 and bf16, the
    raw write as the limit."""
    saves = results["saves"]
    _title(
        fig,
        "Checkpoint saves to local disk: time blocked in the call against time until on disk",
        results,
    )
    axes = fig.subplots(1, len(saves), sharey=True)
    # fp32 before bf16, as the tables (the JSON's keys are sorted).
    labels = sorted(saves, reverse=True)
    for ax, label in zip(axes, labels, strict=True):
        run = saves[label]
        rows = run["rows"]
        ys = list(range(len(rows)))
        totals = [row["total"] for row in rows]
        blocking = [row["blocking"] if row["blocking"] is not None else 0.0 for row in rows]
        colours = [_writer_colour(row["writer"]) for row in rows]
        ax.barh(ys, totals, 0.8, color=colours, alpha=0.35, label="total (until on disk)")
        ax.barh(ys, blocking, 0.8, color=colours, label="blocking (until the call returned)")
        for y, row in zip(ys, rows, strict=True):
            total, block = row["total"], row["blocking"]
            text = f"{total:.2f} s"
            if block is not None and block < total:
                text = f"{block:.2f} s / {total:.2f} s"
            ax.annotate(
                text,
                (total, y),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        ax.axvline(
            run["raw_total"], color=LIMIT, linestyle="--", label="raw write + fsync (the limit)"
        )
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter("{x:g} s")
        ax.set_xlim(right=max(totals) * 4)
        ax.set_xlabel("seconds (log scale)")
        ax.set_title(f"{run['mib']:,.0f} MiB {label} state", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    writers = [row["writer"] for row in saves[labels[0]]["rows"]]
    axes[0].set_yticks(range(len(writers)), writers, fontsize=8)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=8)


def _writer_colour(writer: str) -> str:
    if writer.startswith("asyncstore"):
        return OURS
    if writer.startswith(("raw", "O_DIRECT")):
        return LIMIT
    if writer.startswith("DCP"):
        return BASE_2
    return BASE


def cache_chart(fig: Figure, results: Results) -> None:
    """bench_cache: read rates of each path (plain local reads as the limit), and each
    policy's hit rate against the offline optimum."""
    hits = results["hit_rates"]
    _title(
        fig,
        f"TieredCache: {results['objects']:,} objects of {results['object_bytes'] / 1000:,.0f} KB",
        results,
    )
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    reads = results["reads"]
    ys = list(range(len(reads)))
    rates = [row["per_s"] for row in reads]
    colours = [LIMIT if row["limit"] else OURS if row["cache"] else BASE for row in reads]
    bars = left.barh(ys, rates, color=colours)
    _label_bars(left, bars, "{:,.0f}")
    left.set_yticks(ys, [row["read"] for row in reads], fontsize=8)
    left.invert_yaxis()
    left.set_xscale("log")
    left.xaxis.set_major_formatter("{x:,.0f}")
    left.set_xlim(right=max(rates) * 8)
    left.set_xlabel("gets/s (log scale)")
    left.set_title("read rates", fontsize=10)
    left.grid(axis="x", alpha=0.3)

    policies = hits["policies"]
    xs = list(range(len(policies)))
    bars = right.bar(
        xs, [p["hit_rate"] for p in policies], 0.6, color=[OURS_2, OURS][: len(policies)]
    )
    _label_bars(right, bars, "%.3f")
    right.axhline(hits["optimum"], color=LIMIT, linestyle="--", label="offline optimum (Belady)")
    right.set_xticks(xs, [f"policy={p['policy']!r}" for p in policies])
    right.set_ylim(0, max(1.0, hits["optimum"] * 1.2))
    right.set_ylabel("hit rate")
    right.set_title(
        f"hit rate over {hits['epochs']} shuffled epochs\n"
        f"(memory tier: {hits['capacity']:,} of {hits['objects']:,} objects)",
        fontsize=10,
    )
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=8, loc="upper left")


def dataset_chart(fig: Figure, results: Results) -> None:
    """bench_dataset: samples/s of each epoch (the first cold, the rest warm) for each
    num_workers, against the sequential botocore loop and S3Store.get; and warm epochs over
    a dataset larger than the memory tier, plan against lru."""
    _title(
        fig,
        f"StreamingDataset in a DataLoader: {results['objects']:,} objects of "
        f"{results['object_bytes'] / 1000:,.0f} KB, batch {results['batch']}",
        results,
    )
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    colours = [OURS, OURS_2, "#2ca02c", "#9467bd"]
    for run, colour in zip(results["epochs"], colours * 4, strict=False):
        rates = [run["cold"], *run["warm"]]
        epochs = list(range(1, len(rates) + 1))
        left.plot(epochs, rates, marker="o", color=colour, label=f"num_workers={run['workers']}")
        left.hlines(
            run["ceiling"], 0.85, len(rates) + 0.15, color=colour, linestyle=":", linewidth=1.5
        )
    left.axhline(
        results["store_per_s"], color=BASE_2, linestyle="--", label="S3Store.get, 32 in flight"
    )
    left.axhline(
        results["baseline_per_s"], color=BASE, linestyle="--", label="botocore sequential loop"
    )
    left.plot([], [], color=LIMIT, linestyle=":", label="DataLoader over a list in memory")
    warm_count = len(results["epochs"][0]["warm"]) if results["epochs"] else 0
    left.set_xticks(
        range(1, warm_count + 2), ["1 (cold)"] + [str(e) for e in range(2, warm_count + 2)]
    )
    left.set_xlabel("epoch (1: from S3 through an empty cache; then warm, from the cache)")
    left.set_yscale("log")
    lowest = min(results["baseline_per_s"], *(run["cold"] for run in results["epochs"]))
    # Room below the lines for the legend.
    left.set_ylim(bottom=lowest / 6)
    left.yaxis.set_major_formatter("{x:,.0f}")
    left.set_ylabel("samples/s (log scale)")
    left.set_title("cold and warm epochs from S3", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="lower right", ncols=2)

    big = results.get("larger_than_memory")
    if not big:
        right.set_visible(False)
        return
    rows = big["rows"]
    workers = sorted({row["workers"] for row in rows})
    width = 0.38
    for i, (policy, colour) in enumerate((("plan", OURS), ("lru", OURS_2))):
        xs = [j + (i - 0.5) * width for j in range(len(workers))]
        warm = {row["workers"]: row["warm"] for row in rows if row["policy"] == policy}
        bars = right.bar(
            xs, [warm[w] for w in workers], width, color=colour, label=f"policy={policy!r}, warm"
        )
        _label_bars(right, bars, "{:,.0f}")
    in_loader = {row["workers"]: row["in_loader"] for row in rows}
    right.scatter(
        range(len(workers)),
        [in_loader[w] for w in workers],
        marker="_",
        s=900,
        color=BASE,
        zorder=3,
        label="plain open().read() in the DataLoader",
    )
    right.axhline(big["plain_per_s"], color=LIMIT, linestyle="--", label="plain reads, bare loop")
    right.set_xticks(range(len(workers)), [str(w) for w in workers])
    right.set_xlabel("num_workers")
    right.set_ylabel("samples/s")
    right.yaxis.set_major_formatter("{x:,.0f}")
    right.set_ylim(0, max(big["plain_per_s"], *in_loader.values()) * 1.6)
    right.set_title(
        f"warm epochs, {big['total_mb']:,.0f} MB local, memory tier {big['memory_mb']:,.0f} MB",
        fontsize=10,
    )
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=7, loc="upper center", ncols=2)


DRAWERS: dict[str, Callable[[Figure, Results], None]] = {
    "bench_store": store_chart,
    "bench_checkpoint": checkpoint_chart,
    "bench_cache": cache_chart,
    "bench_dataset": dataset_chart,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Redraw the charts named in ``argv`` (every one with saved results by default)."""
    names = list(argv if argv is not None else sys.argv[1:])
    if not names:
        names = sorted(path.stem for path in RESULTS.glob("*.json") if path.stem in DRAWERS)
    if not names:
        print(f"No results in {RESULTS}: run a benchmark with --write first.", file=sys.stderr)
        return 1
    for name in names:
        if name not in DRAWERS:
            print(f"No chart for {name!r}; charts: {', '.join(DRAWERS)}", file=sys.stderr)
            return 2
        results = json.loads((RESULTS / f"{name}.json").read_text())
        try:
            path = draw(name, results)
        except PlotsUnavailable as exc:
            print(exc, file=sys.stderr)
            return 1
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
