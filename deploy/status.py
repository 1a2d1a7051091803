"""``loraflow status``: the live picture of a running broker, as tables (or JSON), once or refreshing.

    loraflow status [config.toml] [--endpoint tcp://host:port] [--run RUN] [--watch [SECONDS]] [--json] [--timeout S]

The broker is found by ``--endpoint``, else the file named by ``broker.endpoint_file`` (written by a broker
bound to port 0), else ``broker.endpoint``. One StatsRequest is sent without registering (the broker answers
anyone; with ``security.enabled`` the ``security.client_key`` pair is used). :func:`render` turns the
snapshot (see broker/snapshot.py for its keys) into text; it reads the snapshot defensively so a status
command of one release can show a broker of another.

No broker answering is exit 1; where the config's run directory holds the summary ``loraflow run`` writes at
its end (:func:`ended_run`), the message says how that run ended, so ``loraflow status runs/<name>/config.toml``
after a run tells the operator its outcome rather than only that nothing listens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from loraflow.common.cli import config_from_args, config_parser
from loraflow.common.codes import ProtocolError
from loraflow.common.config import Config
from loraflow.common.transport import BrokerUnavailable, fetch_stats
from loraflow.deploy import rundir


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _share(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _pairs(mapping: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v}" for k, v in mapping.items()) if mapping else "none"


def _histogram(mapping: dict[str, Any]) -> str:
    return " ".join(f"{k}:{v}" for k, v in mapping.items()) if mapping else "-"


def text_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell, each line indented by two spaces."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def reward_failures(worker: dict[str, Any]) -> str:
    """Samples whose reward or environment failed (scored 0), from the worker's heartbeat counters."""
    value = (worker.get("counters") or {}).get("reward_failures")
    return str(value) if isinstance(value, int) else "-"


def integrity_lines(integrity: dict[str, Any], learner: dict[str, Any] | None = None) -> list[str]:
    """The policy check's section: mismatches by reason, the learner's trusted workers and audited steps (from
    its heartbeat counters: learner/trust.py), then one row per quarantined or probation worker process with its
    newest evidence (broker/quarantine.py)."""
    flagged = [*integrity.get("quarantined", []), *integrity.get("probation", [])]
    counters = (learner or {}).get("counters") or {}
    trust = (f"  learner trusts {counters['integrity_trusted']} worker process(es), audited "
             f"{counters.get('integrity_audited_steps', 0)} of {learner.get('step', '?')} steps"
             if isinstance(counters.get("integrity_trusted"), int) else "")
    lines = [f"integrity mismatches {_pairs(integrity.get('policy_mismatches', {}))}  "
             f"quarantined {integrity.get('num_quarantined', 0)}  probation {integrity.get('num_probation', 0)}"
             f"{trust}"]
    rows = []
    for w in flagged:
        last = (w.get("evidence") or [{}])[-1]
        rows.append([w.get("worker", "?"), str(w.get("session", ""))[:12], w.get("status", "?"),
                     f"{w.get('num_failed', 0)}/{w.get('num_checked', 0)}", last.get("reason", "-"),
                     f"v{last['version']}" if "version" in last else "-",
                     f"{last.get('num_off', 0)}/{last.get('num_checked', 0)}" if last else "-",
                     f"{last['max_abs_diff']:.3g}" if "max_abs_diff" in last else "-",
                     f"{_duration(last['age_s'])} ago" if "age_s" in last else "-"])
    if rows:
        lines += text_table(["WORKER", "SESSION", "STATUS", "FAILED", "REASON", "VERSION", "OFF/CHECKED", "MAX-DIFF",
                         "WHEN"], rows)
    return lines


def loop_line(loop: dict[str, Any]) -> str:
    """The broker loop's busy share, slowest pass and slowest step (loraflow.broker.stats) and its long passes."""
    passes = loop.get("passes", {})
    over_20 = sum(v for k, v in passes.items() if k == "inf" or (k.isdigit() and int(k) > 20))
    step = loop.get("slowest_step") or "-"
    return (f"loop      busy {_share(loop.get('busy_share'))} over {loop.get('window_s', 0):.0f}s  slowest pass "
            f"{loop.get('slowest_pass_ms', 0):.1f} ms (CPU {loop.get('slowest_pass_cpu_ms', 0):.1f})  "
            f"slowest step {step} {loop.get('slowest_step_ms', 0):.1f} ms  slowest gc "
            f"{loop.get('slowest_gc_ms', 0):.1f} ms  "
            f"passes > 20 ms since start {over_20}")


def render(snap: dict[str, Any]) -> str:
    """The snapshot of a Stats reply as a few lines and tables."""
    settings, prompts, buffer = snap.get("settings", {}), snap.get("prompts", {}), snap.get("buffer", {})
    rates = snap.get("rates", {})
    lines = [
        f"broker {snap.get('broker_id', '?')}  up {_duration(snap.get('uptime_s', 0))}  "
        f"version {snap.get('latest_version', 0)}  task {settings.get('task', '?')}  "
        f"group_size {settings.get('group_size', '?')}  groups/step {settings.get('groups_per_step', '?')}  "
        f"max_staleness {settings.get('max_staleness', '?')}",
        f"prompts   epoch {prompts.get('epoch', 0)}  next {prompts.get('index', 0)}  "
        f"queued {prompts.get('queued', 0)}  leased {prompts.get('leased', 0)}  "
        f"buffered {prompts.get('buffered', 0)}  training {prompts.get('training', 0)}  "
        f"trained {prompts.get('trained_total', 0)}" + ("  (all issued)" if prompts.get("exhausted") else ""),
        f"buffer    {buffer.get('groups', 0)} groups {_bytes(buffer.get('bytes', 0))}  "
        f"training {buffer.get('training_groups', 0)} groups {_bytes(buffer.get('training_bytes', 0))}  "
        f"bounds {buffer.get('max_groups', '?')} groups {_bytes(buffer.get('max_bytes', 0))}  "
        f"credit {snap.get('credit', '?')}  oldest {buffer.get('oldest_age_s', 0):.1f}s",
        f"staleness (versions:groups)  buffered {_histogram(buffer.get('staleness', {}))}  "
        f"served {_histogram(snap.get('served_staleness', {}))}",
        f"rates     in {rates.get('messages_in_per_s', 0):.0f} msg/s {_bytes(rates.get('bytes_in_per_s', 0))}/s  "
        f"out {rates.get('messages_out_per_s', 0):.0f} msg/s {_bytes(rates.get('bytes_out_per_s', 0))}/s  "
        f"groups {rates.get('groups_per_s', 0):.1f}/s  tokens {rates.get('tokens_per_s', 0):.0f}/s  "
        f"trained {rates.get('trained_groups_per_s', 0):.1f} groups/s",
        f"waiting   lease requests {snap.get('waiting', {}).get('lease_requests', 0)}  "
        f"batch requests {snap.get('waiting', {}).get('batch_requests', 0)}  "
        f"leases out {snap.get('leases', {}).get('outstanding', 0)}",
    ]
    asked, configured = settings.get("heartbeat_interval_asked_s", 0), settings.get("heartbeat_interval_s", 0)
    if asked > configured:
        lines.append(f"heartbeats every {asked:g} s, not {configured:g}: the fleet is over the broker's budget of "
                     f"{settings.get('max_heartbeats_per_second', 0):g} a second; death after "
                     f"{settings.get('heartbeat_timeout_s', 0):g} s silent")
    loop = snap.get("loop")
    if loop:
        lines.append(loop_line(loop))
    learner = snap.get("learner")
    if learner:
        lines.append(f"learner   {learner.get('id')}  {learner.get('state')}  v{learner.get('adapter_version', 0)}  "
                     f"step {learner.get('step', '-')}  checkpoint v{learner.get('checkpoint_version', '-')}  "
                     f"busy {_share(snap.get('learner_busy_share'))}  seen {learner.get('last_seen_s', 0):.1f}s ago  "
                     f"{learner.get('host', '')}:{learner.get('pid', '')}")
    else:
        lines.append("learner   none connected")
    workers = snap.get("workers", [])
    lines.append(f"workers   {len(workers)}")
    if workers:
        rows = [[w.get("id", "?"), w.get("state", "?"), str(w.get("adapter_version", 0)), str(w.get("leases", 0)),
                 str(w.get("groups_accepted", 0)), str(w.get("groups_rejected", 0)), reward_failures(w),
                 _share(w.get("busy_share")), f"{w.get('last_seen_s', 0):.1f}s", w.get("backend", ""),
                 f"{w.get('host', '')}:{w.get('pid', '')}"]
                for w in sorted(workers, key=lambda w: w.get("id", ""))]
        lines += text_table(["ID", "STATE", "VERSION", "LEASES", "ACCEPTED", "REJECTED", "REWARD-FAILED", "BUSY", "SEEN",
                         "BACKEND", "HOST:PID"], rows)
    adapters = snap.get("adapters", [])
    lines.append("adapters  " + (", ".join(f"v{a['version']} ({_bytes(a.get('num_bytes', 0))})" for a in adapters)
                                 if adapters else "none published"))
    lines += integrity_lines(snap.get("integrity") or {}, learner)
    lines.append(f"dropped   {_pairs(snap.get('dropped', {}))}")
    lines.append(f"rejected  {_pairs(snap.get('rejected', {}))}")
    auth, history = snap.get("auth", {}), snap.get("history") or {}
    encryption = {"curve": "on (CURVE, authorised keys only)", "off": "off"}.get(snap.get("encryption"), "?")
    lines.append(f"security  encryption {encryption}  failed handshakes {_pairs(auth)}   "
                 f"recovery  uncommitted groups {history.get('uncommitted_groups', 0)}  "
                 f"withdrawn versions {history.get('withdrawn') or '-'}")
    failed = snap.get("send_failed", {})
    if failed:
        lines.append(f"send failed  {_pairs(failed)}")
    return "\n".join(lines)


def ended_run(run_dir: Path) -> str | None:
    """How the last ``loraflow run`` in ``run_dir`` ended, from its summary.json; None without one (or an unreadable
    one: a run being written is not an error of the status command)."""
    path = rundir.summary_path(run_dir)
    try:
        summary = json.loads(path.read_text())
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None

    def number(key: str) -> float | None:  # a field of another release's summary may be missing or of a new type
        value = summary.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    def accuracy(key: str) -> str:
        value = number(key)
        return "-" if value is None else f"{100 * value:.1f}%"

    restarts = summary.get("restarts")
    lines = [f"the run in {run_dir} has ended ({path}, written {written}): {summary.get('stop_reason') or '?'}",
             f"  steps {summary.get('steps', '-')}  final version v{summary.get('final_version', '-')}  "
             f"base accuracy {accuracy('base_accuracy')}  final accuracy {accuracy('final_accuracy')}  "
             f"wall {_duration(number('wall_s') or 0)}  "
             f"restarts {_pairs(restarts if isinstance(restarts, dict) else {})}"]
    if summary.get("final_adapter"):
        lines.append(f"  final adapter {summary['final_adapter']}")
    if summary.get("error"):
        lines.append(f"  error {summary['error']}")
    return "\n".join(lines)


def resolve_endpoint(config: Config, flag_endpoint: str | None) -> str:
    if flag_endpoint:
        return flag_endpoint
    endpoint_file = config.broker.endpoint_file
    if endpoint_file and Path(endpoint_file).is_file():
        text = Path(endpoint_file).read_text().strip()
        if text:
            return text
    return config.broker.endpoint


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("loraflow status", "The live picture of a running broker.")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    parser.add_argument("--run", default="", metavar="RUN",
                        help="on a pool (loraflow pool): the picture of the submitted run RUN")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    config = config_from_args(args)
    endpoint = resolve_endpoint(config, args.flag_endpoint)
    security = None
    if config.security.enabled:
        from loraflow.common.security import client_security

        security = client_security(config, role="observer")  # a key file missing: SecurityError, exit 2
    try:
        while True:
            try:
                snap = fetch_stats(endpoint, timeout_s=args.timeout, security=security, run=args.run)
                text = json.dumps(snap, indent=None if args.watch else 2) if args.json else render(snap)
                ok = True
            except ProtocolError as exc:  # a run the pool does not hold (--run), say
                print(f"loraflow status: {exc}", file=sys.stderr)
                return 1
            except BrokerUnavailable as exc:
                text, ok = f"loraflow status: {exc}", False
                ended = ended_run(config.run_dir)
                if ended:
                    text += "\n" + ended
            if args.watch is None:
                print(text, file=sys.stdout if ok else sys.stderr)
                return 0 if ok else 1
            if not args.json:
                sys.stdout.write("\x1b[H\x1b[2J")  # clear the terminal
                text += f"\n\n{endpoint}  every {args.watch:g}s  (Ctrl-C to stop)"
            print(text, flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
