"""The documentation stays true to the code and free of history.

* The reference pages under ``docs/reference/`` are what ``scripts/gen_reference.py`` renders
  from the code now: a new command, option, config key, CRD field, API route, metric or
  environment variable fails here until the pages are regenerated (and, for a variable,
  described).
* The README fits on a screen and carries no date, commit hash or machine ("VM"); neither do
  comments and docstrings in ``elastic/``, nor do they point at files outside the repository.
* What the README and the docs show a user to type exists in the code.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# A date (not a timestamp such as an RFC 3339 example, which is a format, not a journal entry),
# a commit hash (7 to 40 hex digits with at least one digit and one letter), a machine.
DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b(?![T ]\d\d:)")
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
VM = re.compile(r"\bVMs?\b")
# a file outside the repository (the project's shared notes)
OUTSIDE = re.compile(r"\bshared/[A-Za-z]")
RULES = {"date": DATE, "commit hash": HASH, "VM": VM, "reference outside the repository": OUTSIDE}

# Files whose owners have comments left to fix (see each entry's reason); remove an entry when
# its file is clean: test_allow_list_is_needed fails on an entry no longer needed.
ALLOWED_HISTORY: dict[str, str] = {
}


def _gen() -> object:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen() -> object:
    return _gen()


# ---- reference pages ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered(gen: object) -> dict[str, str]:
    return gen.render_all()  # type: ignore[attr-defined]


@pytest.mark.parametrize("page", ["cli.md", "config.md", "crds.md", "api.md", "metrics.md", "environment.md"])
def test_reference_page_matches_the_code(rendered: dict[str, str], page: str) -> None:
    committed = (ROOT / "docs" / "reference" / page).read_text()
    assert committed == rendered[page], (
        f"docs/reference/{page} differs from the code: run `.venv/bin/python scripts/gen_reference.py`")


def test_every_cli_command_is_in_the_reference(rendered: dict[str, str], gen: object) -> None:
    root = gen._click_root()  # type: ignore[attr-defined]
    paths = [" ".join(p) for p, _ in gen._walk(root, ["elastic"]) if len(p) > 1]  # type: ignore[attr-defined]
    assert {"elastic models", "elastic plan", "elastic serve", "elastic db upgrade", "elastic get"} <= set(paths)
    for path in paths:
        assert f"## `{path}`" in rendered["cli.md"], path


def test_every_config_key_is_in_the_reference(rendered: dict[str, str]) -> None:
    from elastic.config import ControllerConfig
    from elastic.model import InferenceSpec, PoolSpec, TrainingSpec

    for model in (ControllerConfig, PoolSpec, InferenceSpec, TrainingSpec):
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert f"| `{key}`" in rendered["config.md"], f"{model.__name__}.{key}"


def test_every_crd_field_is_in_the_reference(rendered: dict[str, str]) -> None:
    from elastic.crds import ElasticTrainingJobSpec, GPUPoolSpec, InferenceServiceSpec

    for model in (GPUPoolSpec, InferenceServiceSpec, ElasticTrainingJobSpec):
        for name, field in model.model_fields.items():
            key = field.alias or name
            assert f"| `spec.{key}`" in rendered["crds.md"], f"{model.__name__}.{key}"


def test_every_api_route_is_in_the_reference(rendered: dict[str, str], gen: object) -> None:
    spec = gen.openapi()  # type: ignore[attr-defined]
    assert "/api/v1/jobs/{name}/rescale" in spec["paths"]
    for path, ops in spec["paths"].items():
        for method in ops:
            assert f"| {method.upper()} | `{path}` |" in rendered["api.md"], f"{method} {path}"


def test_every_metric_is_in_the_reference(rendered: dict[str, str], gen: object) -> None:
    fams = gen.metric_families()  # type: ignore[attr-defined]
    # the controller's, the coordinator's and the state database's families are all found
    assert {"elastic_gpu_utilization", "elastic_training_steps", "elastic_store_size_bytes"} <= set(fams)
    for name, f in fams.items():
        assert f"| `{gen.exposed_name(name, f['type'])}` |" in rendered["metrics.md"], name  # type: ignore[attr-defined]
    assert fams["elastic_service_desired_replicas"]["labels"] == ["service"]
    assert fams["elastic_replica_requests"]["labels"] == ["model_name", "outcome"]


def test_metric_scan_sees_what_the_exporter_registers(gen: object) -> None:
    """The source scan and a live registry agree on the controller's families."""
    from elastic.metrics.exporter import Exporter

    live = {m.name for m in Exporter().registry.collect()}
    scanned = {n for n, f in gen.metric_families().items()  # type: ignore[attr-defined]
               if "elastic/metrics/exporter.py" in f["files"]}
    # prometheus_client reports a counter's family without its _total suffix, as it was declared
    assert live == scanned


def test_every_environment_variable_is_described(rendered: dict[str, str], gen: object) -> None:
    found = gen.env_vars()  # type: ignore[attr-defined]
    assert "ELASTIC_DB_URL" in found and "ELASTIC_RENDEZVOUS_URL" in found
    assert not set(found) - set(gen.ENV_DOCS), "describe new variables in ENV_DOCS"  # type: ignore[attr-defined]
    stale = set(gen.ENV_DOCS) - set(found)  # type: ignore[attr-defined]
    assert not stale, f"ENV_DOCS describes variables the code no longer reads: {sorted(stale)}"
    for name in found:
        assert f"| `{name}` |" in rendered["environment.md"], name


# ---- history out of the README and the code's comments ---------------------------------------------

def _offences(text: str) -> list[str]:
    return [f"{rule}: {m.group(0)!r}" for rule, rx in RULES.items() for m in rx.finditer(text)]


def test_readme_fits_on_a_screen() -> None:
    assert len(README.read_text().splitlines()) < 200


def test_readme_has_no_history() -> None:
    bad = [f"README.md:{i}: {o}" for i, line in enumerate(README.read_text().splitlines(), 1)
           for o in _offences(line)]
    assert not bad, "\n".join(bad)


def _comment_lines(path: Path) -> list[tuple[int, str]]:
    """Every comment and docstring line of a Python file, with its line number."""
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def _history_in_comments() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "elastic").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, text in _comment_lines(path):
            for o in _offences(text):
                found.setdefault(rel, []).append(f"{rel}:{line}: {o}")
    return found


def test_comments_carry_no_history() -> None:
    found = _history_in_comments()
    bad = [x for rel, lines in found.items() if rel not in ALLOWED_HISTORY for x in lines]
    assert not bad, ("comments say why, the changelog says when:\n" + "\n".join(bad))


def test_allow_list_is_needed() -> None:
    found = _history_in_comments()
    clean = sorted(set(ALLOWED_HISTORY) - set(found))
    assert not clean, f"remove from ALLOWED_HISTORY (tests/test_docs.py), now clean: {clean}"


def test_history_rules_catch_what_they_should() -> None:
    assert _offences("measured on the slow VM of 2026-12-02 (commit 94a56f3)") == [
        "date: '2026-12-02'", "commit hash: '94a56f3'", "VM: 'VM'"]
    assert _offences("see shared/REFERENCE.md") == ["reference outside the repository: 'shared/R'"]
    # formats and ordinary words are not history
    assert _offences("``2023-11-14T22:14:20.123Z`` -> ``2023-11-14 22:14:20Z``; a decade of 1e999, deadline") == []


# ---- what the README and the docs tell a user to type ------------------------------------------------

def test_readme_links_point_at_files() -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target


def test_readme_manager_snippet_matches_the_api() -> None:
    import elastic.torch as et

    text = README.read_text()
    for used in ("et.Manager(build, corpus=", "et.TokenCorpus.open(", "mgr.start()", "mgr.steps()",
                 "mgr.micro_batches(step)", "mgr.step_done(step, loss=", "mgr.scheduler.step()",
                 "batch.inputs", "batch.labels", "batch.weight"):
        assert used in text, used
    for attr in ("start", "steps", "micro_batches", "step_done"):
        assert callable(getattr(et.Manager, attr)), attr
    assert callable(et.TokenCorpus.open)
    for field in ("inputs", "labels", "weight"):
        assert field in {f for f in dir(et.Batch)} | set(getattr(et.Batch, "__dataclass_fields__", {})), field


def test_readme_commands_exist(gen: object) -> None:
    root = gen._click_root()  # type: ignore[attr-defined]
    paths = {" ".join(p) for p, _ in gen._walk(root, ["elastic"])}  # type: ignore[attr-defined]
    for cmd in re.findall(r"^(elastic [a-z-]+(?: [a-z]+)?)", README.read_text(), re.M):
        head = cmd.split()[:2]
        assert " ".join(head) in paths, cmd
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"`make ([a-z-]+)`", README.read_text()):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}"


def test_mkdocs_nav_names_every_page() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    named = set(re.findall(r"([\w./-]+\.md)\s*$", nav, re.M))
    assert pages == named, f"in docs/ but not in the nav: {sorted(pages - named)}; in the nav only: {sorted(named - pages)}"
