"""Metrics text and snapshot; the role packages talk only through common/."""

from __future__ import annotations

import ast
import urllib.request
from pathlib import Path

from loraflow.common.metrics import Metrics, serve_prometheus
from loraflow.common.timeline import Timeline, read_timeline

REPO = Path(__file__).resolve().parents[2]
ROLES = ("broker", "rollout_worker", "learner")


def test_counters_gauges_and_prometheus_endpoint() -> None:
    metrics = Metrics()
    metrics.inc("rejected", reason="malformed")
    metrics.inc("rejected", 2, reason="oversize")
    metrics.set("buffer_groups", 3)
    assert metrics.total("rejected") == 3 and metrics.counter("rejected", reason="oversize") == 2
    snap = metrics.snapshot()
    assert snap["counters"]["rejected"] == {"reason=malformed": 1, "reason=oversize": 2}
    server = serve_prometheus(metrics, 0, host="127.0.0.1")
    try:
        port = server.server_address[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'loraflow_rejected_total{reason="oversize"} 2' in text
    assert "loraflow_buffer_groups 3" in text


def test_timeline_writes_only_changes(tmp_path: Path) -> None:
    timeline = Timeline.for_process(tmp_path, "worker-a")
    for state in ("waiting", "waiting", "generating", "waiting"):
        timeline.mark(state)
    with open(timeline.path, "a") as f:
        f.write('{"t": 1')  # a torn last line (process killed mid-write) is skipped
    assert [s for _, s in read_timeline(timeline.path)] == ["waiting", "generating", "waiting"]


def imported_top_level(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_roles_import_only_common_never_each_other() -> None:
    for role in (*ROLES, "common"):
        for path in (REPO / role).rglob("*.py"):
            others = imported_top_level(path) & ({*ROLES, "deploy"} - {role})
            assert not others, f"{path.relative_to(REPO)} imports {sorted(others)}; roles talk only through common/"


def test_broker_and_common_core_never_import_torch_at_module_level() -> None:
    for path in [*(REPO / "broker").rglob("*.py"), REPO / "common" / "framing.py", REPO / "common" / "protocol.py",
                 REPO / "common" / "codec.py", REPO / "common" / "group_checks.py",
                 REPO / "common" / "transport.py", REPO / "common" / "config.py"]:
        tree = ast.parse(path.read_text())
        top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
        assert "torch" not in top, f"{path.relative_to(REPO)} imports torch; the broker must stay torch-free"
