"""The LLMService CRD: a valid CustomResourceDefinition whose schema and CEL rules admit the
examples and reject bad LLMServices with the right message.

The API server's admission is reproduced with real parts: structural defaults,
the openAPIV3Schema checked by jsonschema (draft 4, the dialect of OpenAPI
v3.0: boolean exclusiveMinimum), and every x-kubernetes-validations rule
evaluated by cel-python on the sub-object it is attached to.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
from kvfleet_operator.spec import parse_spec
from kvfleet_operator.status import CONDITION_TYPES
from operator_harness import (
    BAD_SPECS,
    EXAMPLES,
    BadSpec,
    example_docs,
    load_crd,
    minimal_llmservice,
)

KUBERNETES_VERSION = "1.37.0"
CRD = load_crd()
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
CEL = celpy.Environment()


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting: a missing field with a `default` gets it, inside objects that exist."""
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(sub, obj[key])
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            apply_defaults(schema["items"], item)
    return obj


def cel_rules(schema: dict[str, Any], obj: Any, path: str = "") -> Iterator[tuple[str, dict, Any]]:
    """(path, rule, self) for every x-kubernetes-validations rule that applies to `obj`."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, obj
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                yield from cel_rules(sub, obj[key], f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            yield from cel_rules(schema["items"], item, f"{path}[{i}]")


def admit(obj: dict[str, Any]) -> list[str]:
    """The messages the API server would answer a create with; [] means admitted."""
    obj = apply_defaults(SCHEMA, copy.deepcopy(obj))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft4Validator(SCHEMA).iter_errors(obj)]
    for path, rule, self_ in cel_rules(SCHEMA, obj):
        program = CEL.program(CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(self_)})
        if not isinstance(result, celpy.celtypes.BoolType):
            # A rule that errs (e.g. reads a missing field) rejects the object, as in the API server.
            errors.append(f"{path}: rule {rule['rule']!r} failed to evaluate: {result}")
        elif not result:
            errors.append(f"{path}: {rule['message']}")
    return errors


def test_crd_is_a_valid_customresourcedefinition():
    kubernetes_validate.validate(CRD, KUBERNETES_VERSION, strict=True)
    assert CRD["spec"]["names"]["shortNames"] == ["llms"]
    assert (CRD["spec"]["group"], VERSION["name"], CRD["spec"]["names"]["kind"]) == \
        ("kvfleet.io", "v1alpha1", "LLMService")


def test_every_cel_rule_compiles_and_has_a_message():
    rules = [rule for _, rule, _ in cel_rules(SCHEMA, apply_defaults(SCHEMA, {
        "spec": {"model": {"uri": "s3://b/m"}, "autoscaling": {}, "cache": {}, "engine": {},
                 "adapters": []}}))]
    assert len(rules) == 11
    for rule in rules:
        CEL.compile(rule["rule"])
        assert rule["message"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_admitted(path):
    docs = example_docs(path)
    assert any(doc["kind"] == "LLMService" for doc in docs)
    for doc in docs:
        if doc["kind"] == "LLMService":
            assert admit(doc) == []
            parse_spec(doc)  # and the operator accepts it
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("bad", BAD_SPECS, ids=lambda b: b.id)
def test_bad_llmservices_are_rejected_with_the_right_message(bad: BadSpec):
    errors = admit(bad.body())
    assert errors, f"{bad.id} was admitted"
    assert any(bad.crd_error in error for error in errors), errors


def test_pull_globs_are_admitted_for_a_pulled_model_and_empty_lists_anywhere():
    globs = {"include": ["*.safetensors", "*.json", "tokenizer*"], "exclude": ["original/*"]}
    for uri in ("hf://meta-llama/Llama-3.1-8B-Instruct", "s3://models/llama"):
        assert admit(minimal_llmservice(model={"uri": uri, **globs})) == []
    # an empty list asks for nothing, so it passes on a model that is not pulled (as in spec.py)
    empty = minimal_llmservice(model={"uri": "pvc://weights/llama", "include": [], "exclude": []})
    assert admit(empty) == []
    assert parse_spec(empty).model.include == ()
    assert admit(minimal_llmservice(model={"uri": "s3://m/l", "include": ["*"] * 65})) != []


def test_status_and_scale_subresources_point_at_schema_fields():
    subresources = VERSION["subresources"]
    assert subresources["status"] == {}
    status = SCHEMA["properties"]["status"]["properties"]
    scale = subresources["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert SCHEMA["properties"]["spec"]["properties"]["replicas"]["type"] == "integer"
    assert status[scale["statusReplicasPath"].removeprefix(".status.")]["type"] == "integer"
    assert status[scale["labelSelectorPath"].removeprefix(".status.")]["type"] == "string"
    conditions = status["conditions"]["items"]["properties"]["type"]["enum"]
    assert conditions == list(CONDITION_TYPES) == ["Ready", "ModelReady", "Progressing", "Degraded"]


def test_printer_columns_show_model_quantization_replicas_ready_url_age():
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Quantization", "Replicas", "Ready", "URL", "Age"]
    for name, json_path in columns.items():
        if name == "Age":
            assert json_path == ".metadata.creationTimestamp"
            continue
        node = SCHEMA
        for part in re.findall(r"\.(\w+)", json_path):
            node = node["properties"][part]  # KeyError: a column shows a field that does not exist
        assert node["type"] in ("string", "integer")
