"""Bearer-token authentication for the admin API: who may read, who may write.

What it is for: loading API tokens from a file (``--token-file``) or the environment
(``ELASTIC_API_TOKENS``) and checking a presented token against them in constant time.
A token has a role: ``admin`` (read and write) or ``read`` (read only), and an optional
name that the audit log records as the actor. Lines of a token file::

    # token            role   [name]
    4f9c1d...e2        admin  alice
    77ab30...9c        read   grafana

``ELASTIC_API_TOKENS`` holds the same entries separated by commas or newlines, each
``token role [name]`` or ``token:role[:name]``.

What it must not do: log or echo a token. A token without a name is recorded as
``<role>:<first 8 hex of its SHA-256>`` so the audit log tells tokens apart without
storing them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from elastic.model import SpecError

log = logging.getLogger(__name__)

Role = Literal["admin", "read"]
ROLES: tuple[str, ...] = ("admin", "read")
ENV_VAR = "ELASTIC_API_TOKENS"
#: Printable, no whitespace and no ':' (the env separator); at least 16 characters.
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]{16,}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


@dataclass(frozen=True)
class Principal:
    """Who made a request: the actor name the audit log records, and the role."""

    name: str
    role: Role

    @property
    def can_write(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True)
class _Entry:
    digest: bytes  # SHA-256 of the token: fixed length, so the comparison leaks no length
    principal: Principal


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenSet:
    """The accepted tokens. Empty means every write is refused (401) until tokens are configured."""

    def __init__(self, entries: list[tuple[str, str, str | None]] | None = None) -> None:
        self._entries: list[_Entry] = []
        seen: set[bytes] = set()
        for i, (token, role, name) in enumerate(entries or []):
            where = f"token entry {i + 1}"
            if not _TOKEN_RE.match(token):
                raise SpecError(f"{where}: a token must be at least 16 characters of [A-Za-z0-9._~+/=-]; "
                                "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
            if role not in ROLES:
                raise SpecError(f"{where}: role '{role}' must be one of {', '.join(ROLES)}")
            if name is not None and not _NAME_RE.match(name):
                raise SpecError(f"{where}: name '{name}' must be 1-64 characters of [A-Za-z0-9._@-]")
            d = _digest(token)
            if d in seen:
                raise SpecError(f"{where}: the same token is listed twice")
            seen.add(d)
            actor = name or f"{role}:{d.hex()[:8]}"
            self._entries.append(_Entry(d, Principal(actor, role)))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, token: str | None) -> Principal | None:
        """The principal of ``token``, or None. Compares against every entry with
        ``hmac.compare_digest`` and never stops early, so timing tells nothing about which
        entry (or how much of it) matched."""
        if not token:
            return None
        d = _digest(token)
        found: Principal | None = None
        for e in self._entries:
            if hmac.compare_digest(d, e.digest):
                found = e.principal
        return found

    # ---- loading ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, source: str, *, env_style: bool = False) -> TokenSet:
        """Entries from a token file's text (one per line) or the env var (commas or newlines)."""
        entries: list[tuple[str, str, str | None]] = []
        chunks = re.split(r"[,\n]", text) if env_style else text.splitlines()
        for n, raw in enumerate(chunks, start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(":") if (env_style and ":" in line and " " not in line) else line.split()
            if len(parts) not in (2, 3):
                what = "entry" if env_style else "line"
                raise SpecError(f"{source} {what} {n}: expected 'token role [name]' with role admin or read, "
                                f"got {len(parts)} fields")
            token, role, name = parts[0], parts[1], (parts[2] if len(parts) == 3 else None)
            try:
                entries.append(cls._checked(token, role, name))
            except SpecError as e:
                raise SpecError(f"{source} {'entry' if env_style else 'line'} {n}: {e}") from None
        return cls(entries)

    @staticmethod
    def _checked(token: str, role: str, name: str | None) -> tuple[str, str, str | None]:
        TokenSet([(token, role, name)])  # validates one entry; the message names the problem
        return token, role, name

    @classmethod
    def from_file(cls, path: str | Path) -> TokenSet:
        p = Path(path)
        try:
            text = p.read_text()
            mode = p.stat().st_mode
        except OSError as e:
            raise SpecError(f"--token-file {p}: cannot read ({e.strerror})") from None
        tokens = cls.parse(text, f"--token-file {p}")  # a file refused anyway needs no second word
        if mode & 0o077:
            log.warning("--token-file %s can be read by other users (mode %o): they can act as its admins; "
                        "chmod 600 it", p, mode & 0o777)
        return tokens

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TokenSet:
        env = os.environ if environ is None else environ
        return cls.parse(env.get(ENV_VAR, ""), ENV_VAR, env_style=True)

    @classmethod
    def load(cls, token_file: str | Path | None = None, environ: dict[str, str] | None = None) -> TokenSet:
        """Tokens from ``token_file`` and ``ELASTIC_API_TOKENS`` together (either may be absent)."""
        a = cls.from_file(token_file) if token_file else cls()
        b = cls.from_env(environ)
        merged = cls()
        merged._entries = a._entries + [e for e in b._entries if e.digest not in {x.digest for x in a._entries}]
        return merged
