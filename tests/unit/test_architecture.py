"""The layout of ``service/`` holds: layers as folders that say what they may import, few
modules at the root, a short import graph without circles, names that do not collide or
shadow the standard library, every module in CONTRIBUTING.md's map, and ``make layers``
failing on an import that runs up a layer."""

from __future__ import annotations

import ast
import graphlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "service"
LAYERS = ("hosting", "api", "tools", "plane", "repository", "runtime", "heads", "client", "cli")
MAX_ROOT_MODULES = 12
MAX_LEVELS = 10


def _modules() -> list[Path]:
    return sorted(path.relative_to(PACKAGE) for path in PACKAGE.rglob("*.py"))


def _layer(module: Path) -> str:
    """A module's layer: its top folder, or the shared basics at the root."""
    return module.parts[0] if len(module.parts) > 1 else "basics"


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_is_a_folder_that_says_what_it_may_import(layer: str) -> None:
    docstring = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
    assert docstring is not None
    assert re.search(r"[Mm]ay import", docstring), f"{layer}/__init__.py names no imports"


def test_few_modules_remain_at_the_root() -> None:
    at_root = [path for path in _modules() if len(path.parts) == 1]
    assert len(at_root) <= MAX_ROOT_MODULES, at_root


def test_the_import_graph_of_the_layers_is_short_and_has_no_circle() -> None:
    """Levels counted with each folder of ``service/`` as one node (as the layers are read):
    a node stands one level above the highest node it imports."""
    graph = grimp.build_graph("service")
    for layer in LAYERS:
        graph.squash_module(f"service.{layer}")
    nodes = {m for m in graph.modules if m.count(".") == 1}
    imports = {n: graph.find_modules_directly_imported_by(n) & nodes - {n} for n in nodes}
    order = list(graphlib.TopologicalSorter(imports).static_order())  # CycleError: a circle
    levels: dict[str, int] = {}
    for node in order:  # what a node imports comes before it
        levels[node] = 1 + max((levels[other] for other in imports[node]), default=0)
    assert max(levels.values()) <= MAX_LEVELS, sorted(levels.items(), key=lambda x: -x[1])


def test_no_two_layers_share_a_module_name_and_none_shadows_the_standard_library() -> None:
    """A route and its codec of one layer may share a name (``routes/native``,
    ``codec/native``); two layers may not (``repository`` the layer and a route, ``errors``
    the hierarchy and the CLI's), nor may a module take a standard library module's name."""
    layers_of: dict[str, set[str]] = {}
    for module in _modules():
        stem = module.parent.name if module.stem == "__init__" else module.stem
        if stem:
            layers_of.setdefault(stem, set()).add(_layer(module))
    shared = {stem: layers for stem, layers in layers_of.items() if len(layers) > 1}
    shared = {stem: layers for stem, layers in shared.items() if stem not in LAYERS}
    assert not shared, shared
    assert not set(layers_of) & sys.stdlib_module_names


def test_only_the_package_root_imports_the_reference_math() -> None:
    """``heads.reference`` is the tests' oracle: a serving path that computed with it would
    pass every test checked against it, right or wrong. The service computes with
    ``runtime.logmath``; ``service/__init__.py`` re-exports the two projections alone, the
    documented reference API (``from service import output_projection_tied``)."""
    importers = grimp.build_graph("service").find_modules_that_directly_import(
        "service.heads.reference"
    )
    assert importers == {"service"}, f"serving code imports the test oracle: {importers}"
    root = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    taken = {
        alias.name
        for node in ast.walk(root)
        if isinstance(node, ast.ImportFrom) and node.module == "service.heads.reference"
        for alias in node.names
    }
    assert taken == {"output_projection_tied", "output_projection_untied"}


def _map(text: str) -> set[Path]:
    """The files CONTRIBUTING.md's map names: its ``service/`` tree, two spaces a level."""
    block = text.split("\nservice/", 1)[1].split("```", 1)[0]
    named: set[Path] = set()
    folders: list[str] = []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        name = line.split()[0]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            named.add(Path(*folders, name))
    return named


def test_contributing_maps_every_module() -> None:
    named = _map((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"))
    modules = set(_modules())
    assert not modules - named, f"modules missing from CONTRIBUTING.md: {modules - named}"
    assert not named - modules, f"CONTRIBUTING.md names modules that are gone: {named - modules}"


def test_make_layers_fails_naming_an_import_that_runs_up_a_layer(tmp_path: Path) -> None:
    """``make layers`` (``lint-imports``) on a copy of the package with one planted import
    from the runtime up to the data plane: refused, the import named with its line."""
    shutil.copytree(PACKAGE, tmp_path / "service", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    planted = tmp_path / "service" / "runtime" / "gemm.py"
    planted.write_text(planted.read_text() + "\nfrom service.plane import options  # noqa\n")
    lint = Path(sys.executable).with_name("lint-imports")
    checked = subprocess.run(
        [str(lint), "--no-cache"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "service.runtime is not allowed to import service.plane" in checked.stdout
    assert "service.runtime.gemm -> service.plane.options" in checked.stdout
    assert "service/ in layers: no import up a layer BROKEN" in checked.stdout
