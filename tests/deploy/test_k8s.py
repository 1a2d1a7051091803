"""The Kubernetes manifests of deploy/k8s, checked without a cluster: every document against the API schemas of
Kubernetes 1.32 (kubernetes-validate, strict: unknown fields fail; offline, schemas ship in the package), every
name a pod refers to defined, the run config loading, the containers calling the role scripts with variables
those read, and the key Secret mapped into directories the broker and clients accept (keys from `loraflow
keys`). `kubectl apply --dry-run=client` needs an API server even in client mode, so it is not used."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraflow.common.config import load_config
from loraflow.common.security import ClientSecurity, ServerSecurity, authorized_keys, generate_keys
from tests.support import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra)")

K8S = REPO / "deploy" / "k8s"
SCRIPTS = REPO / "deploy" / "scripts"
KUBERNETES_VERSION = "1.32.0"  # the kubectl client of the machines this was written on


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == kind}


def pod_specs() -> dict[str, dict[str, Any]]:
    """The pod template of each workload, by workload kind."""
    specs = {}
    for kind in ("StatefulSet", "Deployment", "Job"):
        (workload,) = by_kind(kind).values()
        specs[kind] = workload["spec"]["template"]["spec"]
    return specs


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else v["metadata"]["name"])
def test_manifest_matches_the_api_schema(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_wrong_field() -> None:
    (job,) = by_kind("Job").values()
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_roles_and_what_they_refer_to() -> None:
    (broker,) = by_kind("StatefulSet").values()
    assert broker["spec"]["replicas"] == 1 and broker["spec"]["volumeClaimTemplates"]  # its state outlives the pod
    (service,) = by_kind("Service").values()
    assert service["spec"]["selector"] == broker["spec"]["template"]["metadata"]["labels"]
    assert broker["spec"]["serviceName"] == service["metadata"]["name"]
    env = by_kind("ConfigMap")["loraflow-env"]["data"]
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "zmq")
    assert env["LORAFLOW_ENDPOINT"] == f"tcp://{service['metadata']['name']}:{port}"

    claims = set(by_kind("PersistentVolumeClaim")) | {t["metadata"]["name"]
                                                       for t in broker["spec"]["volumeClaimTemplates"]}
    config_maps, secrets = set(by_kind("ConfigMap")), set(by_kind("Secret"))
    for kind, spec in pod_specs().items():
        volumes = {v["name"]: v for v in spec["volumes"]}
        (container,) = spec["containers"]
        for mount in container["volumeMounts"]:
            volume = volumes.get(mount["name"]) or {}
            assert volume or mount["name"] in claims, f"{kind}: mount {mount['name']} has no volume"
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] in config_maps
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {env["LORAFLOW_CONFIG"], env["LORAFLOW_KEYS_DIR"], "/models"} <= mounts, kind
        run_dir = {e["name"]: e["value"] for e in container.get("env", [])}.get("LORAFLOW_RUN_DIR",
                                                                                 env["LORAFLOW_RUN_DIR"])
        assert any(run_dir.startswith(m) for m in mounts), f"{kind}: run dir {run_dir} is on no volume"
    (job,) = by_kind("Job").values()
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2, 4]  # as the unit's 2 4


def test_containers_run_the_role_scripts_with_variables_they_read() -> None:
    read = set()
    for script in SCRIPTS.glob("*.sh"):
        read |= set(re.findall(r"\$\{?(LORAFLOW_[A-Z_]+)", script.read_text()))
    env = by_kind("ConfigMap")["loraflow-env"]["data"]
    expected = {"StatefulSet": "broker.sh", "Deployment": "worker.sh", "Job": "learner.sh"}
    for kind, spec in pod_specs().items():
        (container,) = spec["containers"]
        command = container["command"]
        assert command[0] == f"{env['LORAFLOW_HOME']}/deploy/scripts/{expected[kind]}"
        assert (SCRIPTS / expected[kind]).is_file()
        names = {e["name"] for e in container.get("env", [])} | set(env)
        assert {n for n in names if n.startswith("LORAFLOW_")} <= read, kind
    (worker,) = pod_specs()["Deployment"]["containers"]
    assert worker["command"][1].isdigit()  # worker.sh INSTANCE: the id is <pod name>-<instance>


def test_run_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(by_kind("ConfigMap")["loraflow-config"]["data"]["run.toml"])
    config = load_config(path)
    assert str(config.model.path) == "/models/base" and config.run.log_format == "json"


def test_key_secret_mounts_give_each_role_the_keys_it_loads(tmp_path: Path) -> None:
    made = tmp_path / "made"
    generate_keys(made, {"worker": "worker", "learner": "learner"}, observer=True)
    flat = {p.name for p in made.iterdir() if p.is_file()}  # what `kubectl create secret --from-file=made/` takes
    (secret,) = by_kind("Secret").values()
    assert set(secret["stringData"]) == flat
    mounted = {}
    for kind, spec in pod_specs().items():
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        target = tmp_path / kind
        for item in volume["secret"]["items"]:
            (target / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(made / item["key"], target / item["path"])
        mounted[kind] = target
    ServerSecurity.load(mounted["StatefulSet"])
    assert authorized_keys(mounted["StatefulSet"]) == {"worker": ["worker"], "learner": ["learner"],
                                                       "observer": ["observer"]}
    ClientSecurity.load(mounted["Deployment"], "worker", role="worker")
    ClientSecurity.load(mounted["Job"], "learner", role="learner")
    assert not (mounted["Deployment"] / "broker.key_secret").exists()  # no client holds the broker's secret
