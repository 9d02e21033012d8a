"""The house's layout rules, checked on the sources: no import circles among the files of qtransform/
and bridge/ (a package's ``__init__`` importing its own submodules is fine; a submodule importing
back into something that imports it is not), the bridge uses only the public core API, the core
never imports the bridge, and no file is over 400 lines."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("qtransform", "bridge")
#: What the bridge may import from the core: the top-level API and its public subpackages.
PUBLIC_CORE = {"qtransform", "qtransform.formats", "qtransform.spec", "qtransform.tensor", "qtransform.observers",
               "qtransform.algorithms", "qtransform.pipeline", "qtransform.registry", "qtransform.testing",
               "qtransform.rotation", "qtransform.search", "qtransform.learn"}
MAX_LINES = 400


def _modules():
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Modules of the tree that ``name`` imports (``from pkg import sub`` depends on ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PACKAGES:
                found.add(t)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _resolve(t: str) -> str:
    while t and t not in MODULES:
        t = t.rpartition(".")[0]
    return t


def test_no_import_circles():
    graph = {m: {_resolve(t) for t in ts} - {m} for m, ts in GRAPH.items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_bridge_uses_only_the_public_core_api():
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("bridge")
                 for t in ts if t.startswith("qtransform") and t not in PUBLIC_CORE)
    assert bad == []


def test_the_core_never_imports_the_bridge():
    assert sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("qtransform")
                  for t in ts if t.startswith("bridge")) == []


def test_files_are_small():
    big = {str(p.relative_to(ROOT)): n for p in [*MODULES.values(), *(ROOT / "tests").rglob("*.py"),
                                                  *(ROOT / "property_tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
           if (n := p.read_text().count("\n")) > MAX_LINES}
    assert big == {}


def test_every_registry_uses_the_one_helper():
    import qtransform as qt
    import bridge.checkpoint
    import bridge.kernels
    import bridge.modules
    import bridge.tree

    registries = [qt.FORMATS, qt.OBSERVERS, qt.ALGORITHMS, qt.PRESETS, bridge.checkpoint.LAYOUTS,
                  bridge.kernels.LINEAR_KERNELS, bridge.kernels.EMBEDDING_KERNELS, bridge.kernels.CONV_KERNELS,
                  bridge.modules.QUANTIZED_CLASSES, bridge.tree.REBUILD_HOOKS]
    assert all(isinstance(r, qt.Registry) for r in registries)
