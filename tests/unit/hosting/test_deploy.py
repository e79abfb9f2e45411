"""The deploy/ manifests agree with the image and the service they run.

Schemas are checked by ``make deploy-check`` (deploy/validate.py, its own environment); this
checks what no schema knows: every ``LMHEAD_*`` variable is a setting with a valid value,
ports, paths and user match the Dockerfile and the settings, probes hit real endpoints,
KServe's arguments parse as ``lmhead serve`` arguments, and memory limits cover the models
plus what requests may hold (``worst_case_extra_bytes``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.budget import worst_case_extra_bytes
from service.cli.parser import build_parser
from service.hosting.app import create_app
from service.settings import PlaceSettings, Settings

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")
#: The demo repository in one server, measured (README, deploy/kubernetes/lmhead.yaml).
DEMO_RESIDENT_BYTES = 342 * 10**6
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _documents(pattern: str) -> list[dict[str, Any]]:
    paths = sorted(ROOT.glob(pattern))
    assert paths, pattern
    return [doc for path in paths for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))]


def _containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(kind, pod-level spec, container) for every lmhead container in deploy/."""
    found = []
    for doc in _documents("deploy/kubernetes/*.yaml"):
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            found += [(doc["kind"], pod, container) for container in pod["containers"]]
    for doc in _documents("deploy/kserve/*.yaml"):
        if doc["kind"] == "ServingRuntime":
            found += [(doc["kind"], doc["spec"], c) for c in doc["spec"]["containers"]]
    return found


def _settings(container: dict[str, Any]) -> Settings:
    """The settings the container runs with: its env, then its `lmhead serve` arguments."""
    values = {
        item["name"].removeprefix("LMHEAD_").lower(): _value(item, container)
        for item in container.get("env", [])
    }
    args = container.get("args")
    if args:
        assert args[:2] == ["lmhead", "serve"], args
        parsed = build_parser(PlaceSettings()).parse_args(args[1:])
        flags = {"repository": parsed.repository, "port": parsed.port}
        values |= {key: value for key, value in flags.items() if value is not None}
        values["model_name"] = parsed.model_name
    return Settings.model_validate(values)


def _value(item: dict[str, Any], container: dict[str, Any]) -> str:
    """An env item's value; the downward API's ``requests.cpu`` as the container asks it."""
    if "value" in item:
        return str(item["value"])
    field = item["valueFrom"]["resourceFieldRef"]
    assert field == {"resource": "requests.cpu", "divisor": "1"}, item
    return str(container["resources"]["requests"]["cpu"])


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * UNITS[unit]


@pytest.mark.parametrize("entry", _containers(), ids=lambda e: f"{e[0]}-{e[2]['name']}")
def test_each_container_runs_valid_settings_on_its_declared_port(
    entry: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    kind, pod, container = entry
    for item in container.get("env", []):
        assert item["name"].startswith("LMHEAD_")
        assert item["name"].removeprefix("LMHEAD_").lower() in Settings.model_fields, item
    settings = _settings(container)
    assert [p["containerPort"] for p in container["ports"]] == [settings.port]
    assert settings.host == "0.0.0.0"
    mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}
    expected = "/mnt/models" if kind == "ServingRuntime" else "/models"
    assert str(settings.repository) == expected
    assert kind == "ServingRuntime" or expected in mounted
    if kind == "ServingRuntime":
        assert settings.model_name == "{{.Name}}"  # KServe's template for the service name
        assert not settings.create_demo_models
    user = pod.get("securityContext", {}).get("runAsUser")
    assert user in (None, 10001)
    assert "USER 10001:10001" in DOCKERFILE


@pytest.mark.parametrize("entry", _containers(), ids=lambda e: f"{e[0]}-{e[2]['name']}")
def test_images_probes_and_memory_match_the_service(
    entry: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    _, _, container = entry
    image = container["image"]
    assert image in ("lmhead:latest", "lmhead:gpu")
    assert (" AS gpu" if image.endswith("gpu") else " AS cpu") in DOCKERFILE
    assert "EXPOSE 8000" in DOCKERFILE
    settings = _settings(container)
    paths = set(create_app(settings).openapi()["paths"])
    port_names = {p.get("name") for p in container["ports"]} | {settings.port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in container:
            target = container[probe]["httpGet"]
            assert target["path"] in paths, (probe, target)
            assert target["port"] in port_names, (probe, target)
    limit = _bytes(container["resources"]["limits"]["memory"])
    assert limit >= DEMO_RESIDENT_BYTES + worst_case_extra_bytes(settings), container["name"]
    assert _bytes(container["resources"]["requests"]["memory"]) >= DEMO_RESIDENT_BYTES


def _deployments() -> list[dict[str, Any]]:
    return [d for d in _documents("deploy/kubernetes/*.yaml") if d["kind"] == "Deployment"]


@pytest.mark.parametrize("deployment", _deployments(), ids=lambda d: d["metadata"]["name"])
def test_pods_are_hardened_and_stop_without_refusing_connections(
    deployment: dict[str, Any],
) -> None:
    """A read-only root needs a writable scratch directory (start-up hung "still loading"
    without one); a stop first leaves the endpoints, then drains within the grace period;
    probes wait longer than a loaded pod takes to answer (over 0.6 s measured)."""
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    settings = _settings(container)
    assert settings.scratch_dir is not None
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert str(settings.scratch_dir) in writable
    assert settings.intra_op_threads == int(container["resources"]["requests"]["cpu"])
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pause + settings.drain_timeout_s + 5
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["timeoutSeconds"] >= 2, probe


def test_services_and_autoscalers_point_at_the_deployment() -> None:
    manifests = _documents("deploy/kubernetes/*.yaml") + _documents("deploy/kserve/*.yaml")
    documents = {(d["kind"], d["metadata"]["name"]): d for d in manifests}
    deployment = documents[("Deployment", "lmhead")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = documents[("Service", "lmhead")]["spec"]
    assert service["selector"].items() <= labels.items()
    assert service["ports"][0]["targetPort"] == "http"
    deployments = _deployments()
    for one in deployments:  # no Deployment's selector takes another's pods (nor its HPA)
        for other in deployments:
            selector = one["spec"]["selector"]["matchLabels"].items()
            pods = other["spec"]["template"]["metadata"]["labels"].items()
            assert (selector <= pods) == (one is other), (one["metadata"], other["metadata"])
    gpu = documents[("Service", "lmhead-gpu")]["spec"]["selector"].items()
    assert (
        gpu
        <= documents[("Deployment", "lmhead-gpu")]["spec"]["template"]["metadata"]["labels"].items()
    )
    assert not service["selector"].items() <= gpu
    target = documents[("HorizontalPodAutoscaler", "lmhead")]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "lmhead")
    claims = {
        volume["persistentVolumeClaim"]["claimName"]
        for doc in documents.values()
        if doc["kind"] == "Deployment"
        for volume in doc["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in volume
    }
    assert claims == {documents[("PersistentVolumeClaim", "lmhead-models")]["metadata"]["name"]}
    isvc = documents[("InferenceService", "demo-tied")]["spec"]["predictor"]["model"]
    runtime = documents[("ServingRuntime", isvc["runtime"])]["spec"]
    assert isvc["modelFormat"]["name"] in {f["name"] for f in runtime["supportedModelFormats"]}
    assert isvc["protocolVersion"] in runtime["protocolVersions"]
    assert isvc["storageUri"] == "pvc://lmhead-models/"
