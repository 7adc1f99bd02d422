"""A stand-in for kube-state-metrics: its HPA and Deployment series, served on a loopback /metrics.

No Kubernetes runs here, so the dashboard's and alerts' expressions over
kube-state-metrics series are fed from this real exposition endpoint
(prometheus-client), using kube-state-metrics' own metric and label names.
"""

from __future__ import annotations

from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

HPA = "horizontalpodautoscaler"


@dataclass(frozen=True)
class Hpa:
    """One LLMService's HPA and the Deployment it scales (both named after the LLMService)."""
    namespace: str
    name: str
    current_replicas: int
    desired_replicas: int
    max_replicas: int
    metric_name: str = "kvfleet_generation_tokens_per_second"


@dataclass
class KubeStateMetrics:
    server: WSGIServer

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_kube_state_metrics(hpas: list[Hpa]) -> KubeStateMetrics:
    registry = CollectorRegistry()

    def gauge(name: str, labels: list[str]) -> Gauge:
        return Gauge(name, f"kube-state-metrics series {name}", labels, registry=registry)

    current = gauge("kube_horizontalpodautoscaler_status_current_replicas", ["namespace", HPA])
    desired = gauge("kube_horizontalpodautoscaler_status_desired_replicas", ["namespace", HPA])
    maximum = gauge("kube_horizontalpodautoscaler_spec_max_replicas", ["namespace", HPA])
    target = gauge("kube_horizontalpodautoscaler_spec_target_metric",
                   ["namespace", HPA, "metric_name", "metric_target_type"])
    info = gauge("kube_horizontalpodautoscaler_info",
                 ["namespace", HPA, "scaletargetref_api_version", "scaletargetref_kind",
                  "scaletargetref_name"])
    replicas = gauge("kube_deployment_status_replicas", ["namespace", "deployment"])
    for hpa in hpas:
        current.labels(hpa.namespace, hpa.name).set(hpa.current_replicas)
        desired.labels(hpa.namespace, hpa.name).set(hpa.desired_replicas)
        maximum.labels(hpa.namespace, hpa.name).set(hpa.max_replicas)
        target.labels(hpa.namespace, hpa.name, hpa.metric_name, "average").set(100)
        info.labels(hpa.namespace, hpa.name, "apps/v1", "Deployment", hpa.name).set(1)
        replicas.labels(hpa.namespace, hpa.name).set(hpa.current_replicas)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    return KubeStateMetrics(server=server)
