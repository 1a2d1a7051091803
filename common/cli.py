"""Command-line arguments every role shares: the config file, ``--set`` overrides and the common knobs.

Each role's ``main(argv)`` builds its parser with :func:`config_parser`, then calls :func:`config_from_args`,
so ``loraflow worker cfg.toml --endpoint tcp://host:5555 --set worker.temperature=0.7`` and
``python -m loraflow.rollout_worker cfg.toml ...`` behave the same.

:func:`run_main` is the one place where an entry point's config-class failures become what an operator and a
supervisor need: one line on stderr (``loraflow worker: config error: worker.reward = ...``), no traceback, exit
code :data:`EXIT_CONFIG_ERROR`. Config-class errors are one class, never recognised by their text:
:class:`loraflow.common.config.ConfigError` (a bad file, ``--set``, value, or a setting the start-up checks of
:mod:`loraflow.common.startup` and each role refuse) and its subclasses (``SecurityError``: key files; ``DatasetError``:
a dataset that cannot be used). Every role's ``main`` and the ``loraflow`` dispatcher run under it; it also
ends a command quietly when the reader of its output goes away (``loraflow config | head``).

A ``torch.OutOfMemoryError`` (a GPU's memory, anywhere in the process, also as the cause of another error)
becomes one line naming the settings that size that role's memory (:data:`OUT_OF_MEMORY_SETTINGS`) with torch's
own account of the GPU, and exit code :data:`EXIT_OUT_OF_MEMORY`: distinct, so a supervisor or a job script can
tell it from a crash, yet restarted by ``loraflow run`` like one (the memory may have been held by a process
that was exiting); after ``launch.max_restarts`` the run's error ends with that line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Callable

from loraflow.common.config import Config, ConfigError, load_config

#: exit codes the supervisor (deploy/processes.py) and the systemd units act on: restarting will not help
EXIT_CONFIG_ERROR = 2  # a usage or config error (argparse exits 2 too)
EXIT_OUT_OF_MEMORY = 3  # torch.OutOfMemoryError: a GPU ran out of memory (restarted like a crash)
EXIT_REPLACED = 4  # a learner fenced by the broker: another learner process took over the run
EXIT_USER_CODE_STUCK = 5  # a worker's reward/environment/agent code still computing past its timeout (restarted
#                           like a crash: a new process is the one way to be rid of the thread)
EXIT_BROKEN_PIPE = 141  # what a shell reports for a command killed by SIGPIPE (128 + 13), like `cat` in `| head`

#: command -> what to change when its GPU runs out of memory
OUT_OF_MEMORY_SETTINGS = {
    "loraflow worker": "lower worker.vllm.gpu_memory_utilization (vLLM: the share of the GPU its engine reserves; "
                       "lower it when another process uses that GPU), worker.vllm.max_num_seqs or model.max_seq_len; "
                       "hf backend: worker.capacity or worker.max_new_tokens",
    "loraflow learner": "lower learner.micro_batch_tokens (tokens per micro-batch), set "
                        "learner.activation_checkpointing = \"on\" and learner.mixed_precision = \"bf16\", or use "
                        "more launch.learner_ranks (each holds a smaller shard)",
    "loraflow run": "the held-out evaluation: set eval.device to \"cpu\" or a GPU no worker uses, or "
                    "eval.num_prompts = 0",
}

#: flag -> (config key, type, help)
COMMON_FLAGS: dict[str, tuple[str, type, str]] = {
    "--endpoint": ("broker.endpoint", str, "broker address clients connect to (tcp://host:port)"),
    "--run-dir": ("run.run_dir", str, "run directory (logs, metrics, checkpoints, adapters)"),
    "--seed": ("run.seed", int, "seed"),
    "--max-staleness": ("run.max_staleness", int, "versions a sample may lag the learner (0 = synchronous)"),
    "--num-steps": ("run.num_steps", int, "learner steps before stopping (0 = until stopped)"),
    "--log-format": ("run.log_format", str, "console or json"),
    "--log-level": ("run.log_level", str, "debug, info, warning, error"),
    "--model": ("model.path", str, "model directory or builtin:tiny"),
}


def one_host_torchrun(ranks: int) -> list[str]:
    """The arguments after ``python`` for a torchrun job of ``ranks`` ranks on this machine (then ``-m module``).
    Its ranks reach their agent's store at 127.0.0.1: torchrun would name it by this machine's hostname, and
    where that does not resolve (a fresh container's, a name only an unreachable DNS knows) every rank retries it
    without end."""
    return ["-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1", f"--nproc_per_node={ranks}"]


def config_parser(prog: str, description: str, extra_flags: dict[str, tuple[str, type, str]] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("config", nargs="?", help="TOML config file (defaults are used without one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (TOML syntax), repeatable")
    for flag, (key, kind, text) in {**COMMON_FLAGS, **(extra_flags or {})}.items():
        parser.add_argument(flag, dest=_dest(flag), type=kind, default=None, help=f"{text} [{key}]")
    parser.set_defaults(_flag_keys={_dest(f): key for f, (key, _, _) in {**COMMON_FLAGS, **(extra_flags or {})}.items()})
    return parser


def _dest(flag: str) -> str:
    return "flag_" + flag.lstrip("-").replace("-", "_")


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the config with ``--set`` overrides and flag values applied; raises ConfigError (see run_main)."""
    overrides = list(args.overrides)
    for dest, key in args._flag_keys.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    return load_config(args.config, overrides)


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (poll reports POLLERR on its writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout), or it is closed
        return False


def out_of_memory(exc: BaseException) -> BaseException | None:
    """``exc``, or the error it was raised from, that is torch's OutOfMemoryError; None when there is none (torch
    is not imported here: a process that never imported it cannot have raised it)."""
    error_class = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    seen: set[int] = set()
    current: BaseException | None = exc
    while error_class is not None and current is not None and id(current) not in seen:
        if isinstance(current, error_class):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def out_of_memory_line(prog: str, exc: BaseException) -> str:
    """One line: which command ran out of GPU memory, torch's account of the GPU, and the settings to change."""
    text = " ".join(str(out_of_memory(exc) or exc).split())
    account = text.split(" Of the allocated memory")[0].split(" If reserved but unallocated")[0]
    fix = OUT_OF_MEMORY_SETTINGS.get(prog, "lower the settings that size this process's memory")
    return f"{prog}: out of GPU memory ({account}); {fix}"


def run_main(prog: str, body: Callable[[], int | None]) -> int:
    """``body()``'s exit code; a config-class error becomes one line on stderr and EXIT_CONFIG_ERROR, running out
    of GPU memory one line and EXIT_OUT_OF_MEMORY."""
    try:
        code = int(body() or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's final flush
        return code
    except BrokenPipeError:
        if not stdout_reader_gone():  # a socket's, say: a real failure, not a reader that has read enough
            raise
        # the reader left (`| head`): nothing more to say; stdout goes to /dev/null so exit's flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ConfigError as exc:  # restarting cannot help
        text = " ".join(str(exc).split())  # one line, whatever the message's own line breaks
        print(f"{prog}: config error: {text}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        print(out_of_memory_line(prog, exc), file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
