"""``loraflow config``: the resolved config of a file plus overrides, or the reference of every setting.

    loraflow config [config.toml] [--set section.key=value ...]   the resolved config, as TOML, after every
                                                                  role's start-up checks (deploy/preflight.py:
                                                                  a failure is one line and exit code 2)
    loraflow config --reference [--markdown]                      every section and key: type, default, unit,
                                                                  range and meaning, generated from common/config.py
    python -m loraflow.deploy.config_cmd --update-readme README.md         rewrite the README's copy of the reference

The reference comes from the field declarations themselves (:func:`loraflow.common.schema.describe`), so it cannot
drift from what the loader accepts; the README's configuration reference is this command's Markdown output.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

from loraflow.common.cli import config_from_args, config_parser, run_main
from loraflow.common.config import Config, to_toml
from loraflow.common.schema import Rule, describe
from loraflow.common.startup import demo_base_command
from loraflow.common.tiny_model import find_demo_base
from loraflow.deploy import preflight


def sections(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted section name, record class) of every config table, nested ones after their parent."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            name = f"{prefix}{f.name}"
            out.append((name, kind))
            out += sections(kind, f"{name}.")
    return out


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _range(rule: Rule, type_text: str) -> str:
    parts = []
    if rule.choices is not None:
        parts.append(" | ".join(str(c) for c in rule.choices))
    if rule.ge is not None:
        parts.append(f">= {_num(rule.ge)}")
    if rule.gt is not None:
        parts.append(f"> {_num(rule.gt)}")
    if rule.le is not None:
        parts.append(f"<= {_num(rule.le)}")
    if rule.max_len is not None:
        parts.append(f"at most {rule.max_len} {'items' if type_text.startswith(('list', 'dict')) else 'chars'}")
    return ", ".join(parts)


def _default(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | list | bool) else f"{value:g}" if isinstance(value, float) else str(value)


def reference_rows(cls: type) -> list[tuple[str, str, str, str, str, str]]:
    """(key, type, default, unit, range, meaning) of the scalar settings of one section."""
    rows = []
    for name, type_text, default, rule in describe(cls):
        if dataclasses.is_dataclass(default):
            continue  # a nested section, listed on its own
        rows.append((name, type_text, _default(default), rule.unit, _range(rule, type_text), rule.doc))
    return rows


def reference_markdown() -> str:
    lines = []
    for name, cls in sections():
        doc = (cls.__doc__ or "").strip()
        lines += [f"#### `[{name}]`", ""]
        if doc and not doc.startswith(cls.__name__ + "("):
            lines += [doc, ""]
        lines += ["| key | type | default | unit | allowed | meaning |", "|---|---|---|---|---|---|"]
        for key, kind, default, unit, allowed, meaning in reference_rows(cls):
            cells = [f"`{key}`", kind, f"`{default}`", unit, allowed, meaning]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def reference_text() -> str:
    lines = []
    for name, cls in sections():
        lines.append(f"[{name}]")
        for key, kind, default, unit, allowed, meaning in reference_rows(cls):
            detail = ", ".join(x for x in (kind, unit, allowed) if x)
            lines.append(f"  {key} = {default}  ({detail})  {meaning}".rstrip())
        lines.append("")
    return "\n".join(lines)


README_START, README_END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def update_readme(path: str) -> None:
    """Replace the text between the README's config-reference markers with the generated reference."""
    text = Path(path).read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{path}: no {README_START} ... {README_END} markers")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    Path(path).write_text(f"{head}{README_START}\n{reference_markdown().strip()}\n{README_END}{tail}")


def main(argv: list[str]) -> int:
    return run_main("loraflow config", lambda: _main(argv))


def _main(argv: list[str]) -> int:
    parser = config_parser("loraflow config", "Print the resolved config, or the reference of every setting.")
    parser.add_argument("--reference", action="store_true", help="print every section and key with its meaning")
    parser.add_argument("--markdown", action="store_true", help="with --reference: as Markdown tables")
    parser.add_argument("--update-readme", metavar="README", help="rewrite the reference section of this file")
    args = parser.parse_args(argv)
    if args.update_readme:
        update_readme(args.update_readme)
        return 0
    if args.reference:
        print(reference_markdown() if args.markdown else reference_text())
        return 0
    config = config_from_args(args)
    preflight.check(config)
    print(to_toml(config))
    if config.model.path == "builtin:demo" and find_demo_base(config.run.seed, config.model.cache_dir or None) is None:
        print(f"note: builtin:demo is not built on this machine yet: `loraflow run` builds it; roles started by hand "
              f"need `{demo_base_command(config)}` first", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
