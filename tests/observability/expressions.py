"""The PromQL a Grafana dashboard runs, with its template variables filled in as Grafana would."""

from __future__ import annotations

import re
from dataclasses import dataclass

from observability.grafana_schema import VARIABLE_RE

# "All" of a multi-value variable is its allValue, ".*"; so every label filter
# of the dashboard then matches every series, as in Grafana with nothing picked.
ALL = ".*"
LABEL_VALUES_RE = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


@dataclass(frozen=True)
class Query:
    panel_id: int
    panel_title: str
    ref_id: str
    expr: str


@dataclass(frozen=True)
class VariableQuery:
    name: str
    selector: str       # series selector whose label values fill the variable
    label: str


def fill(text: str, rate_interval: str = "1m") -> str:
    builtins = {"__rate_interval": rate_interval, "__interval": rate_interval,
                "__range": rate_interval}
    return VARIABLE_RE.sub(lambda m: builtins.get(m.group(1) or m.group(2), ALL), text)


def dashboard_queries(dash: dict, rate_interval: str = "1m") -> list[Query]:
    panels = [p for top in dash["panels"] for p in (top, *top.get("panels", []))]
    return [Query(panel_id=p["id"], panel_title=p["title"], ref_id=t["refId"],
                  expr=fill(t["expr"], rate_interval))
            for p in panels for t in p.get("targets", [])]


def variable_queries(dash: dict) -> list[VariableQuery]:
    found = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = LABEL_VALUES_RE.match(text)
        assert match, f"variable {var['name']}: only label_values(selector, label) is supported"
        found.append(VariableQuery(name=var["name"], selector=fill(match["selector"]),
                                   label=match["label"]))
    return found
