"""The package layout as an architecture: stages as folders, the seam at the bottom, no import circles.

Every ``import`` of a SpecFit module anywhere in a file counts, at module level or inside a function or a
``TYPE_CHECKING`` block alike: a lazy import is still a dependency.
"""

import ast
import importlib
from pathlib import Path

import pytest

import specfit

ROOT = Path(specfit.__file__).parent

# lower layers never import higher ones; modules of one layer may import each other (no circles, see below)
LAYERS = [
    {"specfit.seam", "specfit.stats", "specfit.transfer"},
    {"specfit.offload", "specfit.drafting"},
    {"specfit.selection"},
    {"specfit.decoding"},
    {"specfit.patch", "specfit.enable_checks"},
    {"specfit.evaluation", "specfit.training", "specfit.embedded", "specfit.cli", "specfit"},
]


def module_name(path: Path) -> str:
    parts = ["specfit", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """SpecFit modules that ``name`` imports, wherever in the file the import is."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `from pkg import name`: the module is pkg
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    best = None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{name} belongs to no layer of the layout"
    return best[0]


def test_every_module_belongs_to_a_layer_and_imports_alone():
    for name in MODULES:
        layer_of(name)
        importlib.import_module(name)


def test_the_seam_imports_nothing_of_specfit():
    """The seam is the ground floor: its faces (one module each) import only each other, and the package itself
    imports none of them (a caller imports the face it uses)."""
    assert GRAPH["specfit.seam"] == set()
    faces = [name for name in MODULES if name.startswith("specfit.seam.")]
    assert {"specfit.seam.layers", "specfit.seam.kv_cache", "specfit.seam.experts"} <= set(faces)
    for name in faces:
        outside = [dep for dep in GRAPH[name] if not dep.startswith("specfit.seam.")]
        assert not outside, f"{name} imports outside the seam: {outside}"


def test_the_counters_import_nothing_above_them():
    """``specfit.stats`` is a room of the ground floor: its modules import only each other, and its renderings
    (``display``) read counters duck-typed, importing nothing of ours, so ``counters -> display`` is no circle."""
    stats = [name for name in MODULES if name == "specfit.stats" or name.startswith("specfit.stats.")]
    assert "specfit.stats.counters" in stats and "specfit.stats.display" in stats
    for name in stats:
        outside = [dep for dep in GRAPH[name] if not dep.startswith("specfit.stats.")]
        assert not outside, f"{name} imports outside specfit.stats: {outside}"
    assert GRAPH["specfit.stats.display"] == set()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_dependencies_point_down(name):
    upward = [dep for dep in GRAPH[name] if layer_of(dep) > layer_of(name)]
    assert not upward, f"{name} (layer {layer_of(name)}) imports higher layers: {upward}"


def test_no_import_circles():
    """Tarjan's strongly connected components over the whole graph: every component is a single module."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_checker_sees_lazy_imports():
    """The graph includes imports inside functions (the patch wires the stages lazily nowhere, but a later edit
    might): ``patch`` is known to import the decoding strategy, and the evaluation CLI modules are known to reach
    ``patch`` from inside functions."""
    assert "specfit.decoding.strategy" in GRAPH["specfit.patch"]
    assert "specfit.patch" in GRAPH["specfit.evaluation.calibrate"]


def test_public_surface_resolves():
    for name in specfit.__all__:
        assert getattr(specfit, name) is not None
