"""docs/DEPLOY.md: every command is run where it can run here, and checked for the names it uses where not.

helm install -> helm template (validated manifests); kubectl create -> --dry-run=client (validated);
kubectl apply -f - -> the heredoc validated against the official schemas / the CRD and the operator's
parser; the rest (rollout, port-forward, curl, get hpa, ...) must name things the chart and the
operator really create. A command of a kind this test does not know fails it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import CHART, REPO, one, run_helm, validate

DOC = REPO / "docs" / "DEPLOY.md"


@dataclass
class Command:
    argv: list[str]
    stdin: str | None = None     # a heredoc body

    def flag(self, name: str) -> str | None:
        for i, word in enumerate(self.argv):
            if word == name:
                return self.argv[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None

    def sets(self) -> dict[str, str]:
        return dict(self.argv[i + 1].split("=", 1) for i, w in enumerate(self.argv) if w == "--set")


def doc_commands() -> list[Command]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    commands: list[Command] = []
    for block in blocks:
        lines = re.sub(r"\\\n\s*", " ", block).splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            heredoc = re.search(r"<<'?(\w+)'?\s*$", line)
            body = None
            if heredoc:
                end = lines.index(heredoc.group(1), i)
                body, i = "\n".join(lines[i:end]) + "\n", end + 1
                line = line[:heredoc.start()]
            for part in line.split("&&"):
                if part.strip():
                    commands.append(Command(shlex.split(part), body))
    return commands


COMMANDS = doc_commands()


def example_llmservice() -> dict[str, Any]:
    docs = yaml.safe_load_all((REPO / "examples" / "llmservice.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "LLMService")


def children() -> dict[str, dict[str, Any]]:
    """What the operator builds for the doc's LLMService in namespace llm."""
    from kvfleet_operator import resources
    from kvfleet_operator.spec import parse_spec

    body = doc_llmservice()
    spec = parse_spec({**body, "metadata": {**body["metadata"], "namespace": "llm", "uid": "u"}})
    return {kind: m for kind, m in resources.build_children(spec).items() if m is not None}


def doc_llmservice() -> dict[str, Any]:
    applied = [c for c in COMMANDS if c.argv[:2] == ["kubectl", "-n"] and "apply" in c.argv and c.stdin]
    assert len(applied) == 1
    return yaml.safe_load(applied[0].stdin)


def kubectl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": os.devnull}
    return subprocess.run([str(Path(sys.executable).with_name("kubectl")), *args], capture_output=True,
                          text=True, env=env, timeout=60)


def chart_release(tmp_path: Path) -> tuple[Command, list[dict[str, Any]]]:
    """The doc's `helm install` of our chart, run as `helm template`."""
    install = next(c for c in COMMANDS if c.argv[:2] == ["helm", "install"] and c.argv[3] == "charts/kvfleet")
    args = ["template", *[str(REPO / a) if a == "charts/kvfleet" else a for a in install.argv[2:]
                          if a not in ("--create-namespace", "--wait")]]
    done = run_helm(*args)
    assert done.returncode == 0, done.stderr
    return install, [d for d in yaml.safe_load_all(done.stdout) if d]


def test_helm_install_renders_valid_manifests(tmp_path: Path) -> None:
    install, manifests = chart_release(tmp_path)
    for m in manifests:
        validate(m)
    namespace = install.flag("--namespace")
    deployment = one(manifests, "Deployment")
    rollout = next(c for c in COMMANDS if "rollout" in c.argv)
    assert rollout.argv == ["kubectl", "-n", namespace, "rollout", "status",
                            f"deployment/{deployment['metadata']['name']}"]
    crd = yaml.safe_load((CHART / "crds" / "llmservice.yaml").read_text())
    assert ["kubectl", "get", "crd", crd["metadata"]["name"]] in [c.argv for c in COMMANDS]
    upgrade = next(c for c in COMMANDS if c.argv[:2] == ["helm", "upgrade"])
    uninstall = next(c for c in COMMANDS if c.argv[:2] == ["helm", "uninstall"])
    assert upgrade.argv[2] == uninstall.argv[2] == install.argv[2]
    assert upgrade.flag("--namespace") == uninstall.flag("--namespace") == namespace


def test_prometheus_adapter_install_uses_the_charts_rules(tmp_path: Path) -> None:
    _, manifests = chart_release(tmp_path)
    rules = one(manifests, "ConfigMap")
    adapter = next(c for c in COMMANDS if c.argv[:2] == ["helm", "install"] and "prometheus-adapter" in c.argv[3])
    assert adapter.sets()["rules.existing"] == rules["metadata"]["name"]
    assert adapter.flag("--namespace") == rules["metadata"]["namespace"]
    repo_add = next(c for c in COMMANDS if c.argv[:3] == ["helm", "repo", "add"])
    assert adapter.argv[3].split("/")[0] == repo_add.argv[3]


def test_kubectl_create_commands_make_valid_objects() -> None:
    creates = [c for c in COMMANDS if "create" in c.argv[:4] and c.argv[0] == "kubectl"]
    assert len(creates) == 2
    made = []
    for c in creates:
        done = kubectl(*c.argv[1:], "--dry-run=client", "-o", "yaml")
        assert done.returncode == 0, done.stderr
        obj = yaml.safe_load(done.stdout)
        validate(obj)
        made.append(obj)
    secret = next(o for o in made if o["kind"] == "Secret")
    s3 = doc_llmservice()["spec"]["s3"]
    assert secret["metadata"]["name"] == s3["credentialsSecret"]
    assert sorted(secret["data"]) == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    pull_env = {e["name"] for e in children()["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]["env"]
                if "valueFrom" in e}
    assert pull_env == set(secret["data"]), "the Secret's keys are the ones the pull reads"
    namespace = next(o for o in made if o["kind"] == "Namespace")
    assert namespace["metadata"]["name"] == secret["metadata"]["namespace"] == "llm"


def test_applied_llmservice_is_valid_and_the_example() -> None:
    body = doc_llmservice()
    validate(body)
    assert body == example_llmservice(), "docs/DEPLOY.md's LLMService drifted from examples/llmservice.yaml"


def test_observing_commands_name_what_the_operator_creates() -> None:
    kids = children()
    name = kids["Deployment"]["metadata"]["name"]
    init = kids["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]["name"]
    port = kids["Service"]["spec"]["ports"][0]["port"]
    argvs = [c.argv for c in COMMANDS]
    assert ["kubectl", "-n", "llm", "logs", f"deployment/{name}", "-c", init] in argvs
    assert ["kubectl", "-n", "llm", "get", "hpa", kids["HorizontalPodAutoscaler"]["metadata"]["name"], "-w"] in argvs
    forward = next(c for c in COMMANDS if "port-forward" in c.argv)
    assert forward.argv[3:] == ["port-forward", f"service/{kids['Service']['metadata']['name']}", f"8000:{port}"]
    assert ["kubectl", "-n", "llm", "delete", "llmservice", name] in argvs
    metric = kids["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    raw = next(c for c in COMMANDS if "--raw" in c.argv)
    assert raw.flag("--raw") == f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/llm/pods/*/{metric}"


def test_curl_calls_match_the_served_model() -> None:
    model = doc_llmservice()["spec"]["model"]["name"]
    curls = [c for c in COMMANDS if c.argv[0] == "curl"]
    assert {c.argv[1] for c in curls} == {"http://localhost:8000/v1/models", "http://localhost:8000/v1/chat/completions"}
    for c in curls:
        body = c.flag("-d")
        if body:
            request = json.loads(body)
            assert request["model"] == model and request["messages"][0]["role"] == "user"


def test_model_upload_matches_the_llmservice_and_its_manifest_is_accepted(tmp_path: Path) -> None:
    from kvfleet_runtime.pull import parse_manifest

    spec = doc_llmservice()["spec"]
    sync = next(c for c in COMMANDS if c.argv[:3] == ["aws", "s3", "sync"])
    assert sync.argv[4] == spec["model"]["uri"] and sync.flag("--endpoint-url") == spec["s3"]["endpoint"]
    # the doc's sha256sum line, run on a folder, writes a manifest kvfleet pull accepts
    sums = next(c for c in COMMANDS if c.argv[0] == "sha256sum")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 10)
    out = subprocess.run(" ".join(sums.argv[:-2]), shell=True, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert set(parse_manifest(out.stdout, {"config.json": None, "model.safetensors": None})) == \
        {"config.json", "model.safetensors"}


HANDLED = {("helm", "install"), ("helm", "repo"), ("helm", "upgrade"), ("helm", "uninstall"),
           ("kubectl", "create"), ("kubectl", "apply"), ("kubectl", "get"), ("kubectl", "rollout"),
           ("kubectl", "logs"), ("kubectl", "port-forward"), ("kubectl", "delete"), ("curl", None),
           ("aws", "s3"), ("sha256sum", None), ("cd", None)}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c.argv)[:60])
def test_every_command_is_of_a_kind_checked_above(command: Command) -> None:
    words = list(command.argv)
    if len(words) > 2 and words[1] == "-n":
        del words[1:3]
    key = (words[0], words[1] if words[0] in ("helm", "kubectl", "aws") else None)
    assert key in HANDLED, f"docs/DEPLOY.md gained a command this test does not check: {command.argv}"


def rbac_request(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) an API request needs, as the API server
    authorizes it; None for discovery, which every authenticated client may read."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list")
    return group, resource + (f"/{sub}" if sub else ""), verb


def test_kubectl_walkthrough_against_the_emulator_with_the_operator_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The doc's kubectl steps with the real kubectl, in order, against the Kubernetes emulator
    (tests/support/kube.py) while `kvfleet-operator` runs with the chart's arguments, and every
    API request the operator makes is one the chart's RBAC allows."""
    import socket
    import time

    import httpx
    from helm_chart import template
    from support.kube import KubeCluster, KubeEmulator
    from test_helm_chart import granted

    crd = yaml.safe_load((CHART / "crds" / "llmservice.yaml").read_text())
    manifests = template({"operator": {"watchNamespaces": ["llm"]}}, tmp_path)
    operator_args = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    allowed = granted([r for m in manifests if m["kind"] in ("Role", "ClusterRole") for r in m["rules"]])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        health_port = s.getsockname()[1]
    # the chart's args, with the health endpoint on a free loopback port
    args = [a.replace("0.0.0.0:8080", f"127.0.0.1:{health_port}") for a in operator_args]
    assert args[args.index("--namespace") + 1] == "llm"
    requested: set[tuple[str, str, str]] = set()
    serve = KubeEmulator.__call__

    async def recording(self: KubeEmulator, raw: Any) -> Any:
        if not raw.headers.get("User-Agent", "").startswith("kubectl"):
            needed = rbac_request(raw.method, raw.path, dict(raw.query))
            if needed:
                requested.add(needed)
        return await serve(self, raw)

    monkeypatch.setattr(KubeEmulator, "__call__", recording)
    with KubeCluster(tmp_path, crds=[crd]) as cluster:
        # An API server serves an HPA under every autoscaling version; the emulator keeps one
        # store per version and names a random preferred one, so offer kubectl only v2.
        for key in [k for k in cluster.emulator.resources.keys()
                    if (k.group, k.version, k.plural) == ("autoscaling", "v1", "horizontalpodautoscalers")]:
            del cluster.emulator.resources[key]
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "KVFLEET_OPERATOR_RETRY_DELAY": "1",
               "KUBECACHEDIR": str(tmp_path / "kube-cache")}
        env.pop("KUBERNETES_SERVICE_HOST", None)

        def run(argv: list[str], stdin: str | None = None) -> str:
            done = subprocess.run([str(Path(sys.executable).with_name("kubectl")), *argv[1:]], input=stdin,
                                  capture_output=True, text=True, env=env, timeout=60)
            assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
            return done.stdout

        # what helm install does first: the chart's crds/
        run(["kubectl", "apply", "--validate=false", "-f", str(CHART / "crds" / "llmservice.yaml")])
        operator = subprocess.Popen([sys.executable, "-m", "kvfleet_operator.main", *args], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert operator.poll() is None, operator.communicate()[1][-3000:]
                try:
                    if httpx.get(f"http://127.0.0.1:{health_port}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the operator's /healthz never answered"
                time.sleep(0.2)
            for c in COMMANDS:
                if c.argv[0] != "kubectl" or "--raw" in c.argv or \
                        not {"get", "apply", "create", "delete"} & set(c.argv[:4]):
                    continue        # rollout, logs, port-forward need real controllers / kubelets
                argv = [a for a in c.argv if a != "-w"]
                if argv[1:3] == ["create", "namespace"]:
                    continue        # the emulator cannot store Namespaces (dry-run tested above)
                if "create" in argv[:4]:
                    # the emulator answers kubectl's create POST badly; apply what create would send
                    made = run([*argv, "--dry-run=client", "-o", "yaml"])
                    run(["kubectl", "apply", "--validate=false", "-f", "-"], made)
                elif "apply" in argv:
                    run([*argv[:argv.index("apply") + 1], "--validate=false", *argv[argv.index("apply") + 1:]],
                        c.stdin)
                    # the operator reconciles it into children before the doc looks at them
                    deadline = time.monotonic() + 60
                    while cluster.get("autoscaling/v2", "horizontalpodautoscalers", "llm", "llama-8b") is None:
                        assert time.monotonic() < deadline, "the operator made no HPA"
                        assert operator.poll() is None, operator.communicate()[1][-3000:]
                        time.sleep(0.2)
                else:
                    out = run(argv)
                    if argv[-1] == "llmservices":
                        assert "llama-8b" in out
            assert cluster.get("kvfleet.io/v1alpha1", "llmservices", "llm", "llama-8b") is None
            assert requested - allowed == set(), "the operator made requests its RBAC does not allow"
            assert {("apps", "deployments", "create"), ("kvfleet.io", "llmservices/status", "patch"),
                    ("", "secrets", "get")} <= requested, requested
        finally:
            operator.kill()
            operator.wait(timeout=30)


def test_pull_command_and_curl_steps_against_kvfleet_serve(tmp_path: Path) -> None:
    """Steps 3-6 on one machine: the model uploaded to S3 (SeaweedFS), the init container's
    `kvfleet pull` exactly as the operator writes it, `kvfleet serve` of what was pulled, and
    the doc's curl commands against it."""
    from kvfleet_operator import resources
    from kvfleet_operator.spec import parse_spec
    from support.s3 import start_seaweedfs
    from support.server import running_server
    from support.tiny_models import make_tiny_model

    body = doc_llmservice()
    spec = parse_spec({**body, "metadata": {**body["metadata"], "namespace": "llm", "uid": "u"}})
    checkpoint = make_tiny_model("llama", tmp_path / "ckpt", max_shard_size="200KB")
    s3 = start_seaweedfs(tmp_path / "s3")
    try:
        bucket, _, prefix = spec.model.uri.removeprefix("s3://").partition("/")
        s3.client().create_bucket(Bucket=bucket)
        s3.upload_dir(checkpoint, bucket, prefix)
        (init,) = resources.build_deployment(spec)["spec"]["template"]["spec"]["initContainers"]
        command = init["command"]
        assert command[:2] == ["kvfleet", "pull"] and command[3] == resources.MODELS_DIR
        models = tmp_path / "models"
        pulled = subprocess.run([sys.executable, "-m", "kvfleet_runtime.cli", "pull", command[2], str(models),
                                 *command[4:]], env=s3.env(), capture_output=True, text=True, timeout=300)
        assert pulled.returncode == 0, pulled.stderr
    finally:
        s3.stop()
    with running_server(models, "--served-model-name", spec.model.name, "--max-num-seqs", "4",
                        "--num-gpu-blocks", "64", "--max-model-len", "512") as server:
        curls = [c for c in COMMANDS if c.argv[0] == "curl"]
        generated = 0
        for c in curls:
            argv = [a.replace("http://localhost:8000", server.base_url) for a in c.argv]
            done = subprocess.run([argv[0], "-sS", "--fail-with-body", *argv[1:]], capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr + server.log()
            answer = json.loads(done.stdout)
            if argv[1].endswith("/v1/models"):
                assert [m["id"] for m in answer["data"]] == [spec.model.name]
            else:
                assert answer["model"] == spec.model.name and answer["choices"][0]["message"]["role"] == "assistant"
                generated += answer["usage"]["completion_tokens"]
        assert generated >= 1
        # the counter the chart's prometheus-adapter rule turns into tokens per second
        _, manifests = chart_release(tmp_path)
        rule = yaml.safe_load(one(manifests, "ConfigMap")["data"]["config.yaml"])["rules"][0]
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert server.metric(series) == generated
