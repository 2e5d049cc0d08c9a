"""deploy/k8s/ validated offline, and CURVE by default across hosts (compose too).

* `kubectl kustomize` renders every overlay (cpu, gpu);
* `kubernetes-validate` (PyPI) validates every object strictly against the pinned Kubernetes
  version's schemas; the Prometheus Operator objects (no schema there) are checked for the
  fields the operator requires, and that the ports they name exist;
* probes and preStop hooks name real ports and real paths (/readyz, /healthz, /drain) on the
  service's own HTTP port;
* every TANDEM_* variable a manifest sets is a real configuration field of the service that
  reads it, and each container's configuration loads (common/config.load) from it;
* the cloud half is StatefulSets behind headless Services, ≥ 2 replicas, a PDB, a grace period
  that covers the drain; only the edge half reaches the cloud ports; CURVE on the edge-cloud
  links; the dashboards ConfigMap equals deploy/grafana/dashboards.

Under CI (CI=true) a missing kubectl or kubernetes-validate fails; elsewhere it skips.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from common import config, security

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.30.0"   # the oldest release the manifests must be valid for
NOT_FIELDS = {"TANDEM_MODELS_DIR"}   # read by common/models.py, not a config field
PROBE_PATHS = {"/readyz", "/healthz"}
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(tool_found: bool, what: str) -> None:
    if not tool_found:
        if CI:
            pytest.fail(f"{what} is missing (CI must run this check)")
        pytest.skip(f"{what} is missing")


@cache
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    need(kubectl is not None, "kubectl (kustomize renderer)")
    r = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {overlay} failed:\n{r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def objects(overlay: str, kind: str) -> list[dict]:
    return [o for o in render(overlay) if o["kind"] == kind]


def one(overlay: str, kind: str, name: str) -> dict:
    found = [o for o in objects(overlay, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(overlay: str) -> list[dict]:
    return [o for o in render(overlay) if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def pod_containers(overlay: str):
    """(workload, pod spec, container) for every container, init containers included."""
    for w in workloads(overlay):
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield w, spec, c


def service_of(c: dict) -> str | None:
    """The Tandem service a container runs (`tandem serve NAME`), if any."""
    args = c.get("args") or []
    return args[1] if len(args) >= 2 and args[0] == "serve" else None


def config_class(service: str):
    if service == "api":
        return importlib.import_module("api.config").ApiConfig
    mod = importlib.import_module(f"services.{service}.config")
    return next(v for k, v in vars(mod).items() if k.lower() == f"{service}config")


def fields_of(service: str) -> set[str]:
    """Its settings' flat names (a dispatcher section's fields as spec_r1, split_cut, ...)."""
    from common.config import settings
    return set(settings(config_class(service)))


def is_field(var: str, service: str) -> bool:
    """A setting of `service` (TANDEM_<FIELD>), or one scoped to a service that has it
    (TANDEM_<SERVICE>_<FIELD>: a shared env block sets the drafter's model for every service, and
    only the drafter reads it)."""
    bare = var.removeprefix("TANDEM_").lower()
    if bare in fields_of(service):
        return True
    return any(var.startswith(f"TANDEM_{s.upper()}_")
               and var.removeprefix(f"TANDEM_{s.upper()}_").lower() in fields_of(s)
               for s in {service, "dispatcher", "verifier", "drafter", "prefix", "suffix"})


def container_env(overlay: str, c: dict) -> dict[str, str]:
    """What the container's process sees: its envFrom ConfigMaps, then its env."""
    env: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        env.update(one(overlay, "ConfigMap", ref["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        env[e["name"]] = str(e["value"])
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay):
    kinds = sorted({o["kind"] for o in render(overlay)})
    for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap", "PersistentVolumeClaim",
                 "Job", "NetworkPolicy", "PodDisruptionBudget", "ServiceMonitor", "PodMonitor"):
        assert kind in kinds, f"{overlay}: no {kind}"
    assert all(o["metadata"].get("namespace") == "tandem" for o in render(overlay)
               if o["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_valid_against_kubernetes_schemas(overlay):
    try:
        import kubernetes_validate
    except ImportError:
        need(False, "kubernetes-validate (pip install kubernetes-validate)")
    logging.getLogger("kubernetes_validate").setLevel(logging.ERROR)
    checked = 0
    for o in render(overlay):
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            continue   # CRDs: no schema in Kubernetes' own; test_monitoring_objects checks them
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 13


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitoring_objects(overlay):
    """The Prometheus Operator's required fields, and ports that exist."""
    for sm in objects(overlay, "ServiceMonitor"):
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        spec = sm["spec"]
        assert spec["selector"]["matchLabels"] and spec["endpoints"]
        selected = [s for s in objects(overlay, "Service")
                    if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert {s["metadata"]["name"] for s in selected} == {"verifier", "suffix"}
        for ep in spec["endpoints"]:
            assert ep["path"] == "/metrics"
            for s in selected:
                assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}
    for pm in objects(overlay, "PodMonitor"):
        spec = pm["spec"]
        assert spec["selector"]["matchLabels"] and spec["podMetricsEndpoints"]
        pods = [w for w in workloads(overlay) if spec["selector"]["matchLabels"].items()
                <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, "the PodMonitor selects no pod"
        ports = {p["name"] for w in pods for c in w["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for ep in spec["podMetricsEndpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics"
    cm = one(overlay, "ConfigMap", "tandem-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    src = ROOT / "deploy" / "grafana" / "dashboards"
    assert set(cm["data"]) == {p.name for p in src.glob("*.json")}
    for name, text in cm["data"].items():
        assert json.loads(text) == json.loads((src / name).read_text()), \
            f"deploy/k8s/base/monitoring/dashboards/{name} differs from deploy/grafana/dashboards"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_hooks_name_real_ports_and_paths(overlay):
    served = 0
    for _, _, c in pod_containers(overlay):
        svc = service_of(c)
        if svc is None:
            continue
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        env = container_env(overlay, c)
        http = int(env.get("TANDEM_API_PORT" if svc == "api" else "TANDEM_HTTP_PORT", 0))
        assert http, f"{svc}: no HTTP port configured"
        assert "readinessProbe" in c and "livenessProbe" in c, f"{svc}: probes"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            get = probe["httpGet"]
            assert get["path"] in PROBE_PATHS, f"{svc} {kind}: {get['path']}"
            port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
            assert port == http, f"{svc} {kind} probes port {port}, the service serves {http}"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        pre = c.get("lifecycle", {}).get("preStop")
        if pre is not None:
            cmd = " ".join(pre["exec"]["command"])
            assert f"http://127.0.0.1:{http}/drain" in cmd, f"{svc}: preStop {cmd}"
        served += 1
    assert served == 6   # verifier, suffix, dispatcher, drafter, prefix, api


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_tandem_variable_is_a_config_field(overlay):
    consumers: dict[str, set[str]] = {}
    for _, _, c in pod_containers(overlay):
        svc = service_of(c)
        for ref in c.get("envFrom", []):
            consumers.setdefault(ref["configMapRef"]["name"], set()).add(svc or "")
        if svc is None:
            continue
        for e in c.get("env", []):
            var = e["name"]
            if var.startswith("TANDEM_") and var not in NOT_FIELDS:
                assert is_field(var, svc), f"{overlay}: {svc} sets {var}, not a {svc} setting"
        # the container's whole environment loads as its configuration
        env = container_env(overlay, c)
        try:
            config.load(config_class(svc), svc, [], env)
        except SystemExit as e:
            pytest.fail(f"{overlay}: {svc} would not start: {e}")
    for name, svcs in consumers.items():
        for var in one(overlay, "ConfigMap", name)["data"]:
            if var.startswith("TANDEM_") and var not in NOT_FIELDS:
                assert any(s and is_field(var, s) for s in svcs), \
                    f"ConfigMap {name}: {var} is a setting of none of {sorted(filter(None, svcs))}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cloud_half_replicated_drained_and_guarded(overlay):
    cfg = one(overlay, "ConfigMap", "tandem-config")["data"]
    drain_s = float(cfg["TANDEM_DRAIN_S"])
    for role, port in (("verifier", 5551), ("suffix", 5554)):
        sts = one(overlay, "StatefulSet", role)
        svc = one(overlay, "Service", role)
        assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == role
        assert sts["spec"]["replicas"] >= 2
        pod = sts["spec"]["template"]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        spec = pod["spec"]
        assert spec["terminationGracePeriodSeconds"] >= drain_s + 10
        c = spec["containers"][0]
        env = container_env(overlay, c)
        # CURVE server with the dispatcher's key allowed, both from the Secret
        assert env["TANDEM_CURVE_SECRET_KEY"] == f"/keys/{role}.key_secret"
        assert env["TANDEM_CURVE_ALLOW_DIR"] == "/keys/allowed"
        assert "TANDEM_ALLOW_PLAINTEXT" not in env
        keys = next(v for v in spec["volumes"] if v["name"] == "keys")["secret"]
        assert keys["secretName"] == "tandem-curve-cloud"
        assert {i["path"] for i in keys["items"]} == {f"{role}.key_secret",
                                                     "allowed/dispatcher.key"}
        pdb = one(overlay, "PodDisruptionBudget", role)
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        resources = c["resources"]
        if overlay == "gpu":
            assert resources["limits"]["nvidia.com/gpu"] == 1
            assert env["TANDEM_DEVICE"] == "cuda"
        else:
            assert "nvidia.com/gpu" not in resources.get("limits", {})
        assert resources["requests"]["cpu"] and resources["limits"]["memory"]
        # only the edge half reaches the ZMQ port
        rules = [r for np in objects(overlay, "NetworkPolicy")
                 if np["spec"]["podSelector"]["matchLabels"].items()
                 <= pod["metadata"]["labels"].items()
                 for r in np["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]
        assert rules and all(f["podSelector"]["matchLabels"] == {"tandem.io/half": "edge"}
                             for r in rules for f in r["from"])
    # the dispatcher discovers every replica from the headless Services, dials them with CURVE
    edge = one(overlay, "Deployment", "edge")
    spec = edge["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "tandem.io/edge"
    d = next(c for c in spec["containers"] if service_of(c) == "dispatcher")
    env = container_env(overlay, d)
    assert env["TANDEM_DISPATCHER_VERIFIER"] == "dns+tcp://verifier:5551"
    assert env["TANDEM_DISPATCHER_SUFFIX"] == "dns+tcp://suffix:5554"
    assert env["TANDEM_CURVE_SERVER_KEYS"] == "verifier=/keys/verifier.key,suffix=/keys/suffix.key"
    assert env["TANDEM_CURVE_CLIENT_KEY"] == "/keys/dispatcher.key_secret"
    # the models PVC is filled by the Job and mounted read-only by the model pods
    job = one(overlay, "Job", "tandem-models")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["models", "prepare"]
    assert one(overlay, "PersistentVolumeClaim", "tandem-models")


# ------------------------------------------------------------------- CURVE by default, compose

def test_plaintext_beyond_loopback_is_refused_unless_allowed(caplog):
    cfg = config.ServiceConfig(bind="tcp://0.0.0.0:5551")
    with pytest.raises(security.KeyFileError, match="allow_plaintext"):
        security.check_plaintext(cfg, "verifier")
    cfg.allow_plaintext = True
    with caplog.at_level(logging.WARNING, "tandem.security"):
        security.check_plaintext(cfg, "verifier")
    assert "PLAINTEXT" in caplog.text
    for local in ("tcp://127.0.0.1:5551", "tcp://[::1]:5551", "ipc:///tmp/x", "inproc://x"):
        security.check_plaintext(config.ServiceConfig(bind=local), "verifier")
    security.check_plaintext(config.ServiceConfig(bind="tcp://0.0.0.0:1",
                                                  curve_secret_key="k.key_secret"), "verifier")


def test_compose_runs_curve_by_default_and_plaintext_is_an_explicit_override():
    from tests.integration.test_deploy import ROOT as DEPLOY_ROOT, compose_config
    cfg = compose_config(("edge", "cloud"))
    s = cfg["services"]
    assert s["keys"]["command"][:2] == ["keys", "create"] and "--if-missing" in s["keys"]["command"]
    for role in ("verifier", "suffix"):
        env = s[role]["environment"]
        assert env["TANDEM_CURVE_SECRET_KEY"] == f"/keys/{role}.key_secret"
        assert env["TANDEM_CURVE_ALLOW_DIR"] == "/keys/allowed"
        assert "TANDEM_ALLOW_PLAINTEXT" not in env
        assert "keys" in s[role]["depends_on"]
        for var in env:
            if var.startswith("TANDEM_") and var not in NOT_FIELDS | {"TANDEM_DRAFTER_MODEL"}:
                assert is_field(var, role), var
    d = s["dispatcher"]["environment"]
    assert d["TANDEM_CURVE_CLIENT_KEY"] == "/keys/dispatcher.key_secret"
    assert d["TANDEM_CURVE_SERVER_KEYS"] == "verifier=/keys/verifier.key,suffix=/keys/suffix.key"
    plain = compose_config(("edge", "cloud"), files=(DEPLOY_ROOT / "compose.yaml",
                                                      DEPLOY_ROOT / "compose.plaintext.yaml"))
    for role in ("verifier", "suffix"):
        env = plain["services"][role]["environment"]
        assert env["TANDEM_ALLOW_PLAINTEXT"] == "true" and not env["TANDEM_CURVE_SECRET_KEY"]
    assert not plain["services"]["dispatcher"]["environment"]["TANDEM_CURVE_SERVER_KEYS"]
