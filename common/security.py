"""CURVE authentication and encryption for every socket, with a role bound to each client key.

Key layout made by ``loraflow keys DIR`` (zmq.auth certificate files)::

    DIR/broker.key  broker.key_secret            the broker's pair (the public half goes to every client)
    DIR/<name>.key  <name>.key_secret            one pair per client machine or role; copy to that machine
    DIR/authorized/<role>/<name>.key             public keys the broker accepts, by role
                                                 (role: worker | learner | observer)

The broker (:class:`ServerSecurity`) runs a ZAP authenticator thread that accepts a client only if its public
key lies under ``authorized/``; the ZAP User-Id of an accepted connection is ``"<role>:<name>"``, which zmq
attaches to every frame that client sends (``frame.get("User-Id")``), so the broker can enforce roles per
message: a key authorised as a worker cannot publish adapters or take batches. The authorised directory is
re-read when it changes, so ``loraflow keys DIR --worker new-host`` admits a new machine without a restart.
Refused handshakes are counted (``auth_refused``). A client (:class:`ClientSecurity`) needs the broker's public
key and its own pair. All traffic, adapters included, is encrypted once CURVE is on.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common.logging import get_logger

KEY_ROLES = ("worker", "learner", "observer")
BROKER_KEY = "broker"
log = get_logger("security")


class SecurityError(ValueError):
    """Keys are missing or malformed; the message says which file and how to make it."""


def generate_keys(keys_dir: str | os.PathLike, clients: dict[str, str]) -> list[Path]:
    """Create the broker pair (if missing) and one pair per client name -> role; returns files written."""
    keys_dir = Path(keys_dir)
    keys_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if not (keys_dir / f"{BROKER_KEY}.key_secret").is_file():
        written += [Path(p) for p in zmq.auth.create_certificates(keys_dir, BROKER_KEY)]
    for name, role in clients.items():
        if role not in KEY_ROLES:
            raise SecurityError(f"role {role!r} of key {name!r} must be one of {KEY_ROLES}")
        if name == BROKER_KEY or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise SecurityError(f"key name {name!r} must be letters, digits, '-', '_' or '.' and not 'broker'")
        if (keys_dir / f"{name}.key_secret").is_file():
            raise SecurityError(f"{keys_dir / name}.key_secret exists already; pick another name")
        public, secret = zmq.auth.create_certificates(keys_dir, name)
        authorized = keys_dir / "authorized" / role
        authorized.mkdir(parents=True, exist_ok=True)
        target = authorized / f"{name}.key"
        target.write_bytes(Path(public).read_bytes())
        written += [Path(public), Path(secret), target]
    for path in keys_dir.glob("*.key_secret"):
        path.chmod(0o600)
    return written


def _load_pair(keys_dir: Path, name: str) -> tuple[bytes, bytes]:
    path = keys_dir / f"{name}.key_secret"
    if not path.is_file():
        raise SecurityError(f"{path} is missing; create it with `loraflow keys {keys_dir}` "
                            f"(and copy it to this machine)")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise SecurityError(f"{path} holds no secret key")
    return public, secret


def _load_public(keys_dir: Path, name: str) -> bytes:
    path = keys_dir / f"{name}.key"
    if not path.is_file():
        raise SecurityError(f"{path} is missing; copy the broker's public key from the key directory")
    public, _ = zmq.auth.load_certificate(path)
    return public


@dataclass(slots=True, kw_only=True)
class ClientSecurity:
    """What a client socket needs: the broker's public key and its own pair."""

    broker_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, keys_dir: str | os.PathLike, client_key: str) -> ClientSecurity:
        keys_dir = Path(keys_dir)
        if not client_key:
            raise SecurityError("security.client_key must name this client's key pair in security.keys_dir")
        public, secret = _load_pair(keys_dir, client_key)
        return cls(broker_public=_load_public(keys_dir, BROKER_KEY), public=public, secret=secret)

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.broker_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class _RoleAuthenticator(ThreadAuthenticator):
    """ZAP handler whose User-Id for an accepted key is "<role>:<name>"."""

    def __init__(self, ctx: zmq.Context, server: ServerSecurity) -> None:
        super().__init__(ctx)
        self._server = server

    def curve_user_id(self, client_public_key: bytes) -> str:
        identity = self._server.lookup(z85.encode(client_public_key))
        return f"{identity[0]}:{identity[1]}" if identity else "unknown:?"


@dataclass(slots=True, kw_only=True)
class ServerSecurity:
    """The broker's side: its pair, the authorised keys by role, and the ZAP authenticator thread."""

    keys_dir: Path
    public: bytes
    secret: bytes
    num_refused: int = 0
    _authorized: dict[bytes, tuple[str, str]] = field(default_factory=dict)
    _stamp: tuple = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _auth: Any = None

    @classmethod
    def load(cls, keys_dir: str | os.PathLike) -> ServerSecurity:
        keys_dir = Path(keys_dir)
        public, secret = _load_pair(keys_dir, BROKER_KEY)
        server = cls(keys_dir=keys_dir, public=public, secret=secret)
        server._reload()
        if not server._authorized:
            raise SecurityError(f"{keys_dir}/authorized/ holds no client keys; create some with "
                                f"`loraflow keys {keys_dir} --worker NAME --learner NAME`")
        return server

    def _reload(self) -> None:
        """Re-read authorized/<role>/*.key when any of them changed (new machines join without a restart)."""
        files = sorted((self.keys_dir / "authorized").glob("*/*.key"))
        stamp = tuple((str(p), p.stat().st_mtime_ns) for p in files)
        if stamp == self._stamp:
            return
        authorized = {}
        for path in files:
            role = path.parent.name
            if role not in KEY_ROLES:
                log.warning("ignored_key_dir", path=str(path.parent), roles=KEY_ROLES)
                continue
            public, _ = zmq.auth.load_certificate(path)
            authorized[public] = (role, path.stem)
        self._authorized, self._stamp = authorized, stamp

    def lookup(self, public_z85: bytes) -> tuple[str, str] | None:
        with self._lock:
            self._reload()
            return self._authorized.get(public_z85)

    def callback(self, domain: str, public_z85: bytes) -> bool:
        """ZAP credentials check (runs on the authenticator thread)."""
        identity = self.lookup(public_z85)
        if identity is None:
            with self._lock:
                self.num_refused += 1
            log.warning("auth_refused", key=public_z85.decode(errors="replace")[:12] + "…")
            return False
        return True

    def start(self, ctx: zmq.Context) -> None:
        """Start the ZAP authenticator on ``ctx`` (before binding the server socket)."""
        self._auth = _RoleAuthenticator(ctx, self)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def role_of(frame: Any) -> str | None:
    """The authenticated role of the peer that sent ``frame`` (a zmq.Frame), or None without CURVE."""
    try:
        user_id = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return user_id.split(":", 1)[0] if user_id else None


def client_security(config: Any, role: str = "") -> ClientSecurity | None:
    """Client-side security for a loaded Config (None when security is off). The key pair is
    ``security.client_key``, else the one named after the client's ``role`` (``loraflow keys DIR`` makes
    ``worker``, ``learner`` and ``observer``), so one config serves every role of a single-machine run."""
    if not config.security.enabled:
        return None
    return ClientSecurity.load(config.security.keys_dir, config.security.client_key or role)
