"""Pure decision code imports no I/O library and nothing above it (STYLE.md section 9).

The rule is written once, as the ``pure`` import contract in ``pyproject.toml``: ``make check``
checks it statically with import-linter, and this test checks the same contract at run time.
It imports every pure module in one fresh interpreter, in order, and blames each forbidden
package that ends up in ``sys.modules`` on the first module that pulled it in — transitively,
and through ``importlib`` or ``__import__`` too, which a static scan cannot see.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _contract(contract_id: str) -> dict[str, Any]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in config["contracts"] if c["id"] == contract_id)


PURE = _contract("pure")
FORBIDDEN: list[str] = PURE["forbidden_modules"]


def _pure_modules() -> list[str]:
    """The contract's source modules, each package followed by all of its submodules."""
    mods: list[str] = []
    for source in PURE["source_modules"]:
        mods.append(source)
        path = ROOT / source.replace(".", "/")
        if path.is_dir():
            mods += sorted(m.name for m in pkgutil.walk_packages([str(path)], prefix=f"{source}."))
    return mods


_SCAN = """
import importlib, json, sys
modules, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def loaded():
    return {f for f in forbidden if any(m == f or m.startswith(f + ".") for m in sys.modules)}
seen, blame = loaded(), {}
for module in modules:
    importlib.import_module(module)
    now = loaded()
    if now - seen:
        blame[module] = sorted(now - seen)
    seen = now
print(json.dumps({"blame": blame}))
"""


def _blame(modules: list[str], forbidden: list[str]) -> dict[str, list[str]]:
    """module -> the forbidden packages that importing it (after the ones before it) loaded."""
    out = subprocess.run(
        [sys.executable, "-c", _SCAN, json.dumps(modules), json.dumps(forbidden)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["blame"]


def test_pure_code_loads_no_forbidden_module_at_run_time() -> None:
    blame = _blame(_pure_modules(), FORBIDDEN)
    assert blame == {}, f"pure modules pull in forbidden packages {blame}; keep decisions pure"


def test_the_run_time_check_blames_the_module_that_breaks_the_rule() -> None:
    """The same scan over a module that touches the world (the store loads SQLAlchemy) reports it."""
    blame = _blame(["elastic.model", "elastic.store"], FORBIDDEN)
    assert "elastic.model" not in blame
    assert "sqlalchemy" in blame["elastic.store"]


def test_the_contract_covers_the_pure_code() -> None:
    mods = _pure_modules()
    assert {
        "elastic.model",
        "elastic.reshard.spec",
        "elastic.parallel.sharding",
        "elastic.policy.replicas",
        "elastic.scheduler.core",
        "elastic.sim.engine",
        "elastic.reshard.plan",
    } <= set(mods)
    assert "elastic.reshard.execute" not in mods
    assert {
        "torch",
        "ray",
        "sqlalchemy",
        "kubernetes",
        "httpx",
        "elastic.backends",
        "elastic.controller",
        "elastic.store",
        "elastic.metrics",
        "operators",
    } <= set(FORBIDDEN)


# ---- the coordinator's decisions (rendezvous/posting, recovery, saves, meeting) -------------------
# Their contract (``coordinator-decisions``) forbids stdlib I/O (threading, socket, time, ...) as well,
# which the interpreter loads anyway (logging imports threading), so it is checked on the source:
# every import a decision module makes at run time (not under TYPE_CHECKING), with the same rule
# import-linter applies to each direct import.

DECISIONS = _contract("coordinator-decisions")


def _runtime_imports(source: str) -> set[str]:
    """The modules ``source`` imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(source)
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(node)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _forbidden(imports: set[str]) -> set[str]:
    banned = DECISIONS["forbidden_modules"]
    return {m for m in imports if any(m == f or m.startswith(f + ".") for f in banned)}


@pytest.mark.parametrize("module", DECISIONS["source_modules"])
def test_a_coordinator_decision_imports_no_io(module: str) -> None:
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    imports = _runtime_imports(source)
    assert imports and _forbidden(imports) == set(), (
        f"{module} imports {_forbidden(imports)}; keep decisions pure"
    )


def test_the_decision_check_catches_a_violation_and_ignores_type_only_imports() -> None:
    bad = "import threading\nfrom elastic.train.rendezvous.wire import RendezvousClient\nfrom time import monotonic\n"
    assert _forbidden(_runtime_imports(bad)) == {"threading", "elastic.train.rendezvous.wire", "time"}
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert _forbidden(_runtime_imports(typed)) == set()


MAX_LINES = 800  # a module past this mixes concerns; split it by concern (see the backends' split)


def test_no_module_of_the_package_or_the_operator_is_over_the_line_limit() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for d in ("elastic", "operators")
        for p in (ROOT / d).rglob("*.py")
    }
    assert len(sizes) > 100  # the walk found the code
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert over == {}, f"over {MAX_LINES} lines: {over}; split them by concern"
