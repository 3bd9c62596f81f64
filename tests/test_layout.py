"""The house's floors: every import inside the package points down (or across one floor, without a
circle), and docs/architecture.md lists every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gemma4enc"
# from the bottom: shared vocabulary, the settings, then the stages in the data's order, then the
# developer tools and the command line over them all
FLOORS = ("errors rows _version", "options", "media", "model", "output", "serving", "run", "dev", "commands")
FACES = {"gemma4enc", "gemma4enc.__main__", "gemma4enc.training", "gemma4enc.search"}  # the public names: they may reach anywhere


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every gemma4enc module `name` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from . import x` imports the module x
                out.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def _floor(name: str) -> int:
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else ""
    return next(i for i, floor in enumerate(FLOORS) if key in floor.split())


def _graph():
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_import_points_down_or_across():
    up = [f"{a} -> {b}" for a, targets in _graph().items() if a not in FACES
          for b in targets if b not in FACES and _floor(b) > _floor(a)]
    assert not up, "imports that run back up a floor:\n" + "\n".join(up)


def test_no_import_circle():
    graph = {a: {b for b in targets if b not in FACES} for a, targets in _graph().items()}
    # a subpackage's __init__ re-exporting its children is not a circle with them
    graph = {a: {b for b in targets if not a.startswith(b + ".")} for a, targets in graph.items()}
    state, circles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_top_level_holds_the_shared_vocabulary_only():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def test_architecture_lists_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(PACKAGE)}`" not in text]
    assert not missing, f"docs/architecture.md does not list: {', '.join(missing)}"


def test_the_ray_actor_stands_alone():
    """What runs on Ray's workers imports nothing of the driver's nor of the cluster's (nor the
    package's face, which imports the driver): an actor needs the pipeline, not the run around it."""
    actor = "gemma4enc.run.ray.actor"
    forbidden = {"gemma4enc.run.ray", "gemma4enc.run.ray.driver", "gemma4enc.run.ray.cluster"}
    assert not _graph()[actor] & forbidden, sorted(_graph()[actor] & forbidden)
