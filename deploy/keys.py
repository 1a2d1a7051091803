"""``loraflow keys DIR``: CURVE key pairs for the broker and its clients, in the layout common/security reads.

    loraflow keys keys/                                  broker + one worker, learner and observer key
    loraflow keys keys/ --worker gpu-1 --learner trainer broker + these keys + an observer key
    loraflow keys keys/ --worker gpu-3 --worker gpu-4    add machines later (the broker picks them up live)

Every directory gets an ``observer`` pair (what ``loraflow status`` uses). On a directory that exists, only what
is missing is made; existing pairs are kept and listed, so running it again is safe.

Copy ``DIR/broker.key`` (public) and ``DIR/<name>.key_secret`` to each client machine and set
``security.enabled = true``, ``security.keys_dir`` and ``security.client_key = "<name>"`` in its config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraflow.common.security import KEY_ROLES, SecurityError, authorized_keys, generate_keys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loraflow keys", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("keys_dir", help="directory for the key files (created if missing)")
    for role in KEY_ROLES:
        parser.add_argument(f"--{role}", action="append", default=[], metavar="NAME",
                            help=f"add a {role} key pair with this name (repeatable)")
    args = parser.parse_args(argv)
    clients = {name: role for role in KEY_ROLES for name in getattr(args, role)}
    keys_dir = Path(args.keys_dir)
    if not clients and not (keys_dir / "broker.key_secret").exists():
        clients = {role: role for role in KEY_ROLES}
    try:
        report = generate_keys(keys_dir, clients, observer=True)
    except SecurityError as exc:
        print(f"loraflow keys: {exc}", file=sys.stderr)
        return 2
    for verb, entries in (("made", report.made), ("authorised", report.authorized), ("kept", report.kept)):
        for name, role in entries:
            where = f"{keys_dir}/{name}.key_secret" + ("" if role == "broker" else f", authorized/{role}/{name}.key")
            print(f"{verb:<10} {role} key '{name}'  ({where})")
    for name, role in report.made + report.authorized:
        if role != "broker":
            print(f"{role} key '{name}': copy {keys_dir}/broker.key and {keys_dir}/{name}.key_secret to its machine; "
                  f"set security.client_key = \"{name}\"" + (" (or leave it unset)" if name == role else ""))
    accepted = "; ".join(f"{role} {', '.join(names)}" for role, names in authorized_keys(keys_dir).items() if names)
    print(f"the broker accepts: {accepted}")
    return 0
