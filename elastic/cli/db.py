"""``elastic db``: database schema commands (``upgrade``, ``current``).

The URL comes from ``--db``, else ``ELASTIC_DB_URL``, else ``sqlite:///./elastic.db``.
An unreachable or malformed URL prints one line naming it (password masked), exit 2.
"""

from __future__ import annotations

import os

import typer

DB_ENV = "ELASTIC_DB_URL"

_DB_OPTION = typer.Option(None, "--db", help=f"database URL (default: ${DB_ENV} or sqlite:///./elastic.db)")


def resolve_db_url(db: str | None) -> str:
    """``--db`` wins, then ``ELASTIC_DB_URL``, then the local SQLite file."""
    from elastic.store import DEFAULT_URL

    return db or os.environ.get(DB_ENV) or DEFAULT_URL


def register(app: typer.Typer) -> None:
    db_app = typer.Typer(help="Database schema: apply migrations, show the revision.", no_args_is_help=True)
    app.add_typer(db_app, name="db")

    @db_app.command("upgrade")
    def upgrade_cmd(db: str | None = _DB_OPTION) -> None:
        """Apply all schema migrations (a no-op when already up to date)."""
        from elastic.cli import UserError, console
        from elastic.store import StoreError, upgrade

        try:
            result = upgrade(resolve_db_url(db))
        except StoreError as e:
            raise UserError(str(e)) from None
        console.print(result.describe(), highlight=False, soft_wrap=True)

    @db_app.command("current")
    def current_cmd(db: str | None = _DB_OPTION) -> None:
        """Show the database's schema revision and the newest one this version ships."""
        from elastic.cli import UserError, console
        from elastic.store import Store, StoreError, current_revision, head_revision

        try:
            store = Store.from_url(resolve_db_url(db))
            try:
                cur = current_revision(store)
            finally:
                store.dispose()
        except StoreError as e:
            raise UserError(str(e)) from None
        head = head_revision()
        state = "up to date" if cur == head else "needs `elastic db upgrade`"
        console.print(f"database {store.url}: revision {cur or '<empty>'}, head {head} ({state})",
                      highlight=False, soft_wrap=True)
