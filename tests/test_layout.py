"""The package layout keeps its floors, read top-down: the tools (`batchspec_tools`: the CLI,
the benchmark, draft training) drive the three processes (`coordinator`, `draft_service`,
`target_service`), which stand on what every process shares (`batchspec`, with the model
runtime in `batchspec.runtime`). Nothing imports a floor above its own, there is no import
cycle, and the coordinator and the shared basics never reach the torch runtime. Imports inside
functions count too: a lazy import is still a dependency."""
import ast
import importlib.metadata
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = ("batchspec", "batchspec_tools", "coordinator", "draft_service", "target_service")
SUBPACKAGES = {"batchspec": ("runtime",), "batchspec_tools": ("drafting", "bench", "data")}
SHARED = ("batchspec", "batchspec.runtime")
PROCESSES = ("coordinator", "draft_service", "target_service")

# What each package may import (besides itself). Anything else is a layering error.
ALLOWED = {
    # the shared floor: errors, params, server, security, metrics, ...; the model runtime
    "batchspec": set(),
    "batchspec.runtime": {"batchspec"},
    # the processes
    "coordinator": {"batchspec"},
    # a target may host a draft: its DraftService, served beside it
    "target_service": {"batchspec", "batchspec.runtime", "draft_service"},
    "draft_service": {"batchspec", "batchspec.runtime"},
    # the tools
    "batchspec_tools.data": set(),
    "batchspec_tools": {"batchspec", "batchspec.runtime", "coordinator"},
    "batchspec_tools.drafting": {"batchspec", "batchspec_tools.data", "batchspec.runtime"},
    "batchspec_tools.bench": {"batchspec", "batchspec_tools", "batchspec_tools.data",
                              "batchspec.runtime", *PROCESSES},
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for top in FIRST_PARTY:
        for path in (ROOT / top).rglob("*.py"):
            if "v1" not in path.relative_to(ROOT).parts:
                found[module_name(path)] = path
    return found


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """First-party modules `path` imports, resolved to the modules that exist."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` depends on mod (and pkg's __init__, which for every package
            # here is a docstring or imports only within its own package)
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name.split(".")[0] in FIRST_PARTY and not name.startswith("batchspec.v1"):
                # `from pkg import mod` names a module; `from mod import thing` names mod
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in known:
                    out.add(name)
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in SUBPACKAGES.get(parts[0], ()):
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, set(found)) - {name} for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_real_imports():
    edges = graph()
    assert "batchspec.runtime.runner" in edges["target_service.verifier"]
    assert "batchspec.errors" in edges["coordinator.engine"]
    # a package's __init__ importing itself is not an edge, and the cycle finder finds cycles
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back():
    assert find_cycle(graph()) is None


def test_the_shared_floor_imports_no_process_and_no_tool():
    upward = [f"{module} -> {target}" for module, targets in graph().items()
              if package_of(module) in SHARED for target in targets
              if package_of(target) not in SHARED]
    assert not upward, upward


def test_packages_keep_their_layers():
    wrong = []
    for module, targets in graph().items():
        source = package_of(module)
        for target in targets:
            if package_of(target) != source and package_of(target) not in ALLOWED[source]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def top_level_imports(nodes) -> set[str]:
    """The top-level package of every absolute import among `nodes` (AST nodes)."""
    roots = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def imported_anywhere(path: pathlib.Path) -> set[str]:
    return top_level_imports(ast.walk(ast.parse(path.read_text())))


@pytest.mark.parametrize("package", ["coordinator", "batchspec"])
def test_torch_free_packages_never_import_torch(package):
    third_party = {"torch", "transformers", "safetensors", "numpy"}
    for name, path in modules().items():
        if package_of(name) == package:
            found = imported_anywhere(path) & third_party
            assert not found, f"{name} imports {found}"


def requirement_names(path: pathlib.Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line)[0].lower().replace("_", "-"))
    return names


def test_the_coordinator_requirement_set_covers_its_imports_and_holds_no_torch():
    """requirements/coordinator.txt installs the coordinator alone: every third-party module
    that the coordinator, the shared basics, the generated code and the CLI's entry modules
    import at all is provided by a distribution it lists, and it lists no model runtime."""
    listed = requirement_names(ROOT / "requirements" / "coordinator.txt")
    assert not listed & {"torch", "transformers", "numpy", "safetensors", "accelerate"}
    paths = [*(ROOT / "coordinator").rglob("*.py"), *(ROOT / "batchspec" / "v1").rglob("*.py"),
             *(ROOT / "batchspec").glob("*.py")]
    used = set().union(*map(imported_anywhere, paths))
    # the CLI's entry modules: only what they import at module level (its commands import
    # the runtime lazily, and `batchspec coordinator` never reaches those)
    for entry in ("__init__.py", "cli.py", "processes.py"):
        used |= top_level_imports(ast.parse((ROOT / "batchspec_tools" / entry).read_text()).body)
    third_party = used - set(sys.stdlib_module_names) - set(FIRST_PARTY)
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(third_party):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        if not dists & listed:
            missing[module] = sorted(dists)
    assert third_party and not missing, missing


def test_coordinator_classes_and_functions_stay_small():
    """The coordinator is read by newcomers: no class over 300 lines, no function over 50."""
    too_long = []
    for path in (ROOT / "coordinator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = 300 if isinstance(node, ast.ClassDef) else 50
                if node.end_lineno - node.lineno + 1 > limit:
                    too_long.append(f"{path.name}:{node.name}")
    assert not too_long, too_long
