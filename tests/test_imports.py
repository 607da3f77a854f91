"""The import rules of docs/design.md ("Which package may import which"), read from the source.

Every `import` statement of every module counts, a lazy one inside a function included: a lazy
import is still a dependency, only a later one. Two checks import for real (in a fresh interpreter)
to catch what a chain of allowed imports pulls in.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("workflow_r1", "rlmopt", "configs")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The modules of ours that `name` imports (a `from pkg import sub` counts as pkg.sub when sub is
    a module); imports under `if TYPE_CHECKING:` are left out (they never run)."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import workflow_r1.rl.losses as b` names a module; a.b.attr does not
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _violations(importer: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if _under(m, importer) for t in targets
                  if any(_under(t, f) for f in forbidden) and not any(_under(t, a) for a in allowed))


RULES = {
    "rl imports none of rollout, task, executor, sampler": (
        "workflow_r1.rl", ("workflow_r1.rollout", "workflow_r1.task", "workflow_r1.executor", "workflow_r1.sampler"),
        ()),
    "the task package imports no other package of ours": (
        "workflow_r1.task", ("workflow_r1.rl", "workflow_r1.rollout", "workflow_r1.sampler", "workflow_r1.executor",
                            "workflow_r1.model", "workflow_r1.trainer"), ()),
    "rollout imports no rl: the trajectory contract is on the ground floor": (
        "workflow_r1.rollout", ("workflow_r1.rl",), ()),
    "the trajectory contract imports only sharding": (
        "workflow_r1.trajectory", tuple(m for m in MODULES if m.startswith("workflow_r1.")),
        ("workflow_r1.sharding",)),
    "rollout imports no environment and no executor: the environment is passed in": (
        "workflow_r1.rollout", ("workflow_r1.envs", "workflow_r1.executor"), ()),
    "the environments import neither rl nor the trainer": (
        "workflow_r1.envs", ("workflow_r1.rl", "workflow_r1.trainer", "workflow_r1.ablation"), ()),
    "model does not import assets": ("workflow_r1.model", ("workflow_r1.assets",), ()),
    "eval does not import rl": ("workflow_r1.eval", ("workflow_r1.rl",), ()),
    "evaluate restores parameters without the optimizer": ("workflow_r1.evaluate", ("workflow_r1.rl",), ()),
    "configs do not import the trainer": ("configs", ("workflow_r1.trainer", "workflow_r1.train"), ()),
    "rlmopt imports neither rl nor the trainer": ("rlmopt", ("workflow_r1.rl", "workflow_r1.trainer"), ()),
    "the rollout pipeline knows the engine and the learner only through the trainer's callbacks": (
        "workflow_r1.pipeline", ("workflow_r1.rl", "workflow_r1.rollout", "workflow_r1.sampler",
                                 "workflow_r1.trainer"), ()),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_import_rule(rule):
    importer, forbidden, allowed = RULES[rule]
    assert any(_under(m, importer) for m in MODULES), f"no module under {importer}: the rule checks nothing"
    bad = _violations(importer, forbidden, allowed)
    assert not bad, f"{rule}: " + "; ".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
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
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_ablation_is_a_top_floor():
    """The ablation (the grid and the report) runs the trainer; nothing below imports it back."""
    bad = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() if not _under(m, "workflow_r1.ablation")
                 for t in targets if _under(t, "workflow_r1.ablation"))
    assert not bad, "upward imports of the ablation: " + "; ".join(bad)


def test_no_import_cycles():
    assert not _cycles(), "import cycles: " + "; ".join(" <-> ".join(c) for c in _cycles())


def test_the_graph_sees_lazy_and_relative_imports():
    # Lazy (inside a function) and package-level imports are edges: a rule cannot be dodged by moving
    # an import into a function.
    assert "workflow_r1.data.tfds_source" in GRAPH["workflow_r1.data.config"]
    assert "workflow_r1.trajectory" in GRAPH["workflow_r1.rollout.packing"]
    assert "workflow_r1.trainer" in GRAPH["workflow_r1.train"]


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _private_uses(name: str, path: pathlib.Path) -> list[tuple[str, str]]:
    """(module, name) for each `_name` of another module of ours that `name` reads: `mod._name`
    through an imported module, or `from mod import _name` (dunders are not private)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    out = []
    private = lambda attr: attr.startswith("_") and not attr.startswith("__")  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                elif node.module in MODULES and private(a.name):
                    out.append((node.module, a.name))
    out += [(aliases[node.value.id], node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and private(node.attr)]
    return out


def test_no_private_name_is_used_across_packages():
    """What another package needs of a module is public: a `_name` read from outside its package is
    a seam that a refactor of that package breaks without knowing it."""
    bad = sorted(f"{m} uses {t}.{attr}" for m, p in MODULES.items() for t, attr in _private_uses(m, p)
                 if _package(t) != _package(m))
    assert not bad, "private names used across packages: " + "; ".join(bad)


def _flags_defined(path: pathlib.Path) -> set[str]:
    """The absl flags importing `path` defines: its module-level `*.DEFINE_*("name", ...)` calls."""
    names = set()
    for stmt in ast.parse(path.read_text(), str(path)).body:
        value = getattr(stmt, "value", None)
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr.startswith("DEFINE_") and value.args
                and isinstance(value.args[0], ast.Constant)):
            names.add(value.args[0].value)
    return names


FLAGS = {m: f for m, p in MODULES.items() if (f := _flags_defined(p))}
TESTS = {f"tests.{p.stem}": p for p in sorted((ROOT / "tests").glob("*.py"))}


def test_a_test_session_defines_no_flag_twice():
    """Every test runs in one process, which imports what every test module imports (transitively).
    Two programs in there defining the same absl flag (`--config`) fail the session with
    DuplicateFlagError, in whichever test imports the second; so what a program shares lives in a
    module without flags (`eval.job`, `aot/__init__`), and imported programs' flags are distinct."""
    assert {"workflow_r1.train", "workflow_r1.evaluate", "workflow_r1.aot.__main__"} <= set(FLAGS)
    graph = {**GRAPH, **{name: _imports(name, path) for name, path in TESTS.items()}}
    loaded, todo = set(), list(TESTS)
    while todo:
        m = todo.pop()
        if m not in loaded:
            loaded.add(m)
            todo.extend(graph.get(m, ()))
    owners: dict[str, list[str]] = {}
    for m in sorted(loaded & set(FLAGS)):
        for name in FLAGS[m]:
            owners.setdefault(name, []).append(m)
    twice = {name: ms for name, ms in owners.items() if len(ms) > 1}
    assert not twice, "flags defined twice in the test session: " + "; ".join(
        f"--{name} by {', '.join(ms)}" for name, ms in sorted(twice.items()))


def test_importing_loads_nothing_forbidden():
    """What a chain of allowed imports pulls in, in one fresh interpreter: evaluation's policy source
    loads no update code, the config files no trainer."""
    code = ("import sys\n"
            "import workflow_r1.eval.policy_source\n"
            "bad = sorted(m for m in sys.modules if m.startswith('workflow_r1.rl'))\n"
            "import configs.base\n"
            "bad += sorted(m for m in sys.modules if m in ('workflow_r1.trainer', 'workflow_r1.train'))\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"forbidden modules loaded: {proc.stdout.strip()} {proc.stderr[-500:]}"
