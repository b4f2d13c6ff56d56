"""Pure decision code imports no I/O library (STYLE.md section 9).

Each pure module is imported in a fresh interpreter and the test fails if any forbidden
package ends up in ``sys.modules`` — transitively, which a grep of import lines would miss.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ["sqlalchemy", "ray", "kubernetes", "kopf", "httpx", "fastapi", "uvicorn", "torch.distributed",
             "alembic", "psycopg", "requests"]
PURE_PACKAGES = ["elastic.parallel", "elastic.policy", "elastic.scheduler", "elastic.sim"]
PURE_MODULES = ["elastic.model", "elastic.reshard.spec", "elastic.reshard.types", "elastic.reshard.regions"]


def _pure_modules() -> list[str]:
    mods = list(PURE_MODULES)
    for pkg in PURE_PACKAGES:
        path = ROOT / pkg.replace(".", "/")
        if not path.is_dir():
            continue
        mods.append(pkg)
        mods += [f"{pkg}.{m.name}" for m in pkgutil.walk_packages([str(path)]) if "." not in m.name]
    reshard = ROOT / "elastic" / "reshard"
    mods += [f"elastic.reshard.{p.stem}" for p in sorted(reshard.glob("plan*.py"))]
    return mods


@pytest.mark.parametrize("module", _pure_modules())
def test_pure_module_imports_no_io_library(module: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    bad = json.loads(out.stdout.strip().splitlines()[-1])
    assert bad == [], f"{module} pulls in I/O libraries {bad}; keep decisions pure"


def test_layering_test_sees_the_pure_code() -> None:
    assert "elastic.model" in _pure_modules()
    assert "elastic.reshard.spec" in _pure_modules()
