"""No import circles among the project's modules (DESIGN.md: registries are filled by what they register,
never import it back). The imports are read from the source with `ast`, nothing is imported: every
`import` and `from ... import` counts, at module level, inside functions or under TYPE_CHECKING alike,
since a late import only hides a circle. services/ is read as `offpolicy.services`, as it is installed.

The dependency rule between offpolicy's packages is docs/architecture.md's table ("Packages and the
dependency rule"); each package's docstring repeats its row. The tests read both and fail on an import
against them, so a new arrow is a change to the written rule first."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"offpolicy": ROOT / "offpolicy", "offpolicy.services": ROOT / "services"}


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under each package directory."""
    out = {}
    for name, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([name, *parts])] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolves to its longest known prefix; importing
    one's own package, i.e. its __init__, is no edge: Python runs that first anyway)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != m and not m.startswith(n + "."):
                    edges[m].add(n)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def describe(found: list[list[str]]) -> str:
    return "\n".join("import circle: " + " <-> ".join(c) for c in found)


def test_no_import_circles_in_offpolicy_and_services():
    mods = modules(PACKAGES)
    assert len(mods) > 100  # the walk found the project (it holds ~150 modules)
    found = circles(import_graph(mods))
    assert not found, (f"{describe(found)}\nbreak it one way: a registry filled by what it registers, or a "
                       "module that imports them all and that nothing imports back")


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules({"pkg": tmp_path / "pkg"})


def test_a_planted_circle_is_found_and_named(tmp_path):
    """The check can fail: a circle through a late import and a relative import, two modules deep."""
    mods = _package(tmp_path, {
        "__init__.py": "",
        "registry.py": "def get():\n    from pkg.sub import family\n    return family.FAMILY\n",
        "sub/__init__.py": "from . import family\n",
        "sub/family.py": "from ..registry import get\nFAMILY = 1\n",
        "leaf.py": "import pkg.registry\n",
    })
    found = circles(import_graph(mods))
    assert found == [["pkg.registry", "pkg.sub", "pkg.sub.family"]]
    assert describe(found) == "import circle: pkg.registry <-> pkg.sub <-> pkg.sub.family"


def test_one_way_imports_and_own_package_are_no_circle(tmp_path):
    mods = _package(tmp_path, {
        "__init__.py": "from pkg.load import load\n",  # the package re-exports its modules
        "schema.py": "import pkg\nSCHEMA = 1\n",  # importing one's own package is no edge
        "checks.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.schema import SCHEMA\n",
        "load.py": "from pkg import checks, schema\ndef load():\n    return schema.SCHEMA\n",
    })
    edges = import_graph(mods)
    assert edges["pkg"] == {"pkg.load"} and edges["pkg.schema"] == set()
    assert edges["pkg.checks"] == {"pkg.schema"} and edges["pkg.load"] == {"pkg.checks", "pkg.schema"}
    assert circles(edges) == []


# -- the dependency rule between packages --------------------------------------------------------------
def read_rule(text: str) -> dict[str, set[str]]:
    """Package -> what it may import, from the table of docs/architecture.md's "Packages and the
    dependency rule" section (its rows: | `name/` | what it does | may import |)."""
    section = text.split("## Packages and the dependency rule", 1)[1].split("\n## ", 1)[0]
    rule = {}
    for row in re.findall(r"^\| `(\w+)/` \|.*\| ([^|]+) \|$", section, flags=re.M):
        name, may = row
        rule[name] = set() if may.strip() == "nothing of offpolicy" else {m.strip() for m in may.split(",")}
    return rule


def part(module: str, root: str = "offpolicy") -> str:
    """The package of offpolicy a module belongs to (`offpolicy.hub.intake` -> `hub`); the root itself is ''."""
    return module.removeprefix(root).lstrip(".").split(".")[0]


def violations(edges: dict[str, set[str]], rule: dict[str, set[str]], root: str = "offpolicy") -> list[str]:
    """Every import of one package by another that the rule does not allow, as 'a -> b (module -> module)'.
    An allowed name is a package (`hub`) or one module of it (`learner.loss`, and that module's own
    submodules); the root package itself (`import offpolicy`) is always allowed, and so is a package
    that imports nothing (`from offpolicy.learner import loss` runs learner/__init__.py, a docstring)
    when one of its modules is allowed; `root.services` is outside the rule (the entry points may
    import anything)."""
    out = []
    for m, targets in sorted(edges.items()):
        src = part(m, root)
        if not m.startswith(root + ".") or src == "services":
            continue
        for t in sorted(targets):
            dst = part(t, root)
            if dst in ("", src):
                continue
            name = t.removeprefix(root + ".")
            allowed = rule.get(src, set())
            if not any(name == a or name.startswith(a + ".") or (a.startswith(name + ".") and not edges.get(t))
                       for a in allowed):
                out.append(f"{src} -> {dst} ({m} -> {t})")
    return out


def test_packages_import_only_what_the_written_rule_allows():
    rule = read_rule((ROOT / "docs" / "architecture.md").read_text())
    packages = sorted(p.name for p in (ROOT / "offpolicy").iterdir() if (p / "__init__.py").exists())
    assert sorted(rule) == packages, "docs/architecture.md's dependency table must name every package, and only those"
    stray = sorted(p.name for p in (ROOT / "offpolicy").glob("*.py") if p.name != "__init__.py")
    assert not stray, f"modules at offpolicy's root, outside every package of the rule: {stray}"
    found = violations(import_graph(modules(PACKAGES)), rule)
    assert not found, ("imports against the dependency rule (docs/architecture.md, 'Packages and the dependency "
                       "rule'):\n" + "\n".join(found) + "\nmove the code, or change the written rule first")


def test_every_package_docstring_says_what_it_may_import():
    rule = read_rule((ROOT / "docs" / "architecture.md").read_text())
    for name, may in rule.items():
        doc = ast.get_docstring(ast.parse((ROOT / "offpolicy" / name / "__init__.py").read_text())) or ""
        said = re.search(r"May import: ([^(]+?) \(docs/architecture.md", doc.replace("\n", " "))
        assert said, f"offpolicy/{name}/__init__.py: its docstring must say 'May import: ...' (docs/architecture.md)"
        words = said.group(1).strip()
        assert (set() if words == "nothing of offpolicy" else {w.strip() for w in words.split(",")}) == may, name


def test_an_arrow_against_the_rule_is_named(tmp_path):
    """The rule check can fail: a lower package importing a higher one, late and relatively, is named;
    an allowed module of a package passes (with its empty package) while its sibling does not; the entry
    points are free."""
    mods = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from ..high import b\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low import a\nfrom pkg.mid import math\n",
        "high/c.py": "from pkg.mid import loop\n",
        "mid/__init__.py": "",
        "mid/math.py": "",
        "mid/loop.py": "",
        "services/__init__.py": "from pkg.high import b\n",
    })
    rule = read_rule("## Packages and the dependency rule\n\n| package | does | may import |\n| --- | --- | --- |\n"
                     "| `low/` | x | nothing of offpolicy |\n| `high/` | y | low, mid.math |\n| `mid/` | z | low |\n")
    assert rule == {"low": set(), "high": {"low", "mid.math"}, "mid": {"low"}}
    assert violations(import_graph(mods), rule, root="pkg") == [
        "high -> mid (pkg.high.c -> pkg.mid.loop)", "low -> high (pkg.low.a -> pkg.high)",
        "low -> high (pkg.low.a -> pkg.high.b)"]
