"""The multi-host test bed measured: recovery from link faults and restarts, and the network's cost in throughput.

    sudo .venv/bin/python -m bench.net_faults [--prompts 300] [--repeats 2] [--fault-prompts 520]
                                              [--fault-tokens-per-s 10]

On the bed of bench/netbed.py (tiny model, sim generation): ``loopback`` (every role on one host) and
``multi_host`` runs of ``--prompts``, interleaved ``--repeats`` times, then one multi-host run of ``--fault-prompts``
at ``--fault-tokens-per-s`` through netbed.FAULTS in turn; each run ends with tests/fault's audit. The figure: the
multi-host runs' median groups trained per second (first to last step); the reference: the loopback runs'.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness, netbed, netns
from tests.support import Processes

FAULTS = [("bandwidth_limited", {"w": "w3", "rate": "1mbit", "hold_s": 6}),
          ("latency_and_resets", {"w": "w2", "delay_ms": 100, "hold_s": 6, "resets": 2}),
          ("worker_link_down", {"w": "w1", "down_s": 10}),
          ("broker_link_down", {"down_s": 10}),
          ("broker_reboot", {}),
          ("learner_node_killed", {"node": "learner-1"})]


def one_run(root: Path, model_dir: Path, *, loopback: bool, prompts: int, tokens_per_s: float,
            faults: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    root.mkdir(parents=True)
    c = netbed.Cluster(Processes(root), root, model_dir, num_prompts=prompts, tokens_per_s=tokens_per_s,
                       loopback=loopback, proxied=("w2",) if faults else ())
    try:
        c.setup()
        t0 = time.time()
        c.start()
        c.wait_steps(1, t0, 180, "the start")
        first_step_s = time.time() - t0
        results = []
        for name, kwargs in faults:
            results.append(netbed.FAULTS[name](c, **kwargs))
            print(f"  {json.dumps(results[-1])}", flush=True)
        c.wait_all_trained(600)
        c.stop()
        return {"start_to_first_step_s": round(first_step_s, 1), "groups_per_s": round(c.rate(), 2),
                "faults": results, "audit": c.audit().summary()}
    except BaseException:
        print(c.procs.logs()[-6000:], file=sys.stderr)
        raise
    finally:
        c.teardown()


def main() -> None:
    parser = harness.flags(harness.parser(__doc__, repeats=2), {
        "prompts": (300, "prompts of the two throughput runs"), "fault_tokens_per_s": 10.0,
        "tokens_per_s": (200.0, "simulated generation of the throughput runs"),
        "fault_prompts": (520, "prompts of the fault run (0: no fault run)")})
    args = harness.parse(parser, None, prompts=40, repeats=1, fault_prompts=0)
    try:
        netns.require_root()
    except netns.BedUnavailable as exc:
        sys.exit(f"net_faults: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the bed's teardown runs on a SIGTERM too

    from loraflow.common.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="net-faults-") as tmp:
        tmp_path = Path(tmp)
        model_dir = build_tiny_model(tmp_path / "model", seed=0)
        numbers = itertools.count()

        def throughput(name: str) -> float:
            print(f"{name} run: {args.prompts} prompts", flush=True)
            run = one_run(tmp_path / f"{name}-{next(numbers)}", model_dir, loopback=name == "loopback",
                          prompts=args.prompts, tokens_per_s=args.tokens_per_s, faults=[])
            print(f"  {run}", flush=True)
            return run["groups_per_s"]

        rates = harness.interleave({name: lambda name=name: throughput(name) for name in ("loopback", "multi_host")},
                                   args.repeats)
        print(f"fault run: {args.fault_prompts} prompts, generation at {args.fault_tokens_per_s} tokens/s", flush=True)
        fault_run = one_run(tmp_path / "faults", model_dir, loopback=False, prompts=args.fault_prompts,
                            tokens_per_s=args.fault_tokens_per_s, faults=FAULTS) if args.fault_prompts else \
            {"faults": [], "audit": None}
        print(f"  audit: {fault_run['audit']}", flush=True)

    value, reference = harness.median(rates["multi_host"]), harness.median(rates["loopback"])
    print(f"throughput (median of {args.repeats}): multi-host {value} groups/s {rates['multi_host']}, "
          f"loopback {reference} groups/s {rates['loopback']}")
    by_fault = {r["fault"]: {k: v for k, v in r.items() if k != "fault"} for r in fault_run["faults"]}
    harness.report("net_faults", "multi_host_throughput", value, "groups/s", reference, runs=rates,
                   faults=by_fault, fault_audit=fault_run["audit"])


if __name__ == "__main__":
    main()
