"""The package's layout rules (docs/architecture.md, "Layout rules"), read from the code's imports.

An AST scan of every module of ``cubefs_fuse`` and ``cube_torch``: no import cycle, each
third-party library with a single owner, and every import pointing down the flow
(kernel → fs → cache → backends; cube_torch → control → prefetch → cache).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("cubefs_fuse", "cube_torch")

# Where each third-party library may be imported (module names, or folders ending in ".").
OWNERS: dict[str, tuple[str, ...]] = {
    "prometheus_client": ("cubefs_fuse.metrics",),
    "h11": ("cubefs_fuse.control.",),
    "torch": ("cube_torch.",),
    "torchvision": ("cube_torch.",),
    "redis": ("cube_torch.samples.redis_store",),  # the processed-sample cache's Redis stores
    # The S3 backend's clients (benchmarks/results/2026-11-29-s3-client.md).
    "obstore": ("cubefs_fuse.backends.s3",),
    "boto3": ("cubefs_fuse.backends.s3",),
    "botocore": ("cubefs_fuse.backends.s3",),
}

# The floors of cubefs_fuse: a module imports only from floors below its own (or its own room).
FLOORS: dict[str, int] = {
    "cubefs_fuse": 0,  # the package face: __version__
    "cubefs_fuse.attrs": 0, "cubefs_fuse.errors": 0, "cubefs_fuse.limits": 0, "cubefs_fuse.stats": 0,
    "cubefs_fuse.sdnotify": 0,
    "cubefs_fuse.config": 1, "cubefs_fuse.mounts": 1, "cubefs_fuse.backends": 1,
    "cubefs_fuse.cache": 2, "cubefs_fuse.sources": 2,
    "cubefs_fuse.fs": 3,
    "cubefs_fuse.prefetch": 4, "cubefs_fuse.samples": 4,
    "cubefs_fuse.control": 5, "cubefs_fuse.metrics": 5,
    "cubefs_fuse.daemon": 6, "cubefs_fuse.opscli": 6,
    "cubefs_fuse.cli": 7, "cubefs_fuse.__main__": 8,
}
# The C extension modules (no .py file) and the modules that may import each: the FUSE
# session is wrapped by fs/session.py alone.
NATIVE: dict[str, tuple[str, ...]] = {
    "cubefs_fuse.fs._session": ("cubefs_fuse.fs.session",),
}
# What cube_torch (inside training processes) may take from the daemon's package.
CUBE_TORCH_MAY_IMPORT = ("cubefs_fuse.control.protocol",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, *, package: bool = False, modules: frozenset[str] = frozenset()) -> set[str]:
    """Every module that ``source`` imports, at any depth of the code (absolute names).

    ``from pkg import sub`` names ``pkg.sub`` when that is one of ``modules``, else ``pkg``.
    """
    here = module.split(".") if package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[: len(here) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> every name it imports (own modules and third-party ones)."""
    paths = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = frozenset(module_name(p) for p in paths) | frozenset(NATIVE)
    return {module_name(p): imports_of(p.read_text(), module_name(p), package=p.name == "__init__.py", modules=modules)
            for p in paths}


def floor_of(module: str) -> tuple[str, int] | None:
    for prefix in sorted(FLOORS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, FLOORS[prefix]
    return None


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every broken rule, one line each."""
    problems: list[str] = []
    modules = set(edges)
    for module, imported in sorted(edges.items()):
        for name in sorted(imported):
            top = name.split(".")[0]
            owners = OWNERS.get(top)
            if owners and not any(module == o or module.startswith(o) for o in owners):
                problems.append(f"{module} imports {top}, which only {', '.join(owners)} may import")
            if name in NATIVE and module not in NATIVE[name]:
                problems.append(f"{module} imports {name}, which only {', '.join(NATIVE[name])} may import")
            if name not in modules:
                continue
            if module.startswith("cube_torch") and name.startswith("cubefs_fuse") and name not in CUBE_TORCH_MAY_IMPORT:
                problems.append(f"{module} imports {name}: cube_torch may use only {', '.join(CUBE_TORCH_MAY_IMPORT)}")
            mine, theirs = floor_of(module), floor_of(name)
            if mine is None or theirs is None or mine[0] == theirs[0]:
                continue
            if theirs[1] >= mine[1]:
                problems.append(f"{module} (floor {mine[1]}) imports {name} (floor {theirs[1]}): against the flow")
    if (found := cycle({m: {i for i in imported if i in modules} for m, imported in edges.items()})):
        problems.append("import cycle: " + " -> ".join(found))
    return problems


def test_every_module_has_a_floor() -> None:
    missing = [m for m in graph() if m.startswith("cubefs_fuse") and floor_of(m) is None]
    assert missing == [], f"give these modules a floor in FLOORS: {missing}"


def test_the_package_keeps_its_layout_rules() -> None:
    assert violations(graph()) == []


@pytest.mark.parametrize(("edges", "expected"), [
    ({"cubefs_fuse.cache.disk": {"cubefs_fuse.fs.filesystem"}, "cubefs_fuse.fs.filesystem": set()},
     "against the flow"),
    ({"cubefs_fuse.daemon": {"cubefs_fuse.fs._session"}}, "only cubefs_fuse.fs.session"),
    ({"cubefs_fuse.fs.filesystem": {"prometheus_client"}}, "only cubefs_fuse.metrics"),
    ({"cubefs_fuse.prefetch.service": {"h11"}}, "only cubefs_fuse.control."),
    ({"cubefs_fuse.config": {"torch"}}, "only cube_torch."),
    ({"cube_torch.patch": {"cube_torch.reporter"}, "cube_torch.reporter": {"cube_torch.patch"}}, "import cycle"),
    ({"cube_torch.client": {"cubefs_fuse.fs.filesystem"}, "cubefs_fuse.fs.filesystem": set()}, "cube_torch may use only"),
])
def test_the_checker_sees_each_kind_of_break(edges: dict[str, set[str]], expected: str) -> None:
    found = violations(edges)
    assert any(expected in line for line in found), found


def test_function_level_and_relative_imports_are_read() -> None:
    source = "def f():\n    import trio\n    from . import sibling\n    from .keys import block_key\n"
    found = imports_of(source, "cubefs_fuse.cache.disk", modules=frozenset({"cubefs_fuse.cache.sibling"}))
    assert found == {"trio", "cubefs_fuse.cache.sibling", "cubefs_fuse.cache.keys"}


def test_the_cube_torch_distribution_ships_what_cube_torch_imports() -> None:
    """distributions/cube-torch links the modules of cubefs_fuse that cube_torch imports,
    at any depth, with their packages: no fewer (an ImportError in a training image), no
    more (native code, a compiler)."""
    edges = graph()
    needed: set[str] = set()
    todo = [name for module, imported in edges.items() if module.startswith("cube_torch")
            for name in imported if name.startswith("cubefs_fuse.")]
    while todo:
        module = todo.pop()
        if module in needed or module not in edges:
            continue
        needed.add(module)
        todo.extend(name for name in edges[module] if name.startswith("cubefs_fuse"))
    packages = {".".join(m.split(".")[:i]) for m in needed for i in range(1, len(m.split(".")))}
    expected = sorted({*needed, *packages})
    dist = REPO / "distributions" / "cube-torch"
    linked = sorted(module_name(dist / p.relative_to(dist)).removeprefix("distributions.cube-torch.")
                    for p in (dist / "cubefs_fuse").rglob("*.py"))
    assert linked == expected
    for path in (dist / "cubefs_fuse").rglob("*"):
        if path.is_symlink():
            assert path.resolve() == REPO / path.relative_to(dist), f"{path} links elsewhere"
    assert (dist / "cube_torch").resolve() == REPO / "cube_torch"
