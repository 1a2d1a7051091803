"""``loraflow submit`` / ``runs`` / ``cancel``: add a run to a pool, list its runs, stop one.

    loraflow submit RUN.toml --pool POOL_DIR [--id ID] [--set section.key=value ...]
    loraflow runs --pool POOL_DIR [--json]
    loraflow cancel RUN --pool POOL_DIR [--reason TEXT]

    loraflow submit RUN.toml --connect TENANT.toml [--id ID] [--set ...]     a tenant, over the network
    loraflow cancel RUN --connect TENANT.toml                                (CURVE: the key owns its runs)
    loraflow status TENANT.toml --run RUN                                    watch one of its runs

``POOL_DIR`` is the run directory of a ``loraflow pool`` (it holds the pool's resolved ``config.toml``). Submit
checks the run's settings against the pool's config before anything is written (a setting only the pool owns, or
one the config rules refuse, is one line naming the key, exit 2), then writes ``runs/<id>/submitted.toml``; the
pool's broker picks it up within a second and the pool starts its processes. The id is ``--id``, else the run
file's ``run.name`` when it sets one, else ``run-N`` (the first free N). Runs lists every run with its state
(submitted, refused, running, finished, cancelled, failed), learner step, mean reward of its last step, newest
held-out accuracy and the version it was measured at, read from the run directories (nothing needs the pool to
answer). Cancel writes ``runs/<id>/cancelled``: the broker stops leasing that run's prompts and the pool stops
its processes (the learner writes its last adapter first).

A tenant elsewhere submits and cancels through the pool's broker instead (``--connect``: a config naming
``broker.endpoint`` and ``[security]`` ``enabled``, ``keys_dir`` and ``client_key``, the tenant's observer key
from ``loraflow keys DIR --observer NAME``). The broker checks the run as submit does here and records the key
as the run's owner; only that key (and the pool's own observer key) may then watch or cancel the run
(:mod:`loraflow.broker.pool`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loraflow.common import pool_runs
from loraflow.common.cli import run_main
from loraflow.common.codes import ProtocolError
from loraflow.common.config import ConfigError, apply_override, load_config
from loraflow.common.pool_runs import read_state
from loraflow.common.protocol import RunCancel, RunReply, RunSubmit
from loraflow.deploy import rundir
from loraflow.deploy.status import text_table


def _pool_config(pool_dir: str) -> Any:
    path = Path(pool_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"--pool {pool_dir}: no config.toml there; give the run directory of a loraflow pool")
    return load_config(path)


def submit(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loraflow submit", description="Add a run to a running pool.")
    parser.add_argument("config", help="the run's settings (TOML: the sections a run may set)")
    _where(parser)
    parser.add_argument("--id", default="", help="the run's id (default: its run.name, else run-N)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides")
    args = parser.parse_args(argv)
    settings = pool_runs.read_settings(Path(args.config))
    for override in args.overrides:
        apply_override(settings, override)
    if args.connect:
        reply = _ask(args.connect, RunSubmit(run=args.id, settings=pool_runs.settings_toml(settings)))
        print(reply.run)
        return 0
    print(pool_runs.submit(_pool_config(args.pool), settings, args.id))
    return 0


def _where(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--pool", help="the pool's run directory (on the pool's machine)")
    where.add_argument("--connect", metavar="TENANT.toml", help="through the pool's broker as a tenant: a config "
                       "with broker.endpoint and [security] enabled, keys_dir, client_key")


def _ask(tenant_file: str, record: Any) -> Any:
    """One control message to the pool's broker as the tenant ``tenant_file`` names; a refusal is a ConfigError."""
    from loraflow.common.security import client_security
    from loraflow.common.transport import ask

    tenant = load_config(Path(tenant_file))
    if not tenant.broker.endpoint or not tenant.security.enabled:
        raise ConfigError(f"--connect {tenant_file}: set broker.endpoint and security.enabled = true with keys_dir "
                          "and client_key (the tenant's observer key owns the runs it submits)")
    try:
        return ask(tenant.broker.endpoint, record, RunReply, what=type(record).__name__,
                   security=client_security(tenant, "observer"), timeout_s=10.0)
    except ProtocolError as exc:
        raise ConfigError(str(exc)) from None


def run_rows(pool: Any) -> list[dict[str, Any]]:
    """One row per run of the pool, from its directory."""
    rows = []
    root = pool_runs.runs_dir(pool)
    for directory in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
        state = read_state(directory)
        refused = directory / pool_runs.REFUSED
        if refused.exists():
            state = {"state": "refused", "reason": refused.read_text().strip()}
        metrics = rundir.read_jsonl(rundir.metrics_path(directory))
        last = metrics[-1] if metrics else {}
        evals = [e for e in rundir.read_jsonl(rundir.evals_path(directory)) if e.get("kind") != "base"]
        rows.append({"run": directory.name, "state": state.get("state", "submitted"),
                     "reason": state.get("reason", ""), "step": last.get("step"), "version": last.get("version"),
                     "reward": last.get("reward_mean"), "accuracy": evals[-1]["accuracy"] if evals else None,
                     "accuracy_version": evals[-1]["version"] if evals else None,
                     "weight": _weight(pool, directory), "owner": pool_runs.owner_of(pool, directory.name)})
    return rows


def _weight(pool: Any, directory: Path) -> float:
    """The run's ``run.weight`` (its share of a shared engine): its own setting, else the pool's."""
    try:
        run = pool_runs.read_settings(directory / pool_runs.SUBMITTED).get("run", {})
    except (OSError, ConfigError):
        run = {}
    return float(run.get("weight", pool.run.weight)) if isinstance(run, dict) else pool.run.weight


def render_rows(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs in this pool (loraflow submit RUN.toml --pool DIR adds one)"
    headers = ["run", "state", "step", "version", "reward", "held-out", "reason"]
    if any(row["weight"] != 1.0 for row in rows):
        headers.insert(2, "weight")
    if any(row["owner"] for row in rows):
        headers.insert(1, "owner")

    def cell(row: dict[str, Any], key: str) -> str:
        if key == "held-out":
            acc = row["accuracy"]
            return "-" if acc is None else f"{acc:.1%} (v{row['accuracy_version']})"
        value = row[key]
        if key == "reward":
            return "-" if value is None else f"{value:.3f}"
        if key == "version":
            return "-" if value is None else f"v{value}"
        return "-" if value is None or value == "" else str(value)[:80]

    return "\n".join(text_table(headers, [[cell(row, h) for h in headers] for row in rows]))


def runs(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loraflow runs", description="The runs of a pool.")
    parser.add_argument("--pool", required=True, help="the pool's run directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args(argv)
    rows = run_rows(_pool_config(args.pool))
    print("\n".join(json.dumps(row) for row in rows) if args.json else render_rows(rows))
    return 0


def cancel(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loraflow cancel", description="Stop one run of a pool.")
    parser.add_argument("run", help="the run's id (loraflow runs lists them)")
    _where(parser)
    parser.add_argument("--reason", default="loraflow cancel", help="why (kept in the run's state)")
    args = parser.parse_args(argv)
    if args.connect:
        _ask(args.connect, RunCancel(run=args.run, reason=args.reason))
    else:
        pool_runs.cancel(_pool_config(args.pool), args.run, args.reason)
    print(f"cancelling {args.run}: its leases stop now; the pool stops its processes within a second")
    return 0


def main_submit(argv: list[str]) -> int:
    return run_main("loraflow submit", lambda: submit(argv))


def main_runs(argv: list[str]) -> int:
    return run_main("loraflow runs", lambda: runs(argv))


def main_cancel(argv: list[str]) -> int:
    return run_main("loraflow cancel", lambda: cancel(argv))

