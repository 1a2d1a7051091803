"""Counters and gauges of one process, readable as a dict (stats replies) and as Prometheus text.

Metrics are not log lines: every drop, rejection and error increments a counter with a ``reason`` label,
so that ``loraflow status`` and Prometheus can account for every message. :func:`serve_prometheus` exposes
``/metrics`` on a port from a daemon thread (the stdlib http.server; no extra dependency).
"""

from __future__ import annotations

import http.server
import threading
from collections import defaultdict
from typing import Any

LabelKey = tuple[tuple[str, str], ...]


class Metrics:
    """Named counters (monotonic) and gauges (set), each with optional labels."""

    def __init__(self, namespace: str = "loraflow") -> None:
        self.namespace = namespace
        self._counters: dict[str, dict[LabelKey, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[LabelKey, float]] = defaultdict(dict)
        self._lock = threading.Lock()

    def inc(self, name: str, amount: float = 1, **labels: Any) -> None:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self._lock:
            self._counters[name][key] += amount

    def set(self, name: str, value: float, **labels: Any) -> None:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self._lock:
            self._gauges[name][key] = float(value)

    def counter(self, name: str, **labels: Any) -> float:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self._lock:
            return self._counters.get(name, {}).get(key, 0.0)

    def total(self, name: str) -> float:
        """Sum of a counter over all its label values."""
        with self._lock:
            return sum(self._counters.get(name, {}).values())

    def snapshot(self) -> dict[str, Any]:
        """{"counters": {name: {label text: value}}, "gauges": {...}}; label text is "k=v,k=v" or ""."""
        with self._lock:
            return {
                "counters": {n: {_label_text(k): v for k, v in series.items()} for n, series in self._counters.items()},
                "gauges": {n: {_label_text(k): v for k, v in series.items()} for n, series in self._gauges.items()},
            }

    def prometheus_text(self) -> str:
        lines = []
        with self._lock:
            for kind, table in (("counter", self._counters), ("gauge", self._gauges)):
                for name, series in sorted(table.items()):
                    full = f"{self.namespace}_{name}" + ("_total" if kind == "counter" else "")
                    lines.append(f"# TYPE {full} {kind}")
                    for key, value in sorted(series.items()):
                        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
                        lines.append(f"{full}{{{labels}}} {value:g}" if labels else f"{full} {value:g}")
        return "\n".join(lines) + "\n"


def _label_text(key: LabelKey) -> str:
    return ",".join(f"{k}={v}" for k, v in key)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def serve_prometheus(metrics: Metrics, port: int, host: str = "0.0.0.0") -> http.server.ThreadingHTTPServer:
    """Serve ``GET /metrics`` from a daemon thread; returns the server (``.server_address`` has the port)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            body = metrics.prometheus_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="prometheus", daemon=True).start()
    return server
