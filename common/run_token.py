"""The run token: what a learner's Hello must carry when CURVE is off (``security.enabled = false``).

Without CURVE the broker cannot tell one client from another: anyone who reaches its port could say Hello as
the learner, take and acknowledge batches, publish adapters and fence the real learner. The run token makes
that a deliberate act rather than a typo away: a random secret the learner presents in ``Hello.token``.

- ``security.run_token`` set: that is the token (give both the broker and the learner the same value, e.g. a
  learner on another host without a shared run directory).
- else the broker, on its first start, writes a random token to ``security.run_token_file`` (default
  ``<run_dir>/broker/run_token``, mode 0600) and keeps it across restarts; the learner reads the same file
  (``loraflow run``, systemd and the by-hand recipes share the run directory; on another host, copy the file
  or point ``security.run_token_file`` at a copy).

It is a shared secret sent in clear text: it guards against mistakes and casual misuse on a trusted network,
not against someone who can read the traffic or the run directory. Workers need no token (their groups are
checked, bound to their leases and deduplicated); with ``security.enabled`` the learner role is bound to CURVE
keys instead and no token is used.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

TOKEN_BYTES = 16


def token_path(config: Any) -> Path:
    """Where the run token is kept: ``security.run_token_file``, else ``<run_dir>/broker/run_token``."""
    return Path(config.security.run_token_file or config.run_dir / "broker" / "run_token")


def broker_token(config: Any) -> str:
    """The token the broker requires: ``security.run_token``, else the file's, made on the first start."""
    if config.security.run_token:
        return config.security.run_token
    path = token_path(config)
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(TOKEN_BYTES)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def learner_token(config: Any) -> str:
    """The token a learner presents: ``security.run_token``, else the broker's file ("" when there is none)."""
    if config.security.run_token:
        return config.security.run_token
    try:
        return token_path(config).read_text().strip()
    except OSError:
        return ""
