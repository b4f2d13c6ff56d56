"""The admin REST API (FastAPI): ``create_app`` builds it, ``serve_api`` runs it in a thread.

See ``app.py`` for the factory (the endpoints are in ``reads.py``, ``writes.py``,
``interventions.py`` and ``ops.py``, their shared types in ``context.py``, the middleware in
``middleware.py``), ``auth.py`` for tokens, ``problems.py`` for the error shape and
``pagination.py`` for continue tokens.
"""

from __future__ import annotations

from elastic.api.app import create_app
from elastic.api.auth import Principal, TokenSet
from elastic.api.server import ApiServer, serve_api

__all__ = ["ApiServer", "Principal", "TokenSet", "create_app", "serve_api"]
