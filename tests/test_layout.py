"""The house's floors: every import inside the package points down (or across one floor, without a
circle), and docs/architecture.md lists every module."""

from __future__ import annotations

import ast
import re
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


def _source(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The module a `from … import` in module `name` reads from, its dots resolved."""
    if not node.level:
        return node.module or ""
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every gemma4enc module `name` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            source = _source(node, name, path)
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


# OUT's seam (output/out.py over output/backend.py): only these may reach the store layer; nothing
# above output/ knows a store exists. export.py writes an export's DEST (not OUT) to a store; a Ray
# actor uploads its task's shards through the ShardPlace it is handed (storebackend.StorePlace).
STORE_USERS = {"gemma4enc.output.storebackend", "gemma4enc.output.export"}
BACKENDS = {"gemma4enc.output.backend", "gemma4enc.output.storebackend", "gemma4enc.output.memorybackend"}


def test_only_the_seam_reaches_the_store():
    graph = _graph()
    store = [a for a, targets in graph.items() if "gemma4enc.output.store" in targets and a not in STORE_USERS]
    assert not store, f"modules that reach output/store.py past the Out seam: {store}"
    storeout = [a for a, targets in graph.items()
                if "gemma4enc.output.storebackend" in targets and a != "gemma4enc.output.opening"]
    assert not storeout, f"only output/opening.py makes a StoreBackend: {storeout}"


def _classes():
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield name, node


def test_out_is_one_class_over_a_small_backend():
    """OUT's rules are written once (review_turn5 §6.3 #1, #2, #4): no subclass of `Out`; the
    backend's abstract operations at most 12; none of OUT's own rules defined in two classes
    outside the backends (a backend's operations have names of their own; a Protocol only names)."""
    subclasses = [f"{m}.{c.name}" for m, c in _classes() if any(ast.unparse(b) == "Out" for b in c.bases)]
    assert not subclasses, f"subclasses of Out: {subclasses}"
    backend = next(c for m, c in _classes() if c.name == "OutBackend")
    abstract = [f.name for f in backend.body if isinstance(f, ast.FunctionDef)
                and any(ast.unparse(d) == "abstractmethod" for d in f.decorator_list)]
    assert 0 < len(abstract) <= 12, abstract
    rules = {"repair", "compact", "next_shard", "shard_names", "remove_shards", "holder", "clear", "prepare"}
    where: dict[str, list[str]] = {}
    for m, c in _classes():
        if m not in BACKENDS and not any(ast.unparse(b) == "Protocol" for b in c.bases):
            for f in c.body:
                if isinstance(f, ast.FunctionDef) and f.name in rules:
                    where.setdefault(f.name, []).append(f"{m}.{c.name}")
    twice = {k: v for k, v in where.items() if len(v) > 1}
    assert not twice, f"OUT's rules defined in more than one class: {twice}"


def test_no_branch_on_the_kind_of_out_outside_the_backends():
    """(§6.3 #5) Whether OUT is a store is the backend's to know: opening.py picks it, once."""
    pattern = re.compile(r"store is None|url is not None|out\.remote|self\.remote\b|isinstance\([^)]*Backend")
    found = [f"{name}:{i}" for name, path in _modules().items() if name not in BACKENDS
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line) and "ray.remote(" not in line and "self.remote.options" not in line]
    assert not found, f"branches on the kind of OUT: {found}"


def test_no_function_above_output_takes_out_as_a_bare_path():
    """Above output/, OUT travels as an `Out` (or as the user's words, a str, to open_out): never as
    a Path that each module would rebuild its own view of."""
    found = []
    for name, path in _modules().items():
        if name.startswith("gemma4enc.output"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "out" and arg.annotation is not None and "Path" in ast.unparse(arg.annotation):
                        found.append(f"{name}.{node.name}")
    assert not found, f"functions taking OUT as a Path: {found}"


def test_the_manifests_name_is_spelled_in_output_only():
    """`Path(out) / MANIFEST` and its literal belong to output/ (names.py): above it, OUT's files are
    reached through the Out."""
    found = [f"{name}" for name, path in _modules().items()
             if not name.startswith("gemma4enc.output")
             and ("/ MANIFEST" in path.read_text() or '"manifest.jsonl"' in path.read_text()
                  or "/ SETTINGS" in path.read_text())]
    assert not found, f"modules that build OUT's file paths themselves: {found}"


# Crossings allowed for now, each "importer -> module._name" (none: the `Out` step emptied it). A
# crossing not listed fails at once, and so does an entry here that no longer crosses.
PRIVATE_CROSSINGS_LEFT: set[str] = set()


def _private_crossings() -> set[str]:
    """Every underscored name one gemma4enc module takes from another: `from X import _name`, or
    `X._name` where X is a module it imported (`from . import gemma` … `gemma._name`)."""
    modules = _modules()
    found = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        bound = {}  # local name → the gemma4enc module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _source(node, name, path)
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                    elif source in modules and source != name and _private(alias.name):
                        found.add(f"{name} -> {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and bound.get(node.value.id, name) != name and _private(node.attr)):
                found.add(f"{name} -> {bound[node.value.id]}.{node.attr}")
    return found


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_private_names_stay_in_their_module():
    """A name with an underscore is its module's own: one that another module needs loses the
    underscore (or the use moves home), so what a module offers is what it shows."""
    crossings = _private_crossings()
    new = sorted(crossings - PRIVATE_CROSSINGS_LEFT)
    assert not new, "private names taken from another module:\n" + "\n".join(new)
    gone = sorted(PRIVATE_CROSSINGS_LEFT - crossings)
    assert not gone, "no longer crossing, drop from PRIVATE_CROSSINGS_LEFT:\n" + "\n".join(gone)


def test_the_ray_actor_stands_alone():
    """What runs on Ray's workers imports nothing of the driver's nor of the cluster's (nor the
    package's face, which imports the driver): an actor needs the pipeline, not the run around it."""
    actor = "gemma4enc.run.ray.actor"
    forbidden = {"gemma4enc.run.ray", "gemma4enc.run.ray.driver", "gemma4enc.run.ray.cluster"}
    assert not _graph()[actor] & forbidden, sorted(_graph()[actor] & forbidden)
