"""Structural check of a Grafana dashboard against the schema version it declares.

Grafana's JSON schema cannot be fetched here (no network), so this encodes what
Grafana 10.4 / 11 (dashboard schemaVersion 39) requires of the parts we use:
the dashboard's top-level keys, panels (type, id, gridPos on the 24-column
grid, datasource, fieldConfig, options, targets) and template variables; plus
what the Grafana sidecar needs to import it unattended (a fixed uid, no
`__inputs` placeholders). `dashboard_problems` returns every problem found, so
one run names them all.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

SCHEMA_VERSION = 39
GRID_COLUMNS = 24
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "text", "heatmap",
               "piechart", "barchart", "state-timeline", "status-history", "logs",
               "histogram", "row"}
VARIABLE_TYPES = {"query", "adhoc", "constant", "datasource", "interval", "textbox", "custom"}
# Grafana's unit ids for what we plot (the unit picker's ids, not display names)
UNITS = {"short", "none", "percent", "percentunit", "s", "ms", "reqps", "ops", "rps",
         "bytes", "decbytes", "tps"}
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__interval_ms", "__range",
                     "__range_s", "__all", "__dashboard", "__from", "__to"}
UID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,40}$")
VARIABLE_RE = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::\w+)?\}|([A-Za-z_]\w*))")  # not $1 of label_replace
REQUIRED_TOP = {"uid": str, "title": str, "schemaVersion": int, "editable": bool,
                "graphTooltip": int, "time": dict, "annotations": dict, "templating": dict,
                "panels": list, "refresh": str, "tags": list}


def dashboard_problems(dash: dict) -> list[str]:
    problems: list[str] = []
    for key, typ in REQUIRED_TOP.items():
        if not isinstance(dash.get(key), typ):
            problems.append(f"dashboard.{key} must be a {typ.__name__}; got {dash.get(key)!r}")
    if problems:
        return problems
    if dash["schemaVersion"] != SCHEMA_VERSION:
        problems.append(f"dashboard.schemaVersion must be {SCHEMA_VERSION} (what this check "
                        f"encodes); got {dash['schemaVersion']}")
    if not UID_RE.match(dash["uid"]):
        problems.append(f"dashboard.uid must match {UID_RE.pattern}; got {dash['uid']!r}")
    if dash.get("id") is not None:
        problems.append("dashboard.id must be absent or null: Grafana assigns it on import")
    for key in ("__inputs", "__requires"):
        if key in dash:
            problems.append(f"dashboard.{key} is for manual import; the sidecar cannot fill it")
    if dash["graphTooltip"] not in (0, 1, 2):
        problems.append(f"dashboard.graphTooltip must be 0, 1 or 2; got {dash['graphTooltip']}")
    for key in ("from", "to"):
        if not isinstance(dash["time"].get(key), str):
            problems.append(f"dashboard.time.{key} must be a string like 'now-1h'")
    if not isinstance(dash["annotations"].get("list"), list):
        problems.append("dashboard.annotations.list must be a list")

    variables = dash["templating"].get("list")
    if not isinstance(variables, list):
        return problems + ["dashboard.templating.list must be a list"]
    problems += _variable_problems(variables)
    defined = {v.get("name") for v in variables} | BUILTIN_VARIABLES

    panels = list(_all_panels(dash["panels"]))
    ids = [p.get("id") for p in panels]
    for pid in {i for i in ids if ids.count(i) > 1}:
        problems.append(f"panel id {pid} is used more than once")
    for panel in panels:
        problems += _panel_problems(panel, defined)
    problems += _overlap_problems(dash["panels"])
    return problems


def used_variables(text: str) -> set[str]:
    return {a or b for a, b in VARIABLE_RE.findall(text)}


def _all_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        if panel.get("type") == "row":
            yield from panel.get("panels", [])


def _variable_problems(variables: list[dict]) -> list[str]:
    problems = []
    names = [v.get("name") for v in variables]
    for i, var in enumerate(variables):
        where = f"templating.list[{i}] ({var.get('name')!r})"
        if not isinstance(var.get("name"), str) or not var["name"]:
            problems.append(f"{where}: name must be a non-empty string")
        if var.get("type") not in VARIABLE_TYPES:
            problems.append(f"{where}: type must be one of {', '.join(sorted(VARIABLE_TYPES))}; "
                            f"got {var.get('type')!r}")
        if var.get("type") == "query":
            query = var.get("query")
            text = query.get("query") if isinstance(query, dict) else query
            if not isinstance(text, str) or not text:
                problems.append(f"{where}: query variables need a query string")
            if not isinstance(var.get("datasource"), dict):
                problems.append(f"{where}: query variables need a datasource object")
            if var.get("refresh") not in (1, 2):
                problems.append(f"{where}: refresh must be 1 (on load) or 2 (on time change)")
            # a variable may only refer to the ones defined before it
            earlier = set(names[:i]) | BUILTIN_VARIABLES
            for ref in used_variables(text or "") - earlier:
                problems.append(f"{where}: query uses ${ref}, not defined before it")
    for name in {n for n in names if names.count(n) > 1}:
        problems.append(f"template variable {name!r} is defined more than once")
    return problems


def _panel_problems(panel: dict, defined: set[str]) -> list[str]:
    where = f"panel {panel.get('id')!r} ({panel.get('title')!r})"
    problems = []
    if not isinstance(panel.get("id"), int):
        problems.append(f"{where}: id must be an integer")
    if panel.get("type") not in PANEL_TYPES:
        problems.append(f"{where}: type must be one of {', '.join(sorted(PANEL_TYPES))}; "
                        f"got {panel.get('type')!r}")
    if not isinstance(panel.get("title"), str) or not panel["title"]:
        problems.append(f"{where}: title must be a non-empty string")
    problems += _grid_problems(panel, where)
    if panel.get("type") == "row":
        if not isinstance(panel.get("collapsed"), bool):
            problems.append(f"{where}: rows need collapsed true/false")
        if not isinstance(panel.get("panels"), list):
            problems.append(f"{where}: rows need a panels list")
        elif panel["panels"] and not panel["collapsed"]:
            problems.append(f"{where}: an expanded row keeps its panels at the top level")
        return problems

    problems += _datasource_problems(panel.get("datasource"), where, defined)
    field_config = panel.get("fieldConfig")
    if not (isinstance(field_config, dict) and isinstance(field_config.get("defaults"), dict)
            and isinstance(field_config.get("overrides"), list)):
        problems.append(f"{where}: fieldConfig needs defaults (object) and overrides (list)")
    else:
        unit = field_config["defaults"].get("unit")
        if unit is not None and unit not in UNITS:
            problems.append(f"{where}: unit must be one of {', '.join(sorted(UNITS))}; got {unit!r}")
    if not isinstance(panel.get("options"), dict):
        problems.append(f"{where}: options must be an object")
    targets = panel.get("targets")
    if not isinstance(targets, list) or not targets:
        return problems + [f"{where}: targets must be a non-empty list"]
    ref_ids = [t.get("refId") for t in targets]
    for ref in {r for r in ref_ids if ref_ids.count(r) > 1}:
        problems.append(f"{where}: refId {ref!r} is used more than once")
    for target in targets:
        twhere = f"{where} target {target.get('refId')!r}"
        if not isinstance(target.get("refId"), str) or not target["refId"]:
            problems.append(f"{twhere}: refId must be a non-empty string")
        expr = target.get("expr")
        if not isinstance(expr, str) or not expr.strip():
            problems.append(f"{twhere}: expr must be a non-empty PromQL string")
            continue
        for ref in used_variables(expr) - defined:
            problems.append(f"{twhere}: expr uses ${ref}, which no template variable defines")
        problems += _datasource_problems(target.get("datasource"), twhere, defined)
    return problems


def _datasource_problems(datasource: object, where: str, defined: set[str]) -> list[str]:
    if not (isinstance(datasource, dict) and isinstance(datasource.get("type"), str)
            and isinstance(datasource.get("uid"), str)):
        return [f"{where}: datasource must be an object with type and uid; got {datasource!r}"]
    return [f"{where}: datasource uses ${ref}, which no template variable defines"
            for ref in used_variables(datasource["uid"]) - defined]


def _grid_problems(panel: dict, where: str) -> list[str]:
    grid = panel.get("gridPos")
    if not isinstance(grid, dict) or not all(isinstance(grid.get(k), int) for k in "hwxy"):
        return [f"{where}: gridPos needs integer h, w, x, y; got {grid!r}"]
    problems = []
    if not 1 <= grid["w"] <= GRID_COLUMNS:
        problems.append(f"{where}: gridPos.w must be 1..{GRID_COLUMNS}; got {grid['w']}")
    if not 0 <= grid["x"] < GRID_COLUMNS or grid["x"] + grid["w"] > GRID_COLUMNS:
        problems.append(f"{where}: gridPos x={grid['x']} w={grid['w']} leaves the "
                        f"{GRID_COLUMNS}-column grid")
    if grid["h"] < 1 or grid["y"] < 0:
        problems.append(f"{where}: gridPos needs h >= 1 and y >= 0; got {grid!r}")
    if panel.get("type") == "row" and (grid["h"], grid["w"], grid["x"]) != (1, GRID_COLUMNS, 0):
        problems.append(f"{where}: a row spans the grid: h=1, w={GRID_COLUMNS}, x=0")
    return problems


def _overlap_problems(top_level: list[dict]) -> list[str]:
    """Panels laid out at the top level must not cover each other."""
    boxes = [(p.get("id"), p["gridPos"]) for p in top_level
             if isinstance(p.get("gridPos"), dict)
             and all(isinstance(p["gridPos"].get(k), int) for k in "hwxy")]
    problems = []
    for i, (id_a, a) in enumerate(boxes):
        for id_b, b in boxes[i + 1:]:
            if (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                    and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]):
                problems.append(f"panels {id_a} and {id_b} overlap on the grid")
    return problems
