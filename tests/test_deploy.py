"""Deployment files, checked as far as this machine allows: the systemd units with `systemd-analyze verify` and
by running their command lines; the Kubernetes manifests parsed, checked for the fields they must have (and must
not have), validated against the Kubernetes schemas, and built with kustomize; the example configs loaded by the
agent's own config reader."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diagnoser import __version__
from diagnoser.agent.config import build_config, validate

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: pip install -e .[test]")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "kubernetes"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
IMAGE = f"diagnoser:{__version__}"


# --- systemd ------------------------------------------------------------------------------------------------------

def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(SYSTEMD / name)
    return parser


def _multi(name: str, key: str) -> list[str]:
    """All values of a key that may repeat (configparser keeps only the last)."""
    return [line.split("=", 1)[1].strip() for line in (SYSTEMD / name).read_text().splitlines()
            if line.startswith(f"{key}=")]


UNITS = ["diagnoser-agent.service", "diagnoser-agent-once.service", "diagnoser-agent.timer"]


def _diagnoser_exe() -> str:
    exe = shutil.which("diagnoser") or str(Path(sys.executable).parent / "diagnoser")
    if not Path(exe).is_file():
        pytest.skip("the diagnoser console script is not installed (pip install -e .)")
    return exe


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    exe = _diagnoser_exe()
    for name in UNITS:
        # verify checks that ExecStart's program exists: point it at this checkout's console script.
        text = (SYSTEMD / name).read_text().replace("/usr/local/bin/diagnoser", exe)
        (tmp_path / name).write_text(text)
    result = subprocess.run([analyze, "verify", *[str(tmp_path / n) for n in UNITS]], capture_output=True,
                            text=True, timeout=120)
    # verify exits 0 on unknown keys and only warns: any line about our units is a failure.
    ours = [l for l in (result.stdout + result.stderr).splitlines() if any(n in l for n in UNITS)]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_systemd_units_say_what_they_must() -> None:
    service, once, timer = (_unit(n) for n in UNITS)
    for unit in (service, once):
        s = unit["Service"]
        assert s["User"] == "diagnoser" and s["StateDirectory"] == "diagnoser"
        assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict" and s["KillMode"] == "mixed"
        assert s["DevicePolicy"] == "closed" and s["CapabilityBoundingSet"] == "CAP_SYS_PTRACE"
        assert int(s["TimeoutStopSec"]) <= 30 and s["MemoryMax"]
    assert set(_multi("diagnoser-agent.service", "DeviceAllow")) >= {"char-nvidiactl rw", "char-nvidia-frontend rw"}
    assert service["Service"]["Type"] == "simple" and service["Service"]["Restart"] == "on-failure"
    assert "--once" not in service["Service"]["ExecStart"]
    assert once["Service"]["Type"] == "oneshot" and "--once" in once["Service"]["ExecStart"]
    assert "Install" not in once  # started by the timer, not enabled on its own
    assert timer["Timer"]["Unit"] == "diagnoser-agent-once.service" and timer["Timer"]["RandomizedDelaySec"]
    assert timer["Install"]["WantedBy"] == "timers.target"
    # The user the units run as is created by the sysusers.d file that ships beside them.
    sysusers = (SYSTEMD / "diagnoser.sysusers.conf").read_text().split("\n")
    assert any(l.split()[:2] == ["u", "diagnoser"] for l in sysusers if l and not l.startswith("#"))


@pytest.mark.parametrize("name", ["diagnoser-agent.service", "diagnoser-agent-once.service"])
def test_systemd_command_lines_are_ones_the_agent_accepts(name: str, tmp_path: Path) -> None:
    """Run each unit's ExecStart (config pointed at the example file, one quick cycle on a PID that is gone)."""
    argv = shlex.split(_unit(name)["Service"]["ExecStart"])
    assert argv[0] == "/usr/local/bin/diagnoser"
    args = [a if a != "/etc/diagnoser/agent.toml" else str(DEPLOY / "agent.example.toml") for a in argv[1:]]
    if "--once" not in args:
        args.append("--once")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    result = subprocess.run([sys.executable, "-m", "diagnoser", *args, "--targets", f"gone=pid:{gone.pid}",
                             "--db", str(tmp_path / "h.db"), "--window", "1s"],
                            capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 3, result.stderr  # ran, and reported the missing target as unavailable
    assert f"no process with PID {gone.pid}" in result.stdout


def test_example_config_is_valid() -> None:
    cfg = build_config(DEPLOY / "agent.example.toml")
    validate(cfg)
    assert cfg.every_s == 900 and cfg.metrics_addr == "127.0.0.1" and cfg.discovering


# --- Kubernetes ---------------------------------------------------------------------------------------------------

def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs(name) if d["kind"] == kind]
    return doc


def _pod_specs() -> dict[str, dict[str, Any]]:
    ds = _one("daemonset.yaml", "DaemonSet")
    cj = _one("cronjob.yaml", "CronJob")
    return {"daemonset": ds["spec"]["template"]["spec"], "cronjob": cj["spec"]["jobTemplate"]["spec"]["template"]["spec"]}


def _agent(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["containers"] if c["name"] == "agent"]
    return container


@pytest.mark.parametrize("which", ["daemonset", "cronjob"])
def test_pod_has_the_access_it_needs_and_nothing_more(which: str) -> None:
    pod = _pod_specs()[which]
    # NVML reports host PIDs: the agent must see the host's processes.
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    # NVML through the NVIDIA runtime, without taking a GPU away from the workloads.
    assert pod["runtimeClassName"] == "nvidia"
    agent = _agent(pod)
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    for container in pod["containers"] + pod.get("initContainers", []):
        for section in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(section, {})
        assert container["image"] == IMAGE
        assert container["resources"]["limits"]["cpu"] and container["resources"]["limits"]["memory"]
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
    # The agent itself: non-root, no capabilities at all.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert agent["securityContext"]["runAsNonRoot"] is True and "add" not in agent["securityContext"]["capabilities"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    # The one root step hands the hostPath state folder over and can do nothing else.
    (init,) = pod["initContainers"]
    assert init["command"][0] == "chown" and init["securityContext"]["capabilities"]["add"] == ["CHOWN"]
    # No API access.
    assert pod["automountServiceAccountToken"] is False
    # Scheduled on GPU nodes, tolerating their taint.
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in pod["tolerations"])
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    # State on the node, config from the ConfigMap, a writable /tmp under the read-only root.
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/var/lib/diagnoser"]]["hostPath"]["path"] == "/var/lib/diagnoser"
    assert volumes[mounts["/etc/diagnoser"]]["configMap"]["name"] == "diagnoser-agent"
    assert "emptyDir" in volumes[mounts["/tmp"]]


def _config_from_map(key: str, tmp_path: Path) -> Any:
    data = _one("configmap.yaml", "ConfigMap")["data"]
    path = tmp_path / key
    path.write_text(data[key])
    cfg = build_config(path)
    validate(cfg)
    return cfg


def test_daemonset_serves_the_metrics_its_annotations_point_at(tmp_path: Path) -> None:
    ds = _one("daemonset.yaml", "DaemonSet")
    agent = _agent(ds["spec"]["template"]["spec"])
    assert agent["command"] == ["diagnoser"] and agent["args"][:3] == ["agent", "--config", "/etc/diagnoser/agent.toml"]
    assert "--once" not in agent["args"]
    cfg = _config_from_map("agent.toml", tmp_path)
    (port,) = agent["ports"]
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert cfg.metrics_port == port["containerPort"] == int(annotations["prometheus.io/port"])
    assert cfg.metrics_addr == "0.0.0.0"  # the pod's own network namespace: kubelet probes and Prometheus reach it
    assert agent["livenessProbe"]["httpGet"]["port"] == port["name"]
    assert cfg.discovering and str(cfg.db_path).startswith("/var/lib/diagnoser/")
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_cronjob_runs_once_and_writes_the_textfile(tmp_path: Path) -> None:
    cj = _one("cronjob.yaml", "CronJob")
    assert cj["spec"]["concurrencyPolicy"] == "Forbid"
    job = cj["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0 and job["activeDeadlineSeconds"] > 0
    agent = _agent(pod)
    assert "--once" in agent["args"]
    config = agent["args"][agent["args"].index("--config") + 1]
    cfg = _config_from_map(Path(config).name, tmp_path)
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert cfg.textfile is not None and str(cfg.textfile.parent) in mounts
    assert pod["nodeSelector"]["kubernetes.io/hostname"]  # one CronJob per named node


def test_service_account_and_namespace() -> None:
    sa = _one("serviceaccount.yaml", "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    ns = _one("namespace.yaml", "Namespace")
    names = {d["metadata"].get("namespace") for f in ("serviceaccount.yaml", "configmap.yaml", "daemonset.yaml",
                                                       "cronjob.yaml") for d in _docs(f)}
    assert names == {ns["metadata"]["name"]}
    # No RBAC objects: the agent never calls the API server.
    kinds = {d["kind"] for f in K8S.glob("*.yaml") for d in _docs(f.name)}
    assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def test_manifests_match_the_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
    checked = 0
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _docs(path.name):
            kv.validate(doc, "1.29", strict=True)  # strict: a misspelt field is an error, not ignored
            checked += 1
    assert checked >= 5


def test_kustomization_builds() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file()
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the resource list was checked")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(result.stdout) if d)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "ServiceAccount"]


def test_container_image_recipe() -> None:
    """The image the manifests run: built from this repository, non-root, nothing copied that is not there."""
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    lines = [l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#")]
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
    assert any(l.startswith("USER ") and not l.split()[1].startswith("0") for l in lines)
    assert f"-t {IMAGE}" in text


def test_docs_name_the_privileges_and_the_dcgm_counters() -> None:
    docs = (REPO / "docs" / "agent.md").read_text()
    for words in ("hostPID", "/dev/nvidia", "CAP_SYS_PTRACE", "runtimeClassName", "textfile",
                  "diagnoser/data/dcgm-counters.csv"):
        assert words in docs, words
    if not (REPO / "diagnoser" / "data" / "dcgm-counters.csv").is_file():
        pytest.skip("diagnoser/data/dcgm-counters.csv is not in this checkout yet")
