"""The ``elastic`` command (Typer + Rich).

Each sub-area contributes its commands from a module in this package that defines
``register(app: typer.Typer) -> None``; they are discovered at start-up, so areas
never edit each other's files. User errors (``SpecError`` and friends) print one
line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer
from rich.console import Console

from elastic import __version__

app = typer.Typer(
    name="elastic",
    help="Keep every GPU busy: lend idle inference GPUs to training jobs that reshard in place.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


class UserError(Exception):
    """Raised by commands for bad input; printed as one line, exit 2."""


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the version."""
    console.print(f"elastic {__version__}")


def _register_all() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        reg = getattr(module, "register", None)
        if reg is not None:
            reg(app)


_register_all()


def main() -> None:
    from elastic.model import SpecError

    try:
        app()
    except Exception as e:
        from elastic.backends.base import BackendUnavailable
        from elastic.store import StoreError

        # what a user can fix (a spec, an unreachable database or cluster): one line, not a traceback
        if not isinstance(e, (SpecError, UserError, StoreError, BackendUnavailable)):
            raise
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
