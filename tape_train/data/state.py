"""What every resumable loader's state shares: its format version and config fingerprints."""

from __future__ import annotations

import hashlib
import json

STATE_VERSION = 1


def digest(obj: object) -> str:
    """A short, stable fingerprint of a JSON-able object (16 hex digits of its sha256)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
