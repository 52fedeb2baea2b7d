"""deploy/kubernetes played with podman, where no Kubernetes runs (tests/e2e/
test_kubernetes.py). The manifests are the ones users apply; this is the transform for
podman only, each change for one of podman's gaps (podman 4.3, Debian 12):

- Services are ignored: each tier's pods join the podman network with the Service's name as
  a DNS alias (`--network NET:alias=NAME`), so a headless Service's name resolves, through
  podman's DNS, to every pod of its tier, as it would in a cluster.
- `containerPort`s are published on the host: removed (the test reaches pods at their
  addresses on the podman network). Probes naming a port get its number.
- Probes: kube play makes the liveness probe a health check (`podman healthcheck run`) and
  runs an httpGet one with curl, which the image does not have: it becomes an exec probe
  fetching the same path with the image's python. Readiness and startup probes are ignored.
- Secrets: a podman secret of the same name stands in (kube play reads secretKeyRef from
  there), holding the keys as JSON with base64 values; ConfigMaps go with `--configmap`.
- The downward API's `status.podIP` is not supported: the pod gets a fixed address
  (`--ip`), written into the variable instead.
- The pod network: the podman network is made inside the ConfigMap's allowed_remote_hosts
  network (10.244.0.0/16), so the KV config is played unchanged.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

# Probes as exec commands: the same GET, with the image's python instead of the kubelet.
_FETCH = ("import sys, urllib.request; "
          "sys.exit(urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=5)"
          ".status != 200)")


def load(path: Path) -> list[Manifest]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def for_podman(deployment: Manifest, image: str, address: str, name: str | None = None
               ) -> Manifest:
    """A Deployment as podman plays it, one pod at `address`: `image` for every container,
    no published ports, the liveness probe as an exec probe; optionally renamed (another
    replica of the same tier: podman does not scale)."""
    d = copy.deepcopy(deployment)
    d["spec"]["replicas"] = 1
    if name is not None:
        d["metadata"]["name"] = name
    for c in d["spec"]["template"]["spec"]["containers"]:
        c["image"] = image
        for var in c.get("env", []):
            if (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                del var["valueFrom"]
                var["value"] = address
        ports = {p["name"]: p["containerPort"] for p in c.pop("ports", [])}
        c.pop("readinessProbe", None)
        c.pop("startupProbe", None)
        if (probe := c.get("livenessProbe")) and "httpGet" in probe:
            get = probe.pop("httpGet")
            port = ports.get(get["port"], get["port"])
            probe["exec"] = {"command": ["python3", "-c",
                                         _FETCH.format(port=port, path=get["path"])]}
    return d


def secret(data: dict[str, str], path: Path) -> Path:
    """A Secret's keys as `podman secret create` takes them for kube play."""
    path.write_text(json.dumps({k: base64.b64encode(v.encode()).decode()
                                for k, v in data.items()}))
    return path


def dump(manifest: Manifest, path: Path) -> Path:
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return path
