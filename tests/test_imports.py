"""Imports point one way: cli -> server / demo -> engine -> models -> layers -> kernels -> distributed -> core,
and lora/ (adapter files -> canonical adapters) imports nothing of moelora outside itself. Every import
counts, those under TYPE_CHECKING and inside functions too, and no two modules import each other
through any path."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moelora"
LEVELS = {"core": 0, "distributed": 1, "kernels": 2, "layers": 3, "models": 4, "engine": 5, "server": 6, "demo": 6,
          "cli": 7, "__init__": 7}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The moelora modules a file imports (a package's __init__ when it names the package)."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.split(".")[0] == "moelora"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moelora":
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            deps |= submodules or {node.module}
    return deps


def group(module: str) -> str:
    """core, distributed, kernels, layers, models, engine, server, lora, demo, cli, or __init__ for the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_every_import_points_down():
    upward = []
    for module, deps in graph().items():
        for dep in deps:
            a, b = group(module), group(dep)
            if a == b:
                continue
            if a == "lora" or (b == "lora" and LEVELS[a] < LEVELS["engine"]) or \
                    (b != "lora" and LEVELS[a] <= LEVELS[b]):
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges, state, cycles = graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(edges.get(module, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_walk_sees_the_package():
    """The test above cannot pass by reading nothing: the engine's known imports are found."""
    edges = graph()
    assert len(edges) > 40 and "moelora.core" in edges["moelora.engine.model_runner"]
    assert "moelora.engine.lora_manager" in edges["moelora.engine.model_runner"]


def test_the_server_cli_and_demo_use_the_engines_public_interface_only():
    """design.md: the server talks to the engine's public interface only, `moelora.engine`'s names (its __all__),
    not to the modules behind it; the CLI and the demo likewise."""
    import moelora.engine

    outside = []
    for module, path in modules().items():
        if group(module) not in ("server", "cli", "demo", "__init__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                outside += [f"{module}: import {a.name}" for a in node.names if a.name.startswith("moelora.engine.")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moelora.engine"):
                if node.module != "moelora.engine":
                    outside.append(f"{module}: from {node.module} import ...")
                outside += [f"{module}: {a.name} is not among moelora.engine's names" for a in node.names
                            if a.name not in moelora.engine.__all__]
    assert not outside, "imports past the engine's interface:\n" + "\n".join(outside)
    assert "moelora.engine" in graph()["moelora.server.app"]  # the walk sees the server's import of it
