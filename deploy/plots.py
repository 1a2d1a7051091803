"""PNG plots of a run directory: what a person looks at after (or during) a run.

- ``learning.png``: mean reward per learner step and held-out greedy accuracy, over steps and over wall time;
- ``staleness.png``: how many trained groups had each staleness (learner version minus oldest token version);
- ``timeline.png``: one lane per process (learner, broker, each worker), coloured by what it was doing, so the
  overlap of generation and training (or the lack of it in synchronous mode) is visible at a glance.

Sources are the files listed in :mod:`deploy.rundir`; missing files give empty panels with a note rather than
an error, so plots can be drawn for a run that was stopped early. ``python -m deploy.plots RUN_DIR``.
"""

from __future__ import annotations

import argparse
import collections
import os
from pathlib import Path
from typing import Any

from deploy import rundir

STATE_COLORS = {
    "generating": "#1f77b4", "scoring": "#17becf", "training": "#ff7f0e", "publishing": "#9467bd",
    "waiting": "#d9d9d9", "idle": "#efefef", "starting": "#bcbd22", "stopping": "#7f7f7f",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    """Write the run's PNG plots into ``<run_dir>/plots``; returns their paths."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    evals = rundir.read_jsonl(rundir.evals_path(run_dir))
    lanes = rundir.timelines(run_dir)
    start_s = _start_time(steps, evals, lanes)
    return [plot_learning(steps, evals, start_s, out_dir / "learning.png"),
            plot_staleness(steps, out_dir / "staleness.png"),
            plot_timeline(lanes, start_s, out_dir / "timeline.png", rundir.exit_times(run_dir))]


def _start_time(steps: list[dict], evals: list[dict], lanes: dict[str, list[tuple[float, str]]]) -> float:
    candidates = [float(s["time_unix"]) for s in steps[:1] if "time_unix" in s]
    candidates += [float(e["time_unix"]) for e in evals if "time_unix" in e]
    candidates += [transitions[0][0] for transitions in lanes.values() if transitions]
    return min(candidates, default=0.0)


def plot_learning(steps: list[dict], evals: list[dict], start_s: float, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    reward_steps = [s["step"] for s in steps if "reward_mean" in s]
    rewards = [s["reward_mean"] for s in steps if "reward_mean" in s]
    reward_times = [s["time_unix"] - start_s for s in steps if "reward_mean" in s and "time_unix" in s]
    points = [e for e in evals if "accuracy" in e]
    for ax, xs_reward, x_key, label in ((axes[0], reward_steps, "step", "learner step"),
                                        (axes[1], reward_times, "time_unix", "wall time since start (s)")):
        if rewards and len(xs_reward) == len(rewards):
            ax.plot(xs_reward, rewards, color="#1f77b4", alpha=0.35, lw=1, label="mean reward (per step)")
            ax.plot(xs_reward, _smooth(rewards, 10), color="#1f77b4", lw=2, label="mean reward (10-step mean)")
        xs = [(e[x_key] - start_s) if x_key == "time_unix" else e.get("step", 0) for e in points if x_key in e]
        ys = [e["accuracy"] for e in points if x_key in e]
        if xs:
            ax.plot(xs, ys, "o-", color="#d62728", lw=2, label="held-out greedy accuracy")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        if not rewards and not xs:
            ax.text(0.5, 0.5, "no learner steps recorded", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].set_ylim(-0.02, 1.02)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Reward and held-out accuracy")
    return _save(fig, path, plt)


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_staleness(steps: list[dict], path: Path) -> Path:
    plt = _pyplot()
    counts: collections.Counter[int] = collections.Counter()
    for s in steps:
        for key, value in (s.get("staleness") or {}).items():
            counts[int(key)] += int(value)
    fig, ax = plt.subplots(figsize=(6, 4))
    if counts:
        xs = list(range(0, max(counts) + 1))
        ax.bar(xs, [counts.get(x, 0) for x in xs], color="#2ca02c")
        ax.set_xticks(xs)
    else:
        ax.text(0.5, 0.5, "no trained groups recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("staleness when trained (versions)")
    ax.set_ylabel("trained groups")
    ax.set_title(f"Staleness of trained groups ({sum(counts.values())} groups)")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path, plt)


def plot_timeline(lanes: dict[str, list[tuple[float, str]]], start_s: float, path: Path,
                  exits: dict[str, list[float]] | None = None) -> Path:
    plt = _pyplot()
    from matplotlib.patches import Patch

    exits = exits or {}
    ends = [t[-1][0] for t in lanes.values() if t] + [x for name in lanes for x in exits.get(name, [])]
    end_s = max(ends, default=start_s)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.45 * max(1, len(lanes))))
    seen = set()
    for row, (name, transitions) in enumerate(lanes.items()):
        by_state: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for begin, end, state in rundir.busy_intervals(transitions, end_s, exits.get(name, [])):
            by_state[state].append((begin - start_s, end - begin))
        for state, spans in by_state.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=STATE_COLORS.get(state, "#000000"))
            seen.add(state)
        share = rundir.busy_share(transitions, end_s, exits.get(name, []))
        if share is not None:
            ax.text(1.0, row, f" {share:.0%} busy", va="center", ha="left", fontsize=8,
                    transform=ax.get_yaxis_transform())
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set_xlabel("wall time since start (s)")
    if not lanes:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax.transAxes)
    handles = [Patch(color=STATE_COLORS.get(s, "#000000"), label=s) for s in STATE_COLORS if s in seen]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title("When each process was busy or waiting")
    return _save(fig, path, plt, rect=(0, 0.1, 1, 1))


def _save(fig: Any, path: Path, plt: Any, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    fig.tight_layout(rect=rect)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.plots", description="Draw a run directory's PNG plots.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
