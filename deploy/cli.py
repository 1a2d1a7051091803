"""The ``loraflow`` command: one dispatcher, each subcommand imported only when it runs.

    loraflow broker  [config.toml] [...]   the broker (rollout buffer, leases, adapter relay)
    loraflow worker  [config.toml] [...]   one rollout worker (hf, vllm or sim backend)
    loraflow learner [config.toml] [...]   the learner (use torchrun for several ranks)
    loraflow run     [config.toml] [...]   broker + workers + learner on this machine, supervised
    loraflow status  [config.toml] [...]   the live picture of a running broker (--run RUN: a pool's run)
    loraflow pool    [config.toml] [...]   one broker and base model running every run submitted to it
    loraflow submit  RUN.toml --pool DIR   add a run to a pool (prints its id); runs / cancel RUN list, stop
    loraflow keys    DIR [...]             CURVE key pairs for secure multi-machine runs
    loraflow config  [config.toml] [...]   print the resolved config or the configuration reference

A role is imported only for its own subcommand, so ``loraflow status`` starts in a fraction of a second and
the broker never imports torch. Every subcommand runs under :func:`loraflow.common.cli.run_main`: a config error is one
line and exit code 2, and output cut off by its reader (``loraflow config | head``) ends quietly.
"""

from __future__ import annotations

import importlib
import sys

from loraflow.common.cli import run_main

SUBCOMMANDS = {
    "broker": ("loraflow.broker.main", "the broker: rollout buffer, prompt leases, adapter relay"),
    "worker": ("loraflow.rollout_worker.main", "one rollout worker"),
    "learner": ("loraflow.learner.main", "the learner (LoRA on FSDP2; run under torchrun for several ranks)"),
    "run": ("loraflow.deploy.launcher", "a complete local run: broker, workers and learner, supervised"),
    "status": ("loraflow.deploy.status", "the live picture of a running broker"),
    "pool": ("loraflow.deploy.pool", "one broker on one base model running every run submitted to it"),
    "submit": ("loraflow.deploy.pool_cmds:main_submit", "add a run to a pool; prints its id"),
    "runs": ("loraflow.deploy.pool_cmds:main_runs", "the runs of a pool: state, step, reward, accuracy"),
    "cancel": ("loraflow.deploy.pool_cmds:main_cancel", "stop one run of a pool"),
    "keys": ("loraflow.deploy.keys", "generate CURVE key pairs"),
    "config": ("loraflow.deploy.config_cmd", "print the resolved config or the configuration reference"),
}


def usage() -> str:
    lines = ["usage: loraflow <command> [args]", "", "commands:"]
    lines += [f"  {name:<9}{text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "`loraflow <command> --help` shows each command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"loraflow: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, _, function = SUBCOMMANDS[name][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"loraflow {name}: not available in this installation ({exc})", file=sys.stderr)
            return 2
        raise
    return run_main(f"loraflow {name}", lambda: getattr(module, function or "main")(rest))


if __name__ == "__main__":
    sys.exit(main())
