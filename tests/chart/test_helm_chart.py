"""charts/kvfleet: lint, render with default and non-default values, validate, least-privilege RBAC."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import (
    CHART,
    CRD,
    KUBE_VERSION,
    REPO,
    by_kind,
    one,
    render_notes,
    run_helm,
    template,
    validate,
)

# Everything optional switched on, names and namespaces changed. The observability
# pieces (grafanaDashboard, prometheusRule) render whether or not their templates exist.
ALL_ON: dict[str, Any] = {
    "fullnameOverride": "fleet-op",
    "operator": {"image": {"tag": "0.1.1", "pullPolicy": "Always"}, "watchNamespaces": ["team-a", "team-b"],
                 "verbose": True, "healthPort": 9090, "retryDelaySeconds": 5,
                 "imagePullSecrets": [{"name": "ghcr"}], "nodeSelector": {"pool": "system"},
                 "tolerations": [{"key": "system", "operator": "Exists", "effect": "NoSchedule"}],
                 "podAnnotations": {"team": "ml"}},
    "serviceAccount": {"create": True, "name": "kvfleet-sa", "annotations": {"eks.amazonaws.com/role-arn": "x"}},
    "service": {"enabled": True, "port": 9090},
    "serviceMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "prom"}},
    "prometheusAdapter": {"enabled": True, "namespace": "monitoring"},
    "examples": {"enabled": True},
    "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}, "thresholds": {"kvCacheUsageRatio": 0.9}},
}
VALUE_SETS = {"defaults": None, "all-on": ALL_ON,
              "minimal": {"rbac": {"create": False}, "service": {"enabled": False},
                          "serviceAccount": {"create": False, "name": "existing-sa"}}}


@pytest.mark.parametrize("values", [None, ALL_ON], ids=["defaults", "all-on"])
def test_helm_lint(values: dict | None, tmp_path: Path) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values:
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
        args += ["-f", str(tmp_path / "v.yaml")]
    done = run_helm(*args)
    assert done.returncode == 0, done.stdout + done.stderr


def test_chart_crd_is_byte_identical_to_the_source_of_truth() -> None:
    assert (CHART / "crds" / "llmservice.yaml").read_bytes() == CRD.read_bytes(), \
        "run: cp crds/llmservice.yaml charts/kvfleet/crds/llmservice.yaml"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_manifest_is_valid(name: str, tmp_path: Path) -> None:
    manifests = template(VALUE_SETS[name], tmp_path, "--include-crds")
    assert manifests
    for m in manifests:
        validate(m)
    kinds = {m["kind"] for m in manifests}
    assert {"Deployment", "CustomResourceDefinition"} <= kinds
    if name == "all-on":
        assert {"ServiceMonitor", "ConfigMap", "LLMService", "Role", "RoleBinding"} <= kinds
    if name == "minimal":
        assert not kinds & {"ClusterRole", "ServiceAccount", "Service"}


def test_bad_values_are_refused_naming_the_field(tmp_path: Path) -> None:
    for values, field in (({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "operator.image.pullPolicy"),
                          ({"serviceMonitr": {"enabled": True}}, "serviceMonitr"),
                          ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "watchNamespaces")):
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
        done = run_helm("template", "kvfleet", str(CHART), "-f", str(tmp_path / "v.yaml"))
        assert done.returncode != 0 and field in done.stderr, done.stderr


# ---------------------------------------------------------------- RBAC


def operator_rbac_table() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) from the table in operator/kvfleet_operator/apply.py's docstring."""
    import kvfleet_operator.apply as apply

    doc = apply.__doc__ or ""
    rows = set()
    for line in doc.splitlines():
        m = re.match(r"^\s{4}(\S+)\s+(\S+)\s+((?:get|list|watch|create|patch|update|delete)(?: \w+)*)", line)
        if m:
            group = "" if m.group(1) == '""' else m.group(1)
            rows |= {(group, m.group(2), verb) for verb in m.group(3).split()}
    assert len(rows) > 10, f"could not read the RBAC table from apply.py: {doc[:300]!r}"
    return rows


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_cluster_role_grants_exactly_what_the_operator_calls(tmp_path: Path) -> None:
    manifests = template(None, tmp_path)
    role = one(manifests, "ClusterRole")
    assert granted(role["rules"]) == operator_rbac_table()
    binding = one(manifests, "ClusterRoleBinding")
    sa = one(manifests, "ServiceAccount")
    deployment = one(manifests, "Deployment")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "kvfleet-system"}]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_watched_namespaces_get_roles_and_no_cluster_wide_access(tmp_path: Path) -> None:
    manifests = template({"operator": {"watchNamespaces": ["team-a", "team-b"]}}, tmp_path)
    table = operator_rbac_table()
    cluster = granted(one(manifests, "ClusterRole")["rules"])
    # kopf lists and watches namespaces even when it serves a fixed list of them
    cluster_wide = ("customresourcedefinitions", "namespaces")
    assert cluster == {row for row in table if row[1] in cluster_wide}
    roles = by_kind(manifests, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    namespaced = {row for row in table if row[1] not in cluster_wide}
    for role in roles:
        assert granted(role["rules"]) == namespaced
    bindings = by_kind(manifests, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    args = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "team-a" and args.count("--namespace") == 2


# ---------------------------------------------------------------- the operator Deployment


def test_operator_deployment_runs_one_kopf_with_its_health_probe(tmp_path: Path) -> None:
    manifests = template({"operator": {"healthPort": 9090, "watchNamespaces": ["a"], "verbose": True}}, tmp_path)
    deployment = one(manifests, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/kvfleet/kvfleet-operator:0.1.0"
    assert container["args"][:2] == ["--liveness", "http://0.0.0.0:9090/healthz"]
    assert container["ports"] == [{"name": "health", "containerPort": 9090, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # the flags the chart passes are ones kvfleet-operator documents
    helped = subprocess.run([sys.executable, "-m", "kvfleet_operator.main", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    flags = [a for a in container["args"] if a.startswith("--")]
    assert flags == ["--liveness", "--namespace", "--verbose"]
    for flag in flags:
        assert flag in helped.stdout, flag
    service = one(manifests, "Service")
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "health"


def test_operator_pods_are_never_selected_as_runtime_pods(tmp_path: Path) -> None:
    from kvfleet_operator import resources
    from kvfleet_operator.spec import parse_spec

    operator_labels = one(template(None, tmp_path), "Deployment")["spec"]["template"]["metadata"]["labels"]
    runtime = resources.selector_labels(parse_spec(example_body("kvfleet")))
    assert not set(runtime.items()) <= set(operator_labels.items())


# ---------------------------------------------------------------- optional pieces


def example_body(name: str = "llama-8b") -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / "llmservice.yaml").read_text()) if d]
    body = next(d for d in docs if d["kind"] == "LLMService")
    return {**body, "metadata": {**body["metadata"], "name": name, "namespace": "team-a", "uid": "u1"}}


def test_service_monitor_selects_the_services_the_operator_builds(tmp_path: Path) -> None:
    from kvfleet_operator import resources
    from kvfleet_operator.spec import parse_spec

    monitor = one(template({"serviceMonitor": {"enabled": True}}, tmp_path), "ServiceMonitor")
    service = resources.build_service(parse_spec(example_body()))
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert set(selector.items()) <= set(service["metadata"]["labels"].items())
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"] and "http" in ports
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    scoped = one(template({"serviceMonitor": {"enabled": True}, "operator": {"watchNamespaces": ["team-a"]}},
                          tmp_path), "ServiceMonitor")
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_adapter_rules_expose_tokens_per_second_from_the_counter(tmp_path: Path) -> None:
    from kvfleet_operator import resources

    manifests = template({"prometheusAdapter": {"enabled": True, "namespace": "monitoring"}}, tmp_path)
    config_map = one(manifests, "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    rule, = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == resources.TOKENS_PER_SECOND_METRIC == "kvfleet_generation_tokens_per_second"
    assert re.match(rule["name"]["matches"], "kvfleet_generation_tokens_total")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    # what the adapter sends Prometheus for an HPA asking about two pods
    query = (rule["metricsQuery"].replace("<<.Series>>", "kvfleet_generation_tokens_total")
             .replace("<<.LabelMatchers>>", 'namespace="team-a",pod=~"p1|p2"').replace("<<.GroupBy>>", "pod"))
    assert query == 'sum(rate(kvfleet_generation_tokens_total{namespace="team-a",pod=~"p1|p2"}[1m])) by (pod)'
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: run scripts/install-tools"
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": [
        {"record": "kvfleet:tokens_per_second", "expr": query}]}]}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_example_llmservices_are_valid_for_the_crd_and_the_operator(tmp_path: Path) -> None:
    services = by_kind(template({"examples": {"enabled": True}}, tmp_path), "LLMService")
    assert [s["metadata"]["name"] for s in services] == ["smollm2"]
    for s in services:
        validate(s)
    assert by_kind(template(None, tmp_path), "LLMService") == []


def test_notes_show_how_to_apply_and_reach_an_llmservice(tmp_path: Path) -> None:
    notes = render_notes({"prometheusAdapter": {"enabled": True}}, tmp_path)
    for needle in ("kubectl -n llm apply -f examples/llmservice.yaml", "port-forward service/llama-8b",
                   "/v1/chat/completions", "get hpa", "rules.existing=kvfleet-adapter-rules"):
        assert needle in notes, needle


def test_every_value_is_commented_and_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    path: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_]\w*):", line)
        if not m or line.lstrip().startswith("-"):
            continue
        indent, key = len(m.group(1)), m.group(2)
        path = [(n, k) for n, k in path if n < indent]
        if path and path[0][1] == "examples" and len(path) >= 2:    # example data, described by the CRD
            continue
        path.append((indent, key))
        dotted = ".".join(k for _, k in path)
        node = schema
        for _, k in path:
            if "properties" not in node:    # an entry of a free-form map (resources, labels): data
                break
            assert k in node["properties"], f"values.schema.json does not describe {dotted}"
            node = node["properties"][k]
        else:
            assert lines[i - 1].strip().startswith("#"), f"values.yaml: {dotted} has no comment above it"


def test_oldest_supported_kubernetes_is_the_one_validated_and_documented() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={KUBE_VERSION}-0"
    assert f"Kubernetes >= {KUBE_VERSION.rsplit('.', 1)[0]}" in (REPO / "docs" / "DEPLOY.md").read_text()
    major, minor, _ = KUBE_VERSION.split(".")
    done = run_helm("template", "kvfleet", str(CHART), "--kube-version", f"{major}.{int(minor) - 1}.0")
    assert done.returncode != 0 and "requires kubeVersion" in done.stderr


def test_notes_point_at_a_watched_namespace(tmp_path: Path) -> None:
    notes = render_notes({"operator": {"watchNamespaces": ["team-a", "team-b"]}}, tmp_path)
    assert "watching: team-a, team-b" in notes
    assert "kubectl -n team-a apply -f examples/llmservice.yaml" in notes
    assert "kubectl -n team-a create secret generic model-store" in notes
    assert "rollout status deployment/kvfleet" in notes and "kubectl -n llm rollout" in notes


def test_example_llmservice_with_adapters_renders_the_operators_lora_pulls_and_flags(tmp_path: Path) -> None:
    import jsonschema
    from kvfleet_operator import resources
    from kvfleet_operator.spec import parse_spec

    spec = {"model": {"uri": "s3://models/SmolLM2-135M-Instruct", "name": "smollm2-135m"},
            "adapters": [{"name": "sql", "uri": "s3://models/adapters/smollm2-sql"},
                         {"name": "chat-de", "uri": "s3://models/adapters/smollm2-chat-de"}],
            "s3": {"endpoint": "http://seaweedfs-s3.storage.svc.cluster.local:8333", "credentialsSecret": "model-store"},
            "engine": {"maxLoraRank": 32, "maxCpuLoras": 4}, "resources": {"gpus": 0}}
    values = {"examples": {"enabled": True, "llmServices": [{"name": "smollm2-lora", "spec": spec}]}}
    (service,) = by_kind(template(values, tmp_path), "LLMService")
    validate(service)   # the CRD's schema and the operator's parser
    assert service["spec"]["adapters"] == spec["adapters"]
    parsed = parse_spec({**service, "metadata": {**service["metadata"], "uid": "u"}})
    pod = resources.build_deployment(parsed)["spec"]["template"]["spec"]
    assert [c["command"][2:4] for c in pod["initContainers"]] == [
        ["s3://models/SmolLM2-135M-Instruct", "/models"],
        ["s3://models/adapters/smollm2-sql", "/adapters/sql"],
        ["s3://models/adapters/smollm2-chat-de", "/adapters/chat-de"]]
    command = pod["containers"][0]["command"]
    assert command[command.index("--enable-lora"):] == [
        "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat-de=/adapters/chat-de",
        "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4"]
    # a clash the chart must not hide: helm renders it, the CRD schema refuses it
    bad = {"examples": {"enabled": True, "llmServices": [{"name": "bad", "spec": {
        **spec, "adapters": [{"name": "SQL", "uri": "s3://models/adapters/smollm2-sql"}]}}]}}
    (refused,) = by_kind(template(bad, tmp_path), "LLMService")
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        validate(refused)


def test_example_llmservice_from_the_hub_hands_the_token_secret_to_its_pull(tmp_path: Path) -> None:
    from kvfleet_operator import resources
    from kvfleet_operator.spec import SpecError, parse_spec

    spec = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "main"},
            "hf": {"tokenSecret": "hf-token"}, "resources": {"gpus": 1}}
    values = {"examples": {"enabled": True, "llmServices": [{"name": "llama-hub", "spec": spec}]}}
    (service,) = by_kind(template(values, tmp_path), "LLMService")
    validate(service)   # the CRD's schema and the operator's parser
    assert service["spec"]["hf"] == {"tokenSecret": "hf-token"}
    parsed = parse_spec({**service, "metadata": {**service["metadata"], "uid": "u"}})
    (init,) = resources.build_deployment(parsed)["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][2:4] == ["hf://meta-llama/Llama-3.1-8B-Instruct@main", "/models"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}} in init["env"]
    # an hf block beside an s3:// model: the schema lets it through, the operator (like the CEL rule) refuses it
    bad = {"examples": {"enabled": True, "llmServices": [{"name": "bad", "spec": {
        **spec, "model": {"uri": "s3://models/llama"}}}]}}
    (refused,) = by_kind(template(bad, tmp_path), "LLMService")
    with pytest.raises(SpecError, match="spec.hf is allowed only with an hf:// model.uri"):
        validate(refused)
