"""loraflow installs under the one name ``loraflow``: the wheel holds nothing else, a user's own ``common`` and
``deploy`` packages first on PYTHONPATH shadow nothing of it (built wheel and editable install), and no source file
still names a bare top-level package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO, child_env

FOLDERS = ("common", "broker", "rollout_worker", "learner", "deploy")
#: a bare import or ``-m`` of one of the folders as if it were a top-level package
NAMES = "|".join(FOLDERS)
BARE = re.compile(rf"^\s*(from|import) ({NAMES})\b|-m\"?,? \"?({NAMES})\b", re.M)


def user_packages(root: Path) -> Path:
    """A user's code base with its own ``common`` and ``deploy`` packages (a marker each, to see which one ran)."""
    for name in ("common", "deploy"):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f'WHOSE = "user"\nprint("user {name} imported")\n')
        (root / name / "cli.py").write_text('raise SystemExit("the user\'s deploy.cli ran")\n')
    return root


def user_env(user: Path, **extra: str) -> dict[str, str]:
    """The suite's child environment without the checkout on PYTHONPATH, the user's code base first on it."""
    env = child_env(**extra)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join([str(user), *kept])
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the tracked sources (the checkout's own build/ stays untouched)."""
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", *FOLDERS], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("loraflow-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; its dependencies come from the suite's venv by a path entry (a path,
    not a site directory: the suite's editable loraflow is not loaded there)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "suite_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", str(python),
                    "install", "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    return python


def test_the_wheel_holds_only_loraflow_and_every_source_file(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"loraflow", f"{wheel.name.split('-')[0]}-0.1.0.dist-info"}
    sources = subprocess.run(["git", "ls-files", *(f"{f}/*.py" for f in FOLDERS)], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    missing = [s for s in sources if f"loraflow/{s}" not in names]
    assert not missing, f"packages missing from pyproject's [tool.setuptools] packages: {missing}"
    assert "loraflow/deploy/configs/demo.toml" in names and "loraflow/deploy/systemd/loraflow-broker.service" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "loraflow = loraflow.deploy.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_no_source_names_a_bare_top_level_package() -> None:
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.service", "*.sbatch", "*.yaml", "*.toml", "*.md",
                            "Makefile", "deploy/slurm/*"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    found = [f"{f}: {m.group(0).strip()}" for f in sorted(set(files)) if (REPO / f).is_file()
             for m in BARE.finditer((REPO / f).read_text(errors="replace"))]
    assert not found, found


@pytest.mark.parametrize("installed", ["wheel", "editable"])
def test_a_users_common_and_deploy_shadow_nothing(installed: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    python = request.getfixturevalue("wheel_python") if installed == "wheel" else Path(sys.executable)
    user = user_packages(tmp_path / "user")
    env = user_env(user)
    script = python.parent / "loraflow"
    helped = subprocess.run([str(script), "run", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "usage:" in helped.stdout and "user" not in helped.stdout, helped.stderr
    probe = ("import common, deploy, loraflow.common.config, loraflow.deploy.cli, json; "
             "print(json.dumps([common.WHOSE, deploy.__file__, loraflow.deploy.cli.__file__]))")
    done = subprocess.run([str(python), "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=True)
    whose, user_deploy, ours = json.loads(done.stdout.strip().splitlines()[-1])
    assert whose == "user" and Path(user_deploy).parent == user / "deploy"
    assert Path(ours).parent.name == "deploy" and Path(ours).parent.parent != user
    if installed == "wheel":
        assert "site-packages/loraflow/deploy" in ours
    else:
        assert Path(ours).parent == REPO / "deploy"


def test_a_short_run_trains_from_the_wheel_beside_a_users_common(wheel_python: Path, tmp_path: Path,
                                                                 tiny_model_dir: Path) -> None:
    """broker, worker and learner start as ``python -m loraflow...`` from the wheel while the user's ``common``
    and ``deploy`` come first on PYTHONPATH; the learner commits its steps."""
    user = user_packages(tmp_path / "user")
    run_dir = tmp_path / "run"
    done = subprocess.run([str(wheel_python.parent / "loraflow"), "run", "--model", str(tiny_model_dir),
                           "--run-dir", str(run_dir), "--workers", "1", "--set", 'worker.backend="sim"',
                           "--set", "run.num_steps=2", "--set", "run.groups_per_step=2", "--set", "run.group_size=4",
                           "--set", "eval.num_prompts=0", "--set", "integrity.check=false"],
                          env=user_env(user), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    assert "user common imported" not in logs and "user deploy imported" not in logs
