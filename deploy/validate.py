"""Validate every manifest under deploy/ offline, against schemas from maintained packages.

* Kubernetes objects: ``kubernetes-validate``'s strict JSON schemas (the Kubernetes OpenAPI
  of each release, unknown fields refused), for the oldest and newest release it bundles that
  lmhead documents.
* KServe objects: the models of the ``kserve`` SDK, generated from KServe's CRD schemas, and
  the ``kubernetes`` client's models for the core types inside (containers, probes...). Every
  object is rebuilt through them: an unknown field, a wrong type or a missing required field
  fails. The SDK's package ``__init__`` starts a model server (and pins a Starlette this
  project does not use), so only its ``models`` are imported.

Run by ``make deploy-check`` in its own virtual environment (CI: ``.ci/run``):

    python deploy/validate.py deploy/kubernetes/*.yaml deploy/kserve/*.yaml
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

KUBERNETES_RELEASES = ("1.30.0", "1.37.0")
KSERVE_KINDS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}
PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
}


def kserve_models() -> tuple[types.ModuleType, types.ModuleType]:
    """``kserve.models`` without running ``kserve/__init__.py``; ``kubernetes.client.models``."""
    spec = importlib.util.find_spec("kserve")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the kserve SDK is not installed (make deploy-check installs it)")
    package = types.ModuleType("kserve")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["kserve"] = package
    import kserve.models as kserve
    import kubernetes.client.models as core

    return kserve, core


def build(value: Any, kind: str, where: str, models: tuple[types.ModuleType, ...]) -> Any:
    """``value`` rebuilt as the SDK type named ``kind``; raises ValueError with ``where``."""
    if kind in PRIMITIVES:
        if not isinstance(value, PRIMITIVES[kind]) or (kind == "int" and isinstance(value, bool)):
            raise ValueError(f"{where}: expected {kind}, got {type(value).__name__}")
        return value
    if match := re.fullmatch(r"[lL]ist\[(.+)\]", kind):
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        return [build(item, match[1], f"{where}[{i}]", models) for i, item in enumerate(value)]
    if match := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", kind):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping")
        inner = match[1] or match[2]
        return {key: build(item, inner, f"{where}.{key}", models) for key, item in value.items()}
    return _build_object(value, kind, where, models)


def _build_object(value: Any, kind: str, where: str, models: tuple[types.ModuleType, ...]) -> Any:
    """An SDK model from a mapping: every key must be one of its fields."""
    cls = next((getattr(m, kind) for m in models if hasattr(m, kind)), None)
    if cls is None:
        raise ValueError(f"{where}: the SDK has no type {kind}")
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a {kind} mapping")
    by_json = {json_name: attribute for attribute, json_name in cls.attribute_map.items()}
    unknown = sorted(set(value) - set(by_json))
    if unknown:
        raise ValueError(f"{where}: {kind} has no field(s) {unknown}")
    arguments = {
        by_json[key]: build(item, cls.openapi_types[by_json[key]], f"{where}.{key}", models)
        for key, item in value.items()
    }
    try:
        return cls(**arguments)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def validate(path: Path, models: tuple[types.ModuleType, ...]) -> list[str]:
    """Problems with the documents of one file (empty when all are valid)."""
    documents = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    return validate_documents(str(path), documents, models)


def validate_documents(
    name: str, documents: list[dict[str, Any]], models: tuple[types.ModuleType, ...]
) -> list[str]:
    problems = []
    for index, document in enumerate(documents):
        where = f"{name}#{index} {document.get('kind')}/{document['metadata']['name']}"
        key = (document.get("apiVersion"), document.get("kind"))
        try:
            if key in KSERVE_KINDS:
                build(document, KSERVE_KINDS[key], where, models)
            else:
                for release in KUBERNETES_RELEASES:
                    kubernetes_validate.validate(document, release, strict=True)
        except (ValueError, kubernetes_validate.ValidationError) as error:
            text = str(getattr(error, "message", error))
            problems.append(text if text.startswith(where) else f"{where}: {text}")
    return problems


def self_test(paths: list[str], models: tuple[types.ModuleType, ...]) -> list[str]:
    """Each document with one misspelt field must be refused: the check can fail."""
    missed = []
    for path in paths:
        for index, document in enumerate(yaml.safe_load_all(Path(path).read_text())):
            broken = dict(document, spec=dict(document["spec"], replicaz=1))
            if not validate_documents(path, [broken], models):
                missed.append(f"{path}#{index}: a misspelt spec field was accepted")
    return missed


def main(paths: list[str]) -> int:
    models = kserve_models()
    problems = [problem for path in paths for problem in validate(Path(path), models)]
    problems += self_test(paths, models)
    for problem in problems:
        print(f"invalid: {problem}")
    checked = ", ".join(paths)
    print(f"deploy: {len(paths)} files checked ({checked}): {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
