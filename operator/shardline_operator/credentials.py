"""The keys of a deployment (pure): the admin token the operator draws, the user's API key, and
the digest that ties running pods to the keys' values.

The runtime reads its keys from env vars filled from Secrets, once at start; it cannot reload
them. So a key's value is part of the pod template's restart hash (through
``DeploymentSpec.credentials_digest``): editing the API-key Secret, or deleting the admin-token
Secret (the operator draws a new token), restarts the groups one at a time like an image change.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
from collections.abc import Mapping
from typing import Any

from .spec import SpecError

ADMIN_TOKEN_BYTES = 32
# What the runtime accepts (server_args): keys of printable ASCII without spaces, comma-separated.
_KEY = re.compile(r"^[\x21-\x2b\x2d-\x7e]{1,4096}(,[\x21-\x2b\x2d-\x7e]{1,4096})*$")


def new_admin_token() -> str:
    """A random admin token: 32 bytes from :mod:`secrets`, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(ADMIN_TOKEN_BYTES)


def secret_value(secret: Mapping[str, Any], key: str) -> str | None:
    """The decoded value of ``key`` in a Secret as the API returns it (surrounding whitespace
    removed, as the runtime does), or None when the key is missing or not valid base64/UTF-8."""
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        return None
    try:
        return base64.b64decode(raw, validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        return None


def api_key_from_secret(
    secret: Mapping[str, Any] | None, name: str, key: str, namespace: str
) -> str:
    """The API key in ``secret`` (``spec.auth.apiKeySecretRef``).

    Raises:
        SpecError: the Secret is missing, lacks ``key``, or holds a value the runtime would refuse.
    """
    path = "spec.auth.apiKeySecretRef"
    if secret is None:
        raise SpecError(
            f"{path}: Secret {name!r} not found in namespace {namespace!r}; create it, e.g. "
            f"kubectl create secret generic {name} --from-literal={key}=<key>"
        )
    value = secret_value(secret, key)
    if value is None:
        keys = sorted((secret.get("data") or {}).keys())
        raise SpecError(
            f"{path}: Secret {name!r} has no key {key!r} (keys: {keys}); set {path}.key"
        )
    if not _KEY.match(value):
        raise SpecError(
            f"{path}: the value of {name}/{key} must be one key, or several separated by commas, "
            "of 1-4096 printable ASCII characters without spaces (sent in an HTTP header)"
        )
    return value


def credentials_digest(admin_token: str, api_key: str | None) -> str:
    """12 hex characters of SHA-256 over both keys: changes when either value changes."""
    text = f"{admin_token}\0{api_key or ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]
