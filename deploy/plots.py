"""PNG plots of a run directory: what a person looks at after (or during) a run.

- ``learning.png``: mean reward of the committed learner steps (the history the newest checkpoint descends
  from; steps a restart withdrew are greyed) and, where the run measured it, held-out greedy accuracy, over
  steps and over wall time, with learner restarts and outages marked;
- ``staleness.png``: how many trained groups of the committed steps had each staleness (learner version minus
  oldest token version), split into groups with a gradient and groups acknowledged without one (equal rewards);
- ``timeline.png``: one lane per process (learner, broker, each worker), coloured by what it was doing while
  alive, so the overlap of generation and training (or the lack of it in synchronous mode) is visible at a
  glance. A lane ends at its process's last sign of life (:mod:`loraflow.common.timeline`); deaths, restarts and the
  time down are marked, and the busy share counts only the time alive.

Sources are the files listed in :mod:`loraflow.deploy.rundir`; missing files give empty panels with a note rather than
an error, so plots can be drawn for a run that was stopped early. ``python -m loraflow.deploy.plots RUN_DIR``.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
from pathlib import Path
from typing import Any

from loraflow.deploy import rundir

STATE_COLORS = {
    "generating": "#1f77b4", "scoring": "#17becf", "training": "#ff7f0e", "publishing": "#9467bd",
    "waiting": "#d9d9d9", "idle": "#efefef", "starting": "#bcbd22", "stopping": "#7f7f7f",
}
DOWN_COLOR = "#f4a6a6"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | os.PathLike, now_s: float | None = None) -> list[Path]:
    """Write the run's PNG plots into ``<run_dir>/plots``; returns their paths."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    history = rundir.read_learner_history(run_dir)
    evals = rundir.read_jsonl(rundir.evals_path(run_dir))
    lanes = rundir.timelines(run_dir, now_s)
    start_s = _start_time(history, evals, lanes)
    plt = _pyplot()
    figures = {"learning.png": learning_figure(history, evals, lanes.get("learner"), start_s),
               "staleness.png": staleness_figure(history.committed),
               "timeline.png": timeline_figure(lanes, start_s)}
    return [_save(fig, out_dir / name, plt) for name, fig in figures.items()]


def _start_time(history: rundir.LearnerHistory, evals: list[dict], lanes: dict[str, rundir.Lane]) -> float:
    steps = history.committed + history.withdrawn
    candidates = [float(s["time_unix"]) for s in steps if "time_unix" in s]
    candidates += [float(e["time_unix"]) for e in evals if "time_unix" in e]
    candidates += [lane.lives[0].start_s for lane in lanes.values()]
    return min(candidates, default=0.0)


def learning_figure(history: rundir.LearnerHistory, evals: list[dict], learner: rundir.Lane | None,
                    start_s: float) -> Any:
    """Mean reward of the committed steps (and held-out accuracy where the run measured it), over steps and
    over wall time; withdrawn steps greyed, learner restarts and outages marked."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    steps = [s for s in history.committed if "reward_mean" in s]
    gone = [s for s in history.withdrawn if "reward_mean" in s]
    points = [e for e in evals if isinstance(e.get("accuracy"), int | float)]
    rewards = [s["reward_mean"] for s in steps]
    restarts_s = learner.restarts() if learner is not None else [r.time_unix for r in history.resumes if r.time_unix]
    outages = learner.outages() if learner is not None else []
    for ax, by_time in ((axes[0], False), (axes[1], True)):
        def x_of(item: dict, step_key: str = "step", by_time: bool = by_time) -> float:
            return item["time_unix"] - start_s if by_time else item.get(step_key, 0)

        shown = [s for s in steps if not by_time or "time_unix" in s]
        if shown:
            xs, ys = [x_of(s) for s in shown], [s["reward_mean"] for s in shown]
            smooth = _smooth(ys, 10)
            if by_time:  # no line across a learner outage: break it where the session changes
                xs, ys, smooth = _break_at_sessions(shown, xs, ys, smooth)
            ax.plot(xs, ys, color="#1f77b4", alpha=0.35, lw=1, label="mean reward (per step)")
            ax.plot(xs, smooth, color="#1f77b4", lw=2, label="mean reward (10-step mean)")
        gone_shown = [s for s in gone if not by_time or "time_unix" in s]
        if gone_shown:
            ax.plot([x_of(s) for s in gone_shown], [s["reward_mean"] for s in gone_shown], "x", color="#7f7f7f",
                    ms=4, label="withdrawn steps (lost in a learner restart)")
        accuracy = [e for e in points if not by_time or "time_unix" in e]
        if accuracy:
            ax.plot([x_of(e) for e in accuracy], [e["accuracy"] for e in accuracy], "o-", color="#d62728", lw=2,
                    label="held-out greedy accuracy")
        restart_xs = [t - start_s for t in restarts_s] if by_time else [r.step for r in history.resumes]
        for i, x in enumerate(restart_xs):
            ax.axvline(x, color="#000000", ls="--", lw=1,
                       label="learner restart (from its checkpoint)" if i == 0 else None)
        for i, (down, up) in enumerate(outages if by_time else []):
            ax.axvspan(down - start_s, up - start_s, color="#d62728", alpha=0.15,
                       label="learner down" if i == 0 else None)
        ax.set_xlabel("wall time since start (s)" if by_time else "learner step")
        ax.grid(alpha=0.3)
        if not shown and not accuracy:
            ax.text(0.5, 0.5, "no learner steps recorded", ha="center", va="center", transform=ax.transAxes)
    values = rewards + [s["reward_mean"] for s in gone] + [e["accuracy"] for e in points]
    if values and 0 <= min(values) and max(values) <= 1:
        axes[0].set_ylim(-0.02, 1.02)
    if points:
        axes[0].set_ylabel("reward / accuracy")
        fig.suptitle("Reward and held-out accuracy")
    else:
        axes[0].set_ylabel("mean reward")
        fig.suptitle("Mean reward per learner step (no held-out accuracy measured in this run)")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def _break_at_sessions(steps: list[dict], *series: list[float]) -> tuple[list[float], ...]:
    """The series with a NaN (a gap in a plotted line) between two steps of different learner sessions."""
    out: tuple[list[float], ...] = tuple([] for _ in series)
    for i, step in enumerate(steps):
        if i and step.get("session") != steps[i - 1].get("session"):
            for column in out:
                column.append(math.nan)
        for column, values in zip(out, series, strict=True):
            column.append(values[i])
    return out


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def staleness_counts(steps: list[dict]) -> tuple[collections.Counter[int], collections.Counter[int] | None]:
    """(staleness -> groups trained with a gradient, staleness -> groups acknowledged without one) over the
    given (committed) steps; the second is None when the lines do not record it (older runs)."""
    with_gradient: collections.Counter[int] = collections.Counter()
    without: collections.Counter[int] = collections.Counter()
    recorded = False
    for s in steps:
        for key, value in (s.get("staleness") or {}).items():
            with_gradient[int(key)] += int(value)
        if "staleness_zero_variance" in s:
            recorded = True
            for key, value in (s["staleness_zero_variance"] or {}).items():
                without[int(key)] += int(value)
    return with_gradient, (without if recorded else None)


def staleness_figure(steps: list[dict]) -> Any:
    """How stale the groups of the committed steps were when trained, split by whether they had a gradient."""
    plt = _pyplot()
    with_gradient, without = staleness_counts(steps)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    counts = with_gradient + (without or collections.Counter())
    if counts:
        xs = list(range(0, max(counts) + 1))
        low = [with_gradient.get(x, 0) for x in xs]
        ax.bar(xs, low, color="#2ca02c", label="with a gradient")
        if without:
            ax.bar(xs, [without.get(x, 0) for x in xs], bottom=low, color="#c7e9c0",
                   label="without: all rewards equal")
            ax.legend(fontsize=8)
        ax.set_xticks(xs)
    else:
        ax.text(0.5, 0.5, "no trained groups recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("staleness when trained (learner version - oldest token version)")
    num_with, num_without = sum(with_gradient.values()), sum((without or {}).values())
    if without is None:
        ax.set_ylabel("groups trained with a gradient")
        ax.set_title(f"Staleness of groups trained with a gradient ({num_with}; equal-reward groups not counted)",
                     fontsize=10)
    else:
        ax.set_ylabel("trained groups")
        ax.set_title(f"Staleness of trained groups ({num_with + num_without}: {num_with} with a gradient, "
                     f"{num_without} without)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


#: how a life that ended is marked at its end (the launcher's or the timeline's word for it)
END_MARKERS = {"stopped": ("|", "#000000", "stopped cleanly"),
               "exited": ("x", "#ff7f0e", "exited without a clean stop"),
               "killed": ("x", "#d62728", "killed by a signal"),
               "lost": ("x", "#d62728", "ended without a final mark (killed)")}


def timeline_figure(lanes: dict[str, rundir.Lane], start_s: float) -> Any:
    """One lane per process: its states while alive, nothing while dead, restarts and deaths marked, and its
    busy share over the time it was alive."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.45 * max(1, len(lanes))))
    seen_states, seen_marks = set(), set()
    for row, lane in enumerate(lanes.values()):
        by_state: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for begin, end, state in lane.spans():
            by_state[state].append((begin - start_s, end - begin))
        for state, spans in by_state.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=STATE_COLORS.get(state, "#000000"))
            seen_states.add(state)
        for down, up in lane.outages():
            ax.broken_barh([(down - start_s, up - down)], (row - 0.08, 0.16), facecolors=DOWN_COLOR)
            seen_marks.add("down")
        for t in lane.restarts():
            ax.plot([t - start_s], [row], ">", color="#000000", ms=7)
            seen_marks.add("restart")
        for life in lane.lives:
            if life.ended in END_MARKERS:
                marker, color, _ = END_MARKERS[life.ended]
                ax.plot([life.end_s - start_s], [row], marker, color=color, ms=9, mew=2)
                seen_marks.add(life.ended)
        share = lane.busy_share()
        if share is not None:
            ax.text(1.0, row, f" {share:.0%} busy of {lane.ready_s():.0f} s ready\n ({lane.alive_s():.0f} s alive)",
                    va="center", ha="left", fontsize=8, transform=ax.get_yaxis_transform())
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)
    ax.set_xlabel("wall time since start (s)")
    if not lanes:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax.transAxes)
    handles: list[Any] = [Patch(color=STATE_COLORS.get(s, "#000000"), label=s) for s in STATE_COLORS
                          if s in seen_states]
    if "down" in seen_marks:
        handles.append(Patch(color=DOWN_COLOR, label="down (between a death and its restart)"))
    if "restart" in seen_marks:
        handles.append(Line2D([], [], ls="", marker=">", color="#000000", label="restart"))
    for ended, (marker, color, label) in END_MARKERS.items():
        if ended in seen_marks:
            handles.append(Line2D([], [], ls="", marker=marker, color=color, mew=2, label=label))
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    ax.set_title("When each process was busy or waiting (a lane ends at its process's last sign of life)")
    fig.tight_layout(rect=(0, 0.08 + 0.04 * (len(handles) > 6), 0.9, 1))
    return fig


def _save(fig: Any, path: Path, plt: Any) -> Path:
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraflow.deploy.plots", description="Draw a run directory's PNG plots.")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
