"""The admin-token Secret of a deployment (pure; the token itself is drawn by the reconciler)."""

from __future__ import annotations

import base64
from typing import Any

from .. import labels
from ..spec import DeploymentSpec
from .meta import child_metadata


def build_admin_secret(spec: DeploymentSpec, token: str) -> dict[str, Any]:
    """Secret ``<name>-admin-token`` holding ``token`` under key ``token``, owned by the deployment.

    The operator creates it once (never overwrites it); pods read it through ``secretKeyRef``.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(
            spec, labels.admin_secret_name(spec.name), labels.common_labels(spec.name)
        ),
        "type": "Opaque",
        "immutable": True,
        "data": {labels.ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
