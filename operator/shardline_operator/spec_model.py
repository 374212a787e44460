"""Parse ``spec.model``: a directory in a pod volume (``path`` + ``volume``) or a ``uri``.

``uri`` forms (the CRD's CEL rule and :data:`URI_FORMS` say the same):

- ``hf://ORG/NAME[@REVISION]``: a Hugging Face Hub repository at a commit, branch or tag;
- ``s3://BUCKET/PREFIX``: every object under the prefix; ``spec.model.s3`` gives the endpoint
  and region of an S3-compatible store;
- ``pvc://CLAIM[/SUB/PATH]``: a directory of a PersistentVolumeClaim, turned here into the
  read-only ``volume`` and the ``path`` inside it (nothing is fetched).

``hf://`` and ``s3://`` models are fetched by the runtime itself into the model cache volume
(``spec.model.cache.volume``, default an emptyDir) and verified before they are loaded: at pod
start, and for an in-place update before the group pauses. Credentials come only from the
Secret ``spec.model.credentialsSecretRef`` (keys ``HF_TOKEN``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``; each optional).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from .spec_fields import field_value, int_in, one_of
from .spec_types import MODEL_KINDS, ModelSpec, SpecError

LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
HF_URI = re.compile(rf"^hf://({_PART}/{_PART})(?:@([A-Za-z0-9][A-Za-z0-9._/-]{{0,199}}))?$")
S3_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(\S+)$")
PVC_URI = re.compile(r"^pvc://([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)(/\S*)?$")
URI_FORMS = "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or pvc://CLAIM[/SUB/PATH]"
DEFAULT_MOUNT_PATH = "/var/lib/shardline/models"
# Where the runtime keeps fetched revisions (the cache volume's mount, --download-dir).
MODEL_CACHE_DIR = "/var/lib/shardline/model-cache"
MODEL_CACHE_ENV = "SHARDLINE_MODEL_CACHE"
CREDENTIAL_KEYS = ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _label_safe(text: str) -> str:
    """``text`` made a label value (invalid characters to '-', trimmed to 63)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63].strip("-._")
    return cleaned or "model"


def parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    """Parse ``spec.model``. Raises :class:`SpecError` naming the field."""
    path = "spec.model"
    name = field_value(raw, "name", path, str, required=True)
    if not name.strip():
        raise SpecError(f"{path}.name must be a non-empty string")
    uri = field_value(raw, "uri", path, str)
    model_path = field_value(raw, "path", path, str)
    if (uri is None) == (model_path is None):
        raise SpecError(f"{path}: set exactly one of {path}.path and {path}.uri")
    mount_path = field_value(raw, "mountPath", path, str, DEFAULT_MOUNT_PATH)
    volume = field_value(raw, "volume", path, dict)
    extra = _remote_fields(raw, uri)
    if uri is not None:
        if volume is not None:
            raise SpecError(f"{path}.volume applies to {path}.path; {path}.uri names its storage")
        pvc = PVC_URI.match(uri)
        if pvc is not None:
            sub = posixpath.normpath(pvc.group(3) or "/").lstrip("/")
            if ".." in (pvc.group(3) or "").split("/"):
                raise SpecError(f"{path}.uri: the sub-path of {uri!r} leaves the claim")
            volume = {"persistentVolumeClaim": {"claimName": pvc.group(1), "readOnly": True}}
            model_path = posixpath.join(mount_path, sub) if sub != "." else mount_path
            default_revision = posixpath.basename(model_path.rstrip("/")) or pvc.group(1)
        else:
            model_path = uri
            default_revision = _remote_revision(uri)
    else:
        default_revision = posixpath.basename(posixpath.normpath(model_path))
        if not posixpath.isabs(model_path):
            raise SpecError(
                f"{path}.path must be an absolute directory path in the pod, got {model_path!r}"
            )
    revision = field_value(raw, "revision", path, str, _label_safe(default_revision))
    if not LABEL_VALUE.match(revision):
        raise SpecError(
            f"{path}.revision must be 1-63 characters [A-Za-z0-9._-], starting and ending "
            f"alphanumeric (it becomes a label value), got {revision!r}"
        )
    if volume is not None and uri is None:
        if len(volume) != 1:
            raise SpecError(
                f"{path}.volume must hold exactly one volume source (e.g. hostPath, "
                f"persistentVolumeClaim), got {sorted(volume)}"
            )
        inside = posixpath.normpath(model_path).startswith(
            posixpath.normpath(mount_path).rstrip("/") + "/"
        )
        if not inside:
            raise SpecError(
                f"{path}.path ({model_path}) must be inside {path}.mountPath ({mount_path}) "
                "where the volume is mounted"
            )
    return ModelSpec(
        name=name,
        path=model_path,
        revision=revision,
        mount_path=mount_path,
        volume=volume,
        uri=uri,
        kind=one_of(raw, "kind", path, "auto", MODEL_KINDS),
        **extra,
    )


def _remote_revision(uri: str) -> str:
    """The default revision label of an hf:// or s3:// uri: its @REVISION (else ``main``), or
    the last component of the S3 prefix."""
    hf = HF_URI.match(uri)
    if hf is not None:
        return hf.group(2) or "main"
    s3 = S3_URI.match(uri)
    assert s3 is not None  # checked by _remote_fields
    return posixpath.basename(s3.group(2).rstrip("/"))


def _remote_fields(raw: Mapping[str, Any], uri: str | None) -> dict[str, Any]:
    """Check ``uri``'s form and read ``s3``, ``credentialsSecretRef`` and ``cache``."""
    path = "spec.model"
    if uri is not None and not (HF_URI.match(uri) or S3_URI.match(uri) or PVC_URI.match(uri)):
        raise SpecError(f"{path}.uri must be {URI_FORMS}, got {uri!r}")
    remote = uri is not None and not uri.startswith("pvc://")
    s3 = field_value(raw, "s3", path, dict)
    if s3 is not None and not (uri or "").startswith("s3://"):
        raise SpecError(f"{path}.s3 applies to an s3:// {path}.uri only")
    endpoint = field_value(s3 or {}, "endpoint", f"{path}.s3", str)
    if endpoint is not None and not re.match(r"^https?://[^\s/]+", endpoint):
        raise SpecError(f"{path}.s3.endpoint must be an http:// or https:// URL, got {endpoint!r}")
    region = field_value(s3 or {}, "region", f"{path}.s3", str)
    ref = field_value(raw, "credentialsSecretRef", path, dict)
    secret = None
    if ref is not None:
        if not remote:
            raise SpecError(
                f"{path}.credentialsSecretRef applies to an hf:// or s3:// {path}.uri only"
            )
        secret = field_value(ref, "name", f"{path}.credentialsSecretRef", str, required=True)
        if len(secret) > 253 or not SECRET_NAME.match(secret):
            raise SpecError(
                f"{path}.credentialsSecretRef.name must be a Secret name (lowercase letters, "
                f"digits, '-', '.'; at most 253 characters), got {secret!r}"
            )
    cache = field_value(raw, "cache", path, dict)
    if cache is not None and not remote:
        raise SpecError(f"{path}.cache applies to an hf:// or s3:// {path}.uri only")
    cache_volume = field_value(cache or {}, "volume", f"{path}.cache", dict)
    if cache_volume is not None and len(cache_volume) != 1:
        raise SpecError(
            f"{path}.cache.volume must hold exactly one volume source, got {sorted(cache_volume)}"
        )
    max_bytes = int_in(cache or {}, "maxBytes", f"{path}.cache", 0, 0, 1 << 62)
    return {
        "s3_endpoint": endpoint,
        "s3_region": region,
        "credentials_secret": secret,
        "cache_volume": cache_volume,
        "cache_max_bytes": max_bytes,
    }
