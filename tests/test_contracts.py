"""The import contracts in ``pyproject.toml`` break on a deliberate violation.

``make check`` runs import-linter over the real tree, where every contract holds; that alone
cannot show a contract would ever fail. Here the same contracts, with their package names
renamed, run over a small synthetic tree in ``tmp_path`` that holds every module they name:
first as it is (every contract kept), then with one forbidden import added, which must break
exactly the contracts that forbid it. Built from the configuration itself, the tree follows
every change to the contracts.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import importlinter.api  # noqa: F401  (configures import-linter's adapters, as its command line does)
import pytest
from importlinter.application import use_cases
from importlinter.application.user_options import UserOptions

ROOT = Path(__file__).resolve().parents[1]
CONFIG: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
SHADOW = {"elastic": "shadow_elastic", "operators": "shadow_operators"}
MODULE_FIELDS = ("source_modules", "forbidden_modules", "ancestors")


def _rename(name: str) -> str:
    for real, shadow in SHADOW.items():
        if name == real or name.startswith(real + "."):
            return shadow + name[len(real) :]
    return name


def _is_internal(name: str) -> bool:
    return name.split(".")[0] in SHADOW.values()


def _edges(contract: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        tuple(_rename(part.strip()) for part in e.split("->")) for e in contract.get("ignore_imports", [])
    ]  # type: ignore[misc]


def _options() -> UserOptions:
    """The configuration as import-linter reads it from ``pyproject.toml``, its packages renamed."""
    real = use_cases.read_user_options(str(ROOT / "pyproject.toml"))
    session = dict(real.session_options)
    session["root_packages"] = [_rename(p) for p in session["root_packages"]]
    contracts = []
    for c in real.contracts_options:
        c = dict(c)
        for field in MODULE_FIELDS:
            if field in c:
                c[field] = [_rename(m) for m in c[field]]
        if "ignore_imports" in c:
            c["ignore_imports"] = [f"{a} -> {b}" for a, b in _edges(c)]
        contracts.append(c)
    return UserOptions(session_options=session, contracts_options=contracts)


def _file(tmp: Path, module: str) -> Path:
    """The file of ``module`` in the synthetic tree: a package where the real tree has one."""
    real = ROOT.joinpath(*_real(module).split("."))
    path = tmp.joinpath(*module.split("."))
    return path / "__init__.py" if real.is_dir() or not module.count(".") else path.with_suffix(".py")


def _real(module: str) -> str:
    for real, shadow in SHADOW.items():
        if module == shadow or module.startswith(shadow + "."):
            return real + module[len(shadow) :]
    return module


def _add_import(tmp: Path, importer: str, imported: str) -> None:
    parts = importer.split(".")
    for i in range(1, len(parts) + 1):
        f = _file(tmp, ".".join(parts[:i]))
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()
    with _file(tmp, importer).open("a") as out:
        out.write(f"import {imported}\n")


def _tree(tmp: Path) -> None:
    """Every internal module a contract names, and the imports its ignore list expects to find."""
    for c in _options().contracts_options:
        for field in MODULE_FIELDS:
            for m in c.get(field, []):
                if _is_internal(m):
                    _add_import(tmp, m, "math")
        for a, b in (tuple(e.split(" -> ")) for e in c.get("ignore_imports", [])):
            _add_import(tmp, b, "math")
            _add_import(tmp, a, b)


def _kept(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    monkeypatch.syspath_prepend(str(tmp))
    # the command line registers the built-in contract types before it reads a configuration
    use_cases._register_built_in_contract_types()
    report = use_cases.create_report(_options(), cache_dir=None)
    assert not report.could_not_run and not report.invalid_contract_options
    ids = {c["name"]: c["id"] for c in CONFIG["contracts"]}
    return {ids[c.name]: check.kept for c, check in report.get_contracts_and_checks()}


def _broken(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    return {cid for cid, kept in _kept(tmp, monkeypatch).items() if not kept}


def test_every_contract_holds_on_the_clean_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tree(tmp_path)
    kept = _kept(tmp_path, monkeypatch)
    assert len(kept) == len(CONFIG["contracts"]) >= 4
    assert all(kept.values()), kept


VIOLATIONS = {
    # a pure package imports an I/O library
    "pure-imports-sqlalchemy": ([("elastic.scheduler", "sqlalchemy")], {"pure"}),
    # ... or a world-touching layer, here the reshard executor beside the planner
    "pure-imports-executor": ([("elastic.reshard.plan", "elastic.reshard.execute")], {"pure"}),
    # ... or one indirectly, through a helper module no contract names
    "pure-imports-httpx-indirectly": (
        [("elastic.policy", "elastic.helper"), ("elastic.helper", "httpx")],
        {"pure"},
    ),
    # the layout planner imports the reshard planner that builds on it: the loop this tree had
    "parallel-reshard-loop": (
        [("elastic.reshard.spec", "elastic.parallel"), ("elastic.parallel", "elastic.reshard.spec")],
        {"parallel-below-reshard", "no-folder-loops"},
    ),
    # the metrics package imports a backend that reads metrics: the other loop this tree had
    "metrics-backends-loop": (
        [("elastic.backends", "elastic.metrics"), ("elastic.metrics", "elastic.backends")],
        {"metrics-below-backends", "no-folder-loops"},
    ),
    # a loop between two folders that no forbidden contract names
    "store-api-loop": (
        [("elastic.api", "elastic.store"), ("elastic.store", "elastic.api")],
        {"no-folder-loops"},
    ),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_a_deliberate_violation_breaks_its_contract(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    imports, expected = VIOLATIONS[case]
    _tree(tmp_path)
    for importer, imported in imports:
        _add_import(tmp_path, _rename(importer), _rename(imported))
    assert _broken(tmp_path, monkeypatch) == expected
