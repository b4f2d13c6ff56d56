"""Manifests: CRDs regenerate without drift; built-in kinds validate against the Kubernetes
schemas; samples validate against the generated CRD schemas; CEL rules accept the valid and
refuse the invalid samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from elastic.crds import KINDS, crd_manifest, drifted, structural

ROOT = Path(__file__).resolve().parents[2] / "manifests"
K8S_VERSION = "1.33.0"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_committed_crds_match_the_models() -> None:
    assert drifted(ROOT / "crds") == [], "run `elastic crds --out manifests/crds` and commit the result"


def test_kustomization_lists_every_manifest_and_they_exist() -> None:
    kust = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    assert all((ROOT / r).exists() for r in kust["resources"])
    crds = {f"crds/{p.name}" for p in (ROOT / "crds").glob("*.yaml")}
    assert crds <= set(kust["resources"]) and len(crds) == len(KINDS)
    samples = yaml.safe_load((ROOT / "samples" / "kustomization.yaml").read_text())
    assert all((ROOT / "samples" / r).exists() for r in samples["resources"])


BUILT_IN = ["namespace.yaml", "rbac.yaml", "configmap.yaml", "deployment.yaml", "service.yaml",
            "samples/vllm-deployment.yaml", *[f"crds/{p.name}" for p in sorted((ROOT / "crds").glob("*.yaml"))]]


@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_kinds_validate_against_kubernetes_schemas(name: str) -> None:
    for doc in _docs(ROOT / name):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_structural_conversion_table() -> None:
    cases = [
        ({"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}, {"type": "integer", "nullable": True}),
        ({"type": "integer", "exclusiveMinimum": 0}, {"type": "integer", "minimum": 0, "exclusiveMinimum": True}),
        ({"type": "object", "additionalProperties": True}, {"type": "object",
                                                            "x-kubernetes-preserve-unknown-fields": True}),
        ({"const": "Deployment", "type": "string"}, {"type": "string", "enum": ["Deployment"]}),
        ({"$ref": "#/$defs/X", "description": "outer"}, {"type": "string", "description": "outer"}),
    ]
    for given, want in cases:
        assert structural({**given, "$defs": {"X": {"type": "string", "description": "inner", "title": "X"}}}) == want


def _walk(node: Any, path: str = "") -> list[str]:
    """Paths of schema nodes that break structural rules (no type, anyOf/$ref left)."""
    bad = []
    if isinstance(node, dict):
        if any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf")):
            bad.append(path)
        if "properties" in node or "items" in node:
            if "type" not in node:
                bad.append(path)
        for k, v in node.get("properties", {}).items():
            bad += _walk(v, f"{path}.{k}")
        if "items" in node:
            bad += _walk(node["items"], f"{path}[]")
    return bad


@pytest.mark.parametrize("kind", list(KINDS))
def test_generated_schema_is_structural_and_documented(kind: str) -> None:
    crd = crd_manifest(kind)
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    spec = schema["properties"]["spec"]
    undocumented = [k for k, v in spec["properties"].items() if not v.get("description")]
    assert undocumented == [], f"{kind}: add a docstring to {undocumented}"
    assert "status" in version["subresources"]
    assert any(c["name"] == "AGE" for c in version["additionalPrinterColumns"])
    assert schema["properties"]["status"]["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_inference_service_has_a_scale_subresource() -> None:
    scale = crd_manifest("InferenceService")["spec"]["versions"][0]["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}


# ---- samples against the CRD schemas, CEL rules evaluated ------------------------------------------


def _jsonschema(node: Any) -> Any:
    """OpenAPI v3 (``nullable``, ``x-kubernetes-*``) -> JSON Schema for the ``jsonschema`` library."""
    if isinstance(node, list):
        return [_jsonschema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes") and k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if out.get("exclusiveMaximum") is True:
        out["exclusiveMaximum"] = out.pop("maximum")
    if out.get("type") == "object" and "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # the API server prunes unknown fields; a sample must not rely on it
    return out


def _defaulted(schema: dict[str, Any], obj: Any) -> Any:
    """Apply the schema's defaults the way the API server does before CEL runs (the emulator's own)."""
    from .emulator import _default

    return _default(schema, obj)


def _cel_failures(schema: dict[str, Any], obj: Any, path: str = "spec") -> list[str]:
    failures = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        ok = env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(obj)})
        if not bool(ok):
            failures.append(f"{path}: {rule['message']}")
    if isinstance(obj, dict):
        for k, sub in schema.get("properties", {}).items():
            if k in obj and obj[k] is not None:
                failures += _cel_failures(sub, obj[k], f"{path}.{k}")
    return failures


def _spec_schema(kind: str) -> dict[str, Any]:
    return crd_manifest(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


SAMPLES = ["gpupool.yaml", "vllm-inferenceservice.yaml", "elastictrainingjob.yaml"]


@pytest.mark.parametrize("name", SAMPLES)
def test_samples_validate_against_crd_schema_and_cel(name: str) -> None:
    doc = _docs(ROOT / "samples" / name)[0]
    schema = _spec_schema(doc["kind"])
    jsonschema.validate(doc, _jsonschema(schema))
    spec = _defaulted(schema["properties"]["spec"], doc["spec"])
    assert _cel_failures(schema["properties"]["spec"], spec) == []


def _sample(name: str) -> dict[str, Any]:
    return _docs(ROOT / "samples" / name)[0]


INVALID = [
    ("elastictrainingjob.yaml", {"minGPUs": 8, "maxGPUs": 2}, "spec: minGPUs must be <= maxGPUs"),
    ("elastictrainingjob.yaml", {"modelSpec": {"layers": 2}}, "spec: give exactly one of model or modelSpec"),
    ("elastictrainingjob.yaml", {"microBatch": 128}, "spec: microBatch must be <= globalBatch"),
    ("vllm-inferenceservice.yaml", {"minReplicas": 9}, "spec: minReplicas must be <= maxReplicas"),
    ("vllm-inferenceservice.yaml", {"replicas": 20}, "spec: replicas must lie within [minReplicas, maxReplicas]"),
    ("vllm-inferenceservice.yaml", {"metric": {"preset": "vllm-running", "query": "up", "target": 1}},
     "spec.metric: give exactly one of preset or query"),
]


@pytest.mark.parametrize(("name", "change", "message"), INVALID)
def test_cel_rules_refuse_invalid_specs(name: str, change: dict[str, Any], message: str) -> None:
    doc = _sample(name)
    schema = _spec_schema(doc["kind"])["properties"]["spec"]
    spec = _defaulted(schema, {**doc["spec"], **change})
    assert _cel_failures(schema, spec) == [message]


@pytest.mark.parametrize(("name", "change"), [
    ("vllm-inferenceservice.yaml", {"replicas": 3}),
    ("elastictrainingjob.yaml", {"model": None, "modelSpec": {"layers": 2, "hidden": 64, "heads": 4}}),
])
def test_cel_rules_accept_valid_variants(name: str, change: dict[str, Any]) -> None:
    doc = _sample(name)
    schema = _spec_schema(doc["kind"])["properties"]["spec"]
    spec = {k: v for k, v in _defaulted(schema, {**doc["spec"], **change}).items() if v is not None}
    assert _cel_failures(schema, spec) == []


def test_schema_refuses_a_wrong_type_and_an_unknown_field() -> None:
    doc = _sample("gpupool.yaml")
    schema = _jsonschema(_spec_schema("GPUPool"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "spec": {**doc["spec"], "gpusPerNode": "eight"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "spec": {**doc["spec"], "gpusPernode": 8}}, schema)
