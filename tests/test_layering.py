"""The package's layering and its import graph: no module imports from a layer above its own,
and no import cycle between modules.

Every module of the package is parsed (``ast``), and every import in it counts: at the top,
inside functions, under ``if``; relative imports resolved. ``from X import y`` is an import of
the module ``X.y`` when there is one, else of ``X``; the parent packages an import runs first
(``schedlab/__init__.py`` for every one) are no edge of their own. A module's layer is the one of the longest
prefix in ``LAYERS`` that its dotted name starts with. An import of a module in a higher layer
is a violation; so is every strongly connected component of two or more modules (a cycle,
however long, and whichever layers it spans).

Run as a script it prints the violations and cycles it finds (``python tests/test_layering.py``;
exit status 1 when there are any).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "schedlab"

# The layers, lowest first: a module may import its own layer and those below it. A module's
# layer is that of the longest dotted prefix below that names it ("schedlab" alone: the API,
# i.e. the modules directly in schedlab/ and its subpackages not named here).
LAYERS: dict[str, int] = {
    "schedlab.traces": 0,
    "schedlab.policies": 1,
    "schedlab.routers": 1,  # beside the policies: traces and the policies' types below it, nothing above
    "schedlab.sim": 2,
    "schedlab.analysis": 3,
    "schedlab.engine": 4,
    # the serving runtime: run by the API (schedlab.serve, run_real(replicas=...)) and the commands,
    # handed a loaded engine or a replica's serve options; it never imports the API
    "schedlab.serving": 5,
    "schedlab.errors": 5,  # the one exception type, of the serving layer, the API and the commands
    "schedlab": 6,  # the API: schedlab/*.py, schedlab/api/, ...
    "schedlab.cli": 7,  # the commands
    "schedlab.commands": 7,
}
LAYER_NAMES = {0: "traces", 1: "policies", 2: "sim", 3: "analysis", 4: "engine", 5: "serving", 6: "API", 7: "commands"}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Each package of pyproject's ``package-dir`` (``schedlab.sim`` -> sim/, ...)."""
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    dirs = conf["tool"]["setuptools"]["package-dir"]
    return {name: root / d for name, d in dirs.items()}


def module_files(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module of the package: dotted name -> file. A folder is a package (``__init__.py``)
    and its subfolders with an ``__init__.py`` are subpackages; a root mapped on its own by
    ``roots`` (schedlab.sim in schedlab's listing) is walked under its own name only."""
    out: dict[str, Path] = {}
    own = {p.resolve() for p in roots.values()}

    def walk(name: str, folder: Path) -> None:
        for f in sorted(folder.iterdir()):
            if f.is_dir():
                if (f / "__init__.py").is_file() and f.resolve() not in own:
                    walk(f"{name}.{f.name}", f)
            elif f.suffix == ".py":
                out[name if f.name == "__init__.py" else f"{name}.{f.stem}"] = f

    for name, folder in roots.items():
        walk(name, folder)
    return out


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in ``source`` (only those in
    ``known``: an import of a module of the package that does not exist is not an edge)."""
    out: set[str] = set()
    here = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # from X import y: the module X.y where there is one (X's own __init__ runs first, as
            # it does for every import of a module below X: no edge of its own), else X
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            # the longest known module the dotted name starts with (import a.b.c imports a.b.c)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def layer(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"{module} is in no layer of LAYERS")


def graph(files: dict[str, Path], extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the modules it imports, from ``files`` (and ``extra``: module -> source, as if
    such a file existed too)."""
    sources = {m: (f.read_text(), f.name == "__init__.py") for m, f in files.items()}
    for m, src in (extra or {}).items():
        sources[m] = (src, False)
    known = set(sources)
    return {m: imports_of(m, src, pkg, known) for m, (src, pkg) in sources.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's, iterative), each
    sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


@dataclass(frozen=True)
class Violation:
    module: str
    imports: str

    def __str__(self) -> str:
        return (
            f"{self.module} ({LAYER_NAMES[layer(self.module)]}) imports {self.imports} "
            f"({LAYER_NAMES[layer(self.imports)]})"
        )


def violations(g: dict[str, set[str]]) -> list[Violation]:
    return sorted(
        (Violation(m, t) for m, ts in g.items() for t in ts if layer(t) > layer(m)), key=lambda v: (v.module, v.imports)
    )


def check(root: Path = ROOT, extra: dict[str, str] | None = None) -> tuple[list[Violation], list[list[str]]]:
    g = graph(module_files(package_dirs(root)), extra)
    return violations(g), cycles(g)


def report(found: tuple[list[Violation], list[list[str]]]) -> str:
    bad, loops = found
    lines = [f"upward import: {v}" for v in bad]
    lines += [f"import cycle: {' <-> '.join(c)}" for c in loops]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- tests


def test_every_module_is_in_a_layer_and_none_is_missed():
    files = module_files(package_dirs())
    for m in (
        "schedlab",
        "schedlab.sim.loop",
        "schedlab.policies.base",
        "schedlab.analysis.analytic.roofline",
        "schedlab.engine.gguf",
        "schedlab.traces.schema",
        "schedlab.cli",
        "schedlab.serving.front",
    ):
        assert m in files
    for m in files:
        layer(m)  # raises for a module outside every layer
    assert layer("schedlab.sim.loop") == 2 and layer("schedlab.cli") == 7 and layer("schedlab.results") == 6
    assert layer("schedlab.serving.front") == 5 and layer("schedlab.serving") < layer("schedlab.api.real")


def test_no_upward_import_and_no_cycle():
    found = check()
    assert found == ([], []), "\n" + report(found)


def test_a_planted_upward_import_is_reported():
    files = module_files(package_dirs())
    plant = {"schedlab.sim.planted": "def f():\n    from schedlab.engine import backend\n    return backend\n"}
    g = graph(files, plant)
    assert "schedlab.engine.backend" in g["schedlab.sim.planted"]
    assert Violation("schedlab.sim.planted", "schedlab.engine.backend") in violations(g)
    # a relative import is resolved against the module's package
    rel = graph(files, {"schedlab.policies.planted": "from ..sim import loop\n"})
    assert Violation("schedlab.policies.planted", "schedlab.sim.loop") in violations(rel)
    assert "schedlab.policies.planted (policies) imports schedlab.sim.loop (sim)" in report((violations(rel), []))


def test_a_planted_cycle_is_reported():
    files = module_files(package_dirs())
    # two new modules of one layer importing each other: no layering violation, a cycle
    plant = {
        "schedlab.traces.planted_a": "import schedlab.traces.planted_b\n",
        "schedlab.traces.planted_b": "def f():\n    from . import planted_a\n",
    }
    g = graph(files, plant)
    assert ["schedlab.traces.planted_a", "schedlab.traces.planted_b"] in cycles(g)
    # a longer one through an existing module: sim.loop -> sim.state -> (planted) -> sim.loop
    assert "schedlab.sim.state" in g["schedlab.sim.loop"]
    g["schedlab.sim.state"] = g["schedlab.sim.state"] | {"schedlab.sim.planted"}
    g["schedlab.sim.planted"] = {"schedlab.sim.loop"}
    loop = next(c for c in cycles(g) if "schedlab.sim.planted" in c)
    assert {"schedlab.sim.loop", "schedlab.sim.state", "schedlab.sim.planted"} <= set(loop)
    assert "import cycle: " in report(([], [loop]))


if __name__ == "__main__":
    found = check()
    text = report(found)
    print(text or "no upward import, no import cycle")
    sys.exit(1 if text else 0)
