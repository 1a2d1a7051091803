"""Where `loraflow run` puts its processes (deploy/devices.py): GPUs from fake device lists, metrics ports, and
what a process that runs out of GPU memory says (common/cli.py), through real processes and the real supervisor."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.join_time import adapter_message, lora_layout
from bench.join_time import worker_argv as join_time_worker_argv
from loraflow.common.cli import EXIT_OUT_OF_MEMORY, run_main
from loraflow.common.config import Config, ConfigError, load_config
from loraflow.deploy import devices
from loraflow.deploy.devices import Placement, plan, visible_devices
from loraflow.deploy.launcher import DEMO_CONFIG, Launch
from loraflow.deploy.processes import Managed, RestartPolicy, Supervisor, Unrecoverable
from loraflow.deploy.progress import Display
from tests.support import REPO, Processes, child_env, start_broker, wait_for
from tests.worker.test_adapter_refused import publish

GPU_EXAMPLE = REPO / "deploy/configs/gpu-example.toml"  # 2 vLLM workers, 2 learner ranks, all on cuda
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Of the allocated memory 75.1 GiB is allocated by PyTorch. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def config(*overrides: str, path: Path | None = None) -> Config:
    return load_config(path, list(overrides))


def envs(placement: Placement, num_workers: int) -> list[str | None]:
    names = ["broker", "learner", *(f"worker-{i}" for i in range(1, num_workers + 1))]
    return [placement.env(n).get("CUDA_VISIBLE_DEVICES") for n in names]


# -- which GPUs are there ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "count", "expected"), [
    (None, 4, ("0", "1", "2", "3")),  # nothing inherited: every GPU torch counts
    (None, 0, ()),
    ("4,5,6,7", 4, ("4", "5", "6", "7")),  # Slurm's or a container's list, in its order
    (" 2, 3 ", 2, ("2", "3")),
    ("GPU-8f2a,MIG-1c3d/1/0", 2, ("GPU-8f2a", "MIG-1c3d/1/0")),
    ("", 0, ()),  # hidden on purpose
    ("NoDevFiles", 0, ()),  # Slurm without a GPU allocation
    ("0,-1,1", 1, ("0",)),  # CUDA stops at the first invalid entry
    ("0,1,7", 2, ("0", "1")),  # an index past the machine's GPUs: torch counts 2
    ("0,1", 0, ()),  # a CPU-only torch sees none, whatever the variable says
])
def test_visible_devices_reads_cuda_visible_devices_as_cuda_does(value: str | None, count: int,
                                                                 expected: tuple[str, ...]) -> None:
    assert visible_devices(value, count) == expected


# -- the policy -------------------------------------------------------------------------------------------------

def test_learner_ranks_take_the_first_gpus_and_workers_one_each_of_the_rest() -> None:
    gpu = config(path=GPU_EXAMPLE)
    placement = plan(gpu, ["0", "1", "2", "3"])
    assert envs(placement, 2) == ["", "0,1", "2", "3"]  # broker, learner, worker-1, worker-2
    assert placement.eval_device == "cuda:0"  # no GPU left free: the learner's first, never a vLLM worker's
    inherited = plan(gpu, ["4", "5", "6", "7", "3"])  # CUDA_VISIBLE_DEVICES=4,5,6,7,3 (a Slurm allocation)
    assert envs(inherited, 2) == ["", "4,5", "6", "7"]  # split, not ignored; ids as the launcher got them
    assert inherited.eval_device == "cuda:4"  # the free one ("3"), in the launcher's numbering


def test_the_launcher_starts_each_child_with_its_placement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the Launch sees no GPU on any machine; its placement is set below
    launch = Launch(config(f'run.run_dir="{tmp_path / "run"}"', 'learner.device="auto"', 'worker.device="auto"',
                           path=GPU_EXAMPLE), Display(every_s=1e9, interactive=False), started_s=0.0)  # gpu-example
    launch.placement = plan(launch.config, ["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e"])  # as if 5 were visible
    children = {name: launch._child(name, ["true"]) for name in ("broker", "learner", "worker-1", "worker-2")}
    assert {name: child.env["CUDA_VISIBLE_DEVICES"] for name, child in children.items()} == {
        "broker": "", "learner": "GPU-a,GPU-b", "worker-1": "GPU-c", "worker-2": "GPU-d"}
    launch.endpoint = "tcp://127.0.0.1:5555"
    argv = launch.worker_argv("2")
    assert argv[argv.index("--set") + 1] == "worker.metrics_port=9103"  # worker.metrics_port 9102 + 1
    assert launch.placement.describe() == ("GPUs (GPU-a, GPU-b, GPU-c, GPU-d, GPU-e): learner GPU-a,GPU-b; "
                                           "worker-1 GPU-c; worker-2 GPU-d; evaluation GPU GPU-e")
    launch.evaluator.shutdown(wait=True)


def test_auto_means_cuda_when_there_are_gpus_and_cpu_roles_see_none() -> None:
    auto = config("launch.num_workers=2", "worker.backend=\"vllm\"")  # every device setting is auto
    assert envs(plan(auto, ["0", "1", "2"]), 2) == ["", "0", "1", "2"]
    assert envs(plan(auto, []), 2) == [None] * 4  # no GPUs: nothing set, as before
    assert plan(auto, []).eval_device == "cpu"
    sim = plan(config("launch.num_workers=2", "worker.backend=\"sim\""), ["0", "1"])
    assert envs(sim, 2) == ["", "0", "", ""]  # a sim worker never takes a GPU
    assert sim.eval_device == "cuda:1"
    cpu = plan(config("learner.device=\"cpu\"", "worker.device=\"cpu\"", "launch.num_workers=1"), ["0"])
    assert envs(cpu, 1) == ["", "", ""] and cpu.eval_device == "cuda:0"  # the GPU nobody holds


def test_too_few_gpus_are_shared_when_they_fit() -> None:
    gpu = config(path=GPU_EXAMPLE)
    with pytest.raises(ConfigError, match=r"launch.learner_ranks = 2 needs one GPU per rank, 1 GPU\(s\) visible"):
        plan(gpu, ["0"])
    with pytest.raises(ConfigError, match=r"need 4 GPUs, 3 GPU\(s\) visible .*launch.share_gpus = true"):
        plan(config("launch.share_gpus=false", path=GPU_EXAMPLE), ["0", "1", "2"])
    with pytest.raises(ConfigError, match=r"worker.vllm.gpu_memory_utilization = 0.85 with 2 vLLM workers on GPU 2 "
                                          r".*170% of it; set worker.vllm.gpu_memory_utilization <= 0.45"):
        plan(gpu, ["0", "1", "2"])  # launch.share_gpus is on by default: the engines must fit
    fits = plan(config("worker.vllm.gpu_memory_utilization=0.45", path=GPU_EXAMPLE), ["0", "1", "2"])
    assert envs(fits, 2) == ["", "0,1", "2", "2"]  # both workers on the GPU the learner leaves
    assert fits.eval_device == "cuda:0"


def test_one_gpu_for_everything_when_shared() -> None:
    demo = plan(config(path=DEMO_CONFIG), ["0"])  # the demo's auto devices on a one-GPU machine
    assert envs(demo, 2) == ["", "0", "0", "0"] and demo.eval_device == "cuda:0"
    one = ["launch.learner_ranks=1", "launch.num_workers=1", "worker.device=\"cuda\"",
           "learner.device=\"cuda\""]
    vllm = plan(config(*one, "worker.backend=\"vllm\"", "worker.vllm.gpu_memory_utilization=0.5"), ["0"])
    assert envs(vllm, 1) == ["", "0", "0"]
    assert vllm.eval_device == "cpu"  # the only GPU holds a vLLM engine: the evaluation stays off it
    hf = plan(config(*one, "worker.backend=\"hf\""), ["0"])
    assert hf.eval_device == "cuda:0"  # an hf worker allocates as it goes: the evaluation may share its GPU
    with pytest.raises(ConfigError, match="vLLM workers and the learner on GPU 0"):
        plan(config(*one, "launch.num_workers=2", "worker.backend=\"vllm\"",
                    "worker.vllm.gpu_memory_utilization=0.6"), ["0"])


def test_device_settings_the_launcher_cannot_honour_are_named() -> None:
    with pytest.raises(ConfigError, match="learner.device = 'cuda' but no GPU is visible here"):
        plan(config("learner.device=\"cuda\""), [])
    with pytest.raises(ConfigError, match="worker.device = 'cuda:1': under loraflow run each process sees only"):
        plan(config("worker.device=\"cuda:1\""), ["0", "1", "2"])
    assert envs(plan(config("worker.device=\"cuda:0\"", "launch.num_workers=1"), ["0", "1"]), 1) == ["", "0", "1"]
    with pytest.raises(ConfigError, match="eval.device = '9' is not one of the GPUs loraflow run sees"):
        plan(config("eval.device=\"9\""), ["0", "1"])
    assert plan(config("eval.device=\"cpu\""), ["0", "1", "2", "3"]).eval_device == "cpu"
    assert plan(config("eval.device=\"GPU-b\""), ["GPU-a", "GPU-b"]).eval_device == "cuda:1"


@settings(max_examples=300, deadline=None)
@given(num_visible=st.integers(0, 8), num_workers=st.integers(0, 6), ranks=st.integers(1, 4),
       backend=st.sampled_from(["hf", "vllm", "sim"]), worker_device=st.sampled_from(["auto", "cuda", "cpu"]),
       learner_device=st.sampled_from(["auto", "cuda", "cpu"]), share=st.booleans(),
       share_of_gpu=st.sampled_from([0.2, 0.45, 0.85]))
def test_every_placement_keeps_the_rules(num_visible: int, num_workers: int, ranks: int, backend: str,
                                         worker_device: str, learner_device: str, share: bool,
                                         share_of_gpu: float) -> None:
    cfg = config(f"launch.num_workers={num_workers}", f"launch.learner_ranks={ranks}", f"worker.backend=\"{backend}\"",
                 f"worker.device=\"{worker_device}\"", f"learner.device=\"{learner_device}\"",
                 f"launch.share_gpus={'true' if share else 'false'}",
                 f"worker.vllm.gpu_memory_utilization={share_of_gpu}")
    visible = [f"GPU-{i}" for i in range(num_visible)]
    try:
        placement = plan(cfg, visible)
    except ConfigError:
        return
    assert len(placement.workers) == num_workers
    given_ids = [d for ids in (placement.learner, *placement.workers) for d in ids]
    assert set(given_ids) <= set(visible)
    assert len(set(placement.learner)) == len(placement.learner)  # one GPU per rank
    assert len(placement.learner) in (0, ranks)
    worker_ids = [d for ids in placement.workers for d in ids]
    if not share:
        assert len(set(given_ids)) == len(given_ids)  # nobody shares a GPU unless allowed
    if worker_ids and len(visible) > len(placement.learner):
        assert not set(worker_ids) & set(placement.learner)  # workers join the learner's GPUs only when none is left
    if backend == "vllm":
        assert all(worker_ids.count(d) * share_of_gpu <= 1.0 for d in worker_ids)
        if placement.eval_device != "cpu":
            assert visible[int(placement.eval_device.split(":")[1])] not in worker_ids  # never a vLLM worker's GPU
    if not visible:
        assert all(placement.env(n) == {} for n in ("broker", "learner", "worker-1"))


def test_loraflow_run_refuses_a_gpu_it_cannot_give_before_starting_anything(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: worker.device = cuda can be given")
    result = subprocess.run([str(Path(sys.executable).with_name("loraflow")), "run", "--run-dir",
                             str(tmp_path / "run"), "--model", str(tiny_model_dir), "--set", "worker.device=\"cuda\""],
                            env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("loraflow run: config error: worker.device = 'cuda' but no GPU "
                                                      "is visible here; use auto or cpu")
    assert not (tmp_path / "run").exists()


# -- metrics ports ----------------------------------------------------------------------------------------------

def test_each_worker_gets_its_own_metrics_port() -> None:
    gpu = config(path=GPU_EXAMPLE)  # broker 9100, learner 9101, workers from 9102
    assert devices.check_ports(gpu) == [("broker.metrics_port", 9100), ("learner.metrics_port", 9101),
                                        ("worker.metrics_port", 9102), ("worker.metrics_port + 1 (worker-2)", 9103)]
    assert [devices.worker_metrics_port(gpu, i) for i in (1, 2, 3)] == [9102, 9103, 9104]
    overlap = config("learner.metrics_port=9103", path=GPU_EXAMPLE)  # inside the workers' range
    with pytest.raises(ConfigError, match=r"worker.metrics_port \+ 1 \(worker-2\) = 9103 is learner.metrics_port too "
                                          r"\(loraflow run gives worker i worker.metrics_port \+ i - 1: 9102..9103\)"):
        devices.check_ports(overlap)
    assert devices.check_ports(config("launch.num_workers=3")) == []  # 0: no metrics servers
    with pytest.raises(ConfigError, match="runs past port 65535"):
        devices.check_ports(config("worker.metrics_port=65535", "launch.num_workers=2"))


def free_base_port(count: int) -> int:
    """A port p such that p .. p+count-1 are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


def scrape(port: int) -> str | None:
    """The /metrics page served on ``port`` (empty before the process counted anything), None when none is."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def test_loraflow_run_serves_every_workers_metrics_on_its_own_port(tmp_path: Path, tiny_model_dir: Path) -> None:
    # two real workers under the real launcher, one worker.metrics_port: each answers on its own port
    base = free_base_port(2)
    argv = [str(Path(sys.executable).with_name("loraflow")), "run", "--run-dir", str(tmp_path / "run"),
            "--model", str(tiny_model_dir), "--workers", "2", "--set", "worker.backend=\"sim\"",
            "--set", "integrity.check=false",
            "--set", f"worker.metrics_port={base}", "--set", "eval.num_prompts=0", "--set", "run.num_steps=0"]
    launcher = subprocess.Popen(argv, env=child_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while any(scrape(p) is None for p in (base, base + 1)):
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < deadline, "the workers' metrics servers did not answer within 120 s"
            time.sleep(0.5)
        pages = {port: scrape(port) for port in (base, base + 1)}
    finally:
        launcher.send_signal(signal.SIGINT)
        output = launcher.communicate(timeout=120)[0]
    assert all(page is not None for page in pages.values()), pages  # both ports answer (they were free before)
    logs = tmp_path / "run" / "logs"
    assert "Address already in use" not in (logs / "worker-2.log").read_text(), output
    assert f"worker.metrics_port={base + 1}" in (logs / "worker-2.log").read_text()  # its command line


# -- out of GPU memory -----------------------------------------------------------------------------------------

def test_run_main_names_the_settings_when_the_gpu_runs_out(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    def body() -> int:
        try:
            raise torch.OutOfMemoryError(CUDA_OOM)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("a step failed") from exc  # found as the cause, too

    assert run_main("loraflow learner", body) == EXIT_OUT_OF_MEMORY
    line = capsys.readouterr().err
    assert line == ("loraflow learner: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                    "total capacity of 79.19 GiB of which 1.06 GiB is free.); lower learner.micro_batch_tokens "
                    "(tokens per micro-batch), set learner.activation_checkpointing = \"on\" and "
                    "learner.mixed_precision = \"bf16\", or use more launch.learner_ranks (each holds a smaller "
                    "shard)\n")
    with pytest.raises(RuntimeError, match="not memory"):  # any other error is not turned into a line
        run_main("loraflow learner", lambda: (_ for _ in ()).throw(RuntimeError("not memory")))


#: a role's real entry point in a child, whose run() meets a CUDA out-of-memory error
OOM_CHILD = textwrap.dedent("""
    import sys, torch
    import {module} as role_main, {run_module} as role_run
    def run(config):
        raise torch.OutOfMemoryError({message!r})
    role_run.run = run
    sys.exit(role_main.main(sys.argv[1:]))
""")


def oom_child_argv(role: str, tmp_path: Path, model_dir: Path) -> list[str]:
    module, run_module = {"learner": ("loraflow.learner.main", "loraflow.learner.start"),
                          "worker": ("loraflow.rollout_worker.main", "loraflow.rollout_worker.worker")}[role]
    code = OOM_CHILD.format(module=module, run_module=run_module, message=CUDA_OOM)
    return [sys.executable, "-c", code, "--run-dir", str(tmp_path / "run"), "--model", str(model_dir),
            "--endpoint", "tcp://127.0.0.1:1", "--set", "learner.device=\"cpu\""]


@pytest.mark.parametrize(("role", "setting"), [("learner", "learner.micro_batch_tokens"),
                                               ("worker", "worker.vllm.gpu_memory_utilization")])
def test_a_role_out_of_gpu_memory_exits_3_with_one_line(tmp_path: Path, tiny_model_dir: Path, role: str,
                                                        setting: str) -> None:
    result = subprocess.run(oom_child_argv(role, tmp_path, tiny_model_dir), env=child_env(), capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == EXIT_OUT_OF_MEMORY, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"loraflow {role}: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert setting in last


def test_a_worker_out_of_memory_loading_an_adapter_is_not_a_refused_adapter(procs: Processes,
                                                                            tiny_model_dir: Path) -> None:
    # a real broker holds a good adapter; a real hf worker's GPU is full when it loads it: not "adapter_refused"
    # (exit 2, never restarted, "use the same model.path"), but the out-of-memory line and exit 3
    broker = start_broker(procs, f'model.path="{tiny_model_dir}"', "run.group_size=2", "run.groups_per_step=2")
    layout, adapter_config = lora_layout(tiny_model_dir)
    publish(broker.endpoint, *adapter_message(1, layout, adapter_config), broker.run_token)
    wait_for(lambda: broker.stats()["latest_version"] == 1, 30, "the broker to hold v1", procs)
    code = textwrap.dedent(f"""
        import sys, torch
        from loraflow.rollout_worker.backends.hf import HfBackend
        def add_adapter(self, adapter):
            raise torch.OutOfMemoryError({CUDA_OOM!r})
        HfBackend.add_adapter = add_adapter
        from loraflow.rollout_worker.main import main
        sys.exit(main(sys.argv[1:]))
    """)
    argv = join_time_worker_argv(broker.endpoint, broker.run_dir, "w1", tiny_model_dir)
    assert argv[1:3] == ["-m", "loraflow.rollout_worker"]
    worker = procs.spawn("worker", [argv[0], "-c", code, *argv[3:]], env=child_env())
    assert worker.wait(120) == EXIT_OUT_OF_MEMORY, worker.log()[-3000:]
    log_text = worker.log()
    assert "adapter_refused" not in log_text and "Traceback" not in log_text, log_text[-3000:]
    last = log_text.strip().splitlines()[-1]
    assert last.startswith("loraflow worker: out of GPU memory (CUDA out of memory.") and \
        "worker.vllm.gpu_memory_utilization" in last


def test_the_supervisor_gives_up_on_a_worker_out_of_memory_with_its_line(tmp_path: Path,
                                                                         tiny_model_dir: Path) -> None:
    # restarted like a crash (the memory may have been a dying process's), then the run's error ends with the line
    supervisor = Supervisor(RestartPolicy(backoff_s=0.1, max_backoff_s=0.1, max_restarts=1))
    child = supervisor.add(Managed(name="worker-1", argv=oom_child_argv("worker", tmp_path, tiny_model_dir),
                                   log_path=tmp_path / "worker-1.log", env=child_env(), cwd=tmp_path))
    deadline = time.monotonic() + 180
    with pytest.raises(Unrecoverable) as failure:
        while time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.1)
    assert child.exit_codes == [EXIT_OUT_OF_MEMORY, EXIT_OUT_OF_MEMORY]
    assert "worker-1 failed 2 times in a row (last: exit code 3)" in str(failure.value)
    last = str(failure.value).strip().splitlines()[-1]
    assert last.startswith("loraflow worker: out of GPU memory") and "worker.vllm.gpu_memory_utilization" in last


def test_an_evaluation_out_of_memory_stops_evaluating_not_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import loraflow.deploy.evaluate

    def evaluate_dir(*args: object, **kwargs: object) -> object:
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(loraflow.deploy.evaluate, "evaluate_dir", evaluate_dir)  # the evaluator's GPU is full
    launch = Launch(config(f'run.run_dir="{tmp_path / "run"}"', path=DEMO_CONFIG),
                    Display(every_s=1e9, interactive=False), started_s=0.0)
    launch.pending_eval = launch.evaluator.submit(launch.measure, 0, None, "base")
    assert launch.collect_eval(wait=True) == ""  # no stop reason: the run goes on
    assert launch.summary.base_accuracy is None
    assert launch.measure(3, None, "final") is None  # and no later measurement is tried
    launch.maybe_start_eval(now_s=1e9)
    assert launch.pending_eval is None
    launch.evaluator.shutdown(wait=True)
    events = capsys.readouterr().out
    assert "loraflow run: out of GPU memory (CUDA out of memory." in events
    assert 'set eval.device to "cpu" or a GPU no worker uses, or eval.num_prompts = 0' in events
    assert events.count("out of GPU memory") == 1
