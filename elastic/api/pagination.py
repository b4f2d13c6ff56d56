"""Kubernetes-style list pagination: ``limit`` plus an opaque ``continue`` token.

What it is for: turning the store's keyset cursor (the last id of a page) into a token a
client hands back unchanged, and back. The token is base64url of a small JSON document
``{"v": 1, "after": <id>, "q": <the query it belongs to>}`` followed by an HMAC tag, so
that an edited, truncated or foreign token is refused (400) instead of silently paging from
the wrong place, and a token from one listing (``pool=a``) cannot be replayed on another.

What it must not do: hide data. The tag is an integrity check, not a secret: it does not
authorise anything, every page is still subject to the read rules of the API.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from typing import Any

from elastic.api.problems import invalid

_TAG_BYTES = 12
_VERSION = 1


class ContinueCodec:
    """Encode/decode continue tokens with ``key`` (any bytes; shared by API replicas of one DB)."""

    def __init__(self, key: bytes) -> None:
        self._key = hashlib.sha256(b"elastic-continue-v1\0" + key).digest()

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:_TAG_BYTES]

    def encode(self, after_id: int, query: dict[str, Any]) -> str:
        payload = json.dumps({"v": _VERSION, "after": after_id, "q": query}, sort_keys=True,
                             separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(payload + self._tag(payload)).decode().rstrip("=")

    def decode(self, token: str, query: dict[str, Any]) -> int:
        """The ``after`` id of a token minted for ``query``; a 400 problem naming ``continue`` otherwise."""
        bad = invalid("continue", "invalid continue token (edited, truncated or from another server); "
                                  "start the listing again without 'continue'", status=400)
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            raise bad from None
        payload, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if len(raw) <= _TAG_BYTES or not hmac.compare_digest(tag, self._tag(payload)):
            raise bad
        try:
            doc = json.loads(payload)
        except ValueError:
            raise bad from None
        if not isinstance(doc, dict) or doc.get("v") != _VERSION:
            raise bad
        after = doc.get("after")
        # a row id fits a signed 64-bit column: anything else was not minted here (a database would
        # refuse to compare with it)
        if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after < 2**63:
            raise bad
        if doc.get("q") != query:
            raise invalid("continue", f"this continue token belongs to the listing {doc.get('q')}, not {query}; "
                                      "keep the other query parameters unchanged while paging", status=400)
        return after
