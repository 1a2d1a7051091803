"""CURVE authentication and encryption for every socket, with a role bound to each client key.

Key layout made by ``loraflow keys DIR`` (zmq.auth certificate files)::

    DIR/broker.key  broker.key_secret            the broker's pair (the public half goes to every client)
    DIR/<name>.key  <name>.key_secret            one pair per client machine or role; copy to that machine
    DIR/authorized/<role>/<name>.key             public keys the broker accepts, by role
                                                 (role: worker | learner | observer)

:func:`generate_keys` adds what is missing and keeps what exists, so running ``loraflow keys DIR`` again on a
directory in use is safe; every directory gets an ``observer`` pair (``loraflow status`` uses it).

The broker (:class:`ServerSecurity`) runs a ZAP authenticator thread that accepts a client only if its public
key lies under ``authorized/``; the ZAP User-Id of an accepted connection is ``"<role>:<name>"``, which zmq
attaches to every frame that client sends (``frame.get("User-Id")``), so the broker can enforce roles per
message: a key authorised as a worker cannot publish adapters or take batches. The authorised directory is
re-read when it changes, so ``loraflow keys DIR --worker new-host`` admits a new machine without a restart.
A refused key is logged by the name of its file when the directory holds its public half (``DIR/<name>.key``:
a pair made here whose authorisation was removed) and counted (``auth{refused}``). A client
(:class:`ClientSecurity`) needs the broker's public key and its own pair. All traffic, adapters included, is
encrypted once CURVE is on.

A key file that is missing is a config error (:class:`SecurityError` is a :class:`loraflow.common.config.ConfigError`:
exit code 2, not restarted), found at start-up by :func:`check_keys`; its message names the file, the setting
and the command that makes it.
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

from loraflow.common.config import ConfigError
from loraflow.common.logging import get_logger

KEY_ROLES = ("worker", "learner", "observer")
BROKER_KEY = "broker"
OBSERVER_KEY = "observer"  # the pair `loraflow status` uses when security.client_key is unset
log = get_logger("security")


class SecurityError(ConfigError):
    """Keys are missing or malformed; the message says which file, which setting and how to make it."""


@dataclass(slots=True, kw_only=True)
class KeyReport:
    """What :func:`generate_keys` did: (name, role) of the pairs it made, authorised again, or kept as they were."""

    made: list[tuple[str, str]] = field(default_factory=list)
    authorized: list[tuple[str, str]] = field(default_factory=list)  # an existing pair, authorised (again)
    kept: list[tuple[str, str]] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # every file written


def _check_name(name: str, role: str) -> None:
    if role not in KEY_ROLES:
        raise SecurityError(f"role {role!r} of key {name!r} must be one of {KEY_ROLES}")
    if name == BROKER_KEY or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise SecurityError(f"key name {name!r} must be letters, digits, '-', '_' or '.' and not 'broker'")


def authorized_roles(keys_dir: Path, name: str) -> list[str]:
    """The roles under which ``name``'s public key is authorised in ``keys_dir``."""
    return [role for role in KEY_ROLES if (keys_dir / "authorized" / role / f"{name}.key").is_file()]


def authorized_keys(keys_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Role -> names of the keys the broker accepts (``authorized/<role>/<name>.key``)."""
    base = Path(keys_dir) / "authorized"
    return {role: sorted(p.stem for p in (base / role).glob("*.key")) for role in KEY_ROLES}


def generate_keys(keys_dir: str | os.PathLike, clients: dict[str, str], *, observer: bool = False) -> KeyReport:
    """Make the broker pair and one pair per client name -> role where missing; keep the pairs that exist (an
    existing pair not authorised for its role is authorised; one authorised for another role is an error). With
    ``observer``, the ``observer`` pair is one of them, unless the directory has only observer keys of other
    names. A directory with broker.key but no broker.key_secret (a client's copy) is refused."""
    keys_dir = Path(keys_dir)
    if (keys_dir / f"{BROKER_KEY}.key").is_file() and not (keys_dir / f"{BROKER_KEY}.key_secret").is_file():
        raise SecurityError(f"{keys_dir} holds broker.key but not broker.key_secret: it is a client's copy (a new "
                            "broker pair here would not be the broker's); make keys in the broker's keys dir and "
                            "copy them here")
    keys_dir.mkdir(parents=True, exist_ok=True)
    report = KeyReport()
    if (keys_dir / f"{BROKER_KEY}.key_secret").is_file():
        report.kept.append((BROKER_KEY, "broker"))
    else:
        report.files += [Path(p) for p in zmq.auth.create_certificates(keys_dir, BROKER_KEY)]
        report.made.append((BROKER_KEY, "broker"))
    clients = dict(clients)
    other_observers = any(p.stem != OBSERVER_KEY for p in (keys_dir / "authorized" / "observer").glob("*.key"))
    if observer and "observer" not in clients.values() and OBSERVER_KEY not in clients and (
            (keys_dir / f"{OBSERVER_KEY}.key_secret").is_file() or not other_observers):
        clients[OBSERVER_KEY] = "observer"  # made, kept or authorised again, as any other pair
    for name, role in clients.items():
        _check_name(name, role)
    for name, role in clients.items():
        others = [r for r in authorized_roles(keys_dir, name) if r != role]
        if others:
            raise SecurityError(f"key {name!r} is authorised as a {others[0]} ({keys_dir}/authorized/{others[0]}/"
                                f"{name}.key); pick another name for the {role} key, or remove that file first")
    for name, role in clients.items():
        target = keys_dir / "authorized" / role / f"{name}.key"
        if (keys_dir / f"{name}.key_secret").is_file():
            if target.is_file():
                report.kept.append((name, role))
                continue
            public = keys_dir / f"{name}.key"
            if not public.is_file():
                raise SecurityError(f"{public} (the public half of {name}.key_secret) is missing; restore it or "
                                    f"remove {name}.key_secret to make a new pair")
            report.authorized.append((name, role))
        else:
            public, secret = (Path(p) for p in zmq.auth.create_certificates(keys_dir, name))
            report.files += [public, secret]
            report.made.append((name, role))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(public.read_bytes())
        report.files.append(target)
    for path in keys_dir.glob("*.key_secret"):
        path.chmod(0o600)
    return report


def _load_pair(keys_dir: Path, name: str, *, role: str) -> tuple[bytes, bytes]:
    path = keys_dir / f"{name}.key_secret"
    if not path.is_file():
        if name == BROKER_KEY:
            raise SecurityError(f"{path} is missing (security.keys_dir = \"{keys_dir}\" must hold the broker's key "
                                f"pair): make the keys with `loraflow keys {keys_dir}`")
        make = f"loraflow keys {keys_dir}" if name == OBSERVER_KEY else f"loraflow keys {keys_dir} --{role} {name}"
        raise SecurityError(f"{path} is missing (this {role}'s key pair \"{name}\", security.client_key, in "
                            f"security.keys_dir = \"{keys_dir}\"): make it with `{make}` where the keys are kept "
                            f"and copy it and broker.key to this machine")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise SecurityError(f"{path} holds no secret key (security.keys_dir): make a new pair with `loraflow keys`")
    return public, secret


def _load_public(keys_dir: Path, name: str) -> bytes:
    path = keys_dir / f"{name}.key"
    if not path.is_file():
        raise SecurityError(f"{path} is missing (the broker's public key, in security.keys_dir = \"{keys_dir}\"): "
                            f"copy broker.key from the directory `loraflow keys` made on the broker's machine")
    public, _ = zmq.auth.load_certificate(path)
    return public


@dataclass(slots=True, kw_only=True)
class ClientSecurity:
    """What a client socket needs: the broker's public key and its own pair."""

    broker_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, keys_dir: str | os.PathLike, client_key: str, *, role: str = "worker") -> ClientSecurity:
        """The pair ``client_key`` in ``keys_dir`` (``role`` only words the advice when a file is missing)."""
        keys_dir = Path(keys_dir)
        if not client_key:
            raise SecurityError("security.client_key must name this client's key pair in security.keys_dir")
        public, secret = _load_pair(keys_dir, client_key, role=role)
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
    _known: dict[bytes, Path] = field(default_factory=dict)  # public key -> DIR/<name>.key, authorised or not
    _stamp: tuple = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _auth: Any = None

    @classmethod
    def load(cls, keys_dir: str | os.PathLike) -> ServerSecurity:
        keys_dir = Path(keys_dir)
        public, secret = _load_pair(keys_dir, BROKER_KEY, role="broker")
        server = cls(keys_dir=keys_dir, public=public, secret=secret)
        server._reload()
        if not server._authorized:
            raise SecurityError(f"{keys_dir}/authorized/ holds no client keys (security.keys_dir); create some with "
                                f"`loraflow keys {keys_dir} --worker NAME --learner NAME`")
        return server

    def _reload(self) -> None:
        """Re-read authorized/<role>/*.key and DIR/*.key when any of them changed (new machines join without a
        restart; a refused key is named by its file)."""
        files = sorted((self.keys_dir / "authorized").glob("*/*.key"))
        pairs = sorted(p for p in self.keys_dir.glob("*.key") if p.stem != BROKER_KEY)
        stamp = tuple((str(p), p.stat().st_mtime_ns) for p in files + pairs)
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
        self._known = {zmq.auth.load_certificate(path)[0]: path for path in pairs}
        self._authorized, self._stamp = authorized, stamp

    def lookup(self, public_z85: bytes) -> tuple[str, str] | None:
        with self._lock:
            self._reload()
            return self._authorized.get(public_z85)

    def key_file(self, public_z85: bytes) -> Path | None:
        """The file in the keys dir holding this public key (authorised or not), if any."""
        with self._lock:
            self._reload()
            return self._known.get(public_z85)

    def callback(self, domain: str, public_z85: bytes) -> bool:
        """ZAP credentials check (runs on the authenticator thread)."""
        identity = self.lookup(public_z85)
        if identity is None:
            with self._lock:
                self.num_refused += 1
            path = self.key_file(public_z85)
            if path is not None:
                log.warning("auth_refused", key_file=str(path),
                            why=f"{path.name} is not under {self.keys_dir}/authorized/<role>/ (its authorisation "
                            f"was removed); authorise it again with `loraflow keys {self.keys_dir} --worker "
                            f"{path.stem}` (or --learner / --observer)")
            else:
                log.warning("auth_refused", key=public_z85.decode(errors="replace")[:12] + "…",
                            why=f"a key pair not made in {self.keys_dir} (another `loraflow keys` directory?): "
                            "give that client a pair from this one")
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
    return ClientSecurity.load(config.security.keys_dir, config.security.client_key or role, role=role or "worker")


def check_keys(config: Any, role: str) -> None:
    """Start-up check of the key files ``role`` (broker, worker, learner, observer) needs; raises SecurityError
    (a ConfigError) naming the missing file, the setting and the command that makes it."""
    if not config.security.enabled:
        return
    if role == "broker":
        ServerSecurity.load(config.security.keys_dir)
    else:
        client_security(config, role)
