"""MLflow keys for names that come from user code: every module name becomes a key MLflow accepts, injectively."""

from __future__ import annotations

import hashlib
import re

MAX_KEY = 250
"""The longest metric, parameter or tag key MLflow accepts."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- /:]")


def metric_key(text: str) -> str:
    """A valid MLflow key for ``text`` (module names come from user code).

    Characters MLflow rejects become ``_`` and the component is suffixed with a hash of the original (so the
    mapping stays injective); empty components are dropped and ``.``/``..`` replaced (MLflow keys must be
    normalised paths); a key over 250 characters is cut and suffixed with a hash of the original so it stays
    unique. Keys already valid are returned unchanged.
    """
    parts = [_safe_part(part) for part in text.split("/") if part]
    key = "/".join(parts) or "_"
    if len(key) > MAX_KEY:
        key = f"{key[: MAX_KEY - 9].rstrip('/')}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
    return key


def _safe_part(part: str) -> str:
    """One path component as MLflow accepts it. A component that had to change is suffixed with a hash of the
    original, so two names that differ only in rejected characters (``a<b``, ``a>b``) stay two keys."""
    safe = "_" if part in (".", "..") else _UNSAFE.sub("_", part)
    if safe == part:
        return part
    return f"{safe}-{hashlib.sha1(part.encode()).hexdigest()[:6]}"
