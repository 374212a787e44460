"""Fetch every object under an S3 prefix, through boto3, verified against the listing.

The listing (``ListObjectsV2``) fixes the revision: its (key, ETag, size) set is digested into
``etags-<sha256[:16]>``, the cache key, so a changed object is a new revision. Each object is
written to ``<name>.incomplete`` and resumed with a ``Range`` request after an interruption; when
whole its size must equal the listing's and its content must give the listed ETag: the MD5 of the
body for a single-part upload, or, for a multipart ETag ``<hex>-<N>``, the MD5 of the N parts'
MD5s, the part size read back with ``HeadObject(PartNumber=1)`` (how S3 computes it; the
approach of ``s3-etag`` checkers). Endpoint, region and keys come from the environment as boto3
reads them; a custom endpoint is addressed path-style (MinIO, versitygw, SeaweedFS).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardline_runtime.model_loader.errors import ModelSourceError, SourceErrors
from shardline_runtime.model_loader.model_source import Progress
from shardline_runtime.model_loader.revision_cache import revision_key, stage_revision

CHUNK = 1 << 20  # also the progress (and rate cap) granularity


def s3_client() -> Any:
    """A boto3 S3 client configured from the environment (path-style with a custom endpoint)."""
    import boto3
    from botocore.config import Config

    custom = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        s3={"addressing_style": "path" if custom else "auto"},
        retries={"max_attempts": 3, "mode": "standard"},
    )
    # A new session reads the environment now (boto3's default session caches credentials).
    return boto3.session.Session().client("s3", config=config)


def list_prefix(client: Any, bucket: str, prefix: str) -> dict[str, tuple[str, int]]:
    """Map each file under ``prefix/`` (its name relative to the prefix) to (ETag, size).

    Raises:
        ModelSourceError: ``NotFound`` (no bucket, or nothing under the prefix),
            ``Unauthorized`` (403 / bad keys), ``FetchFailed``.
    """
    where = f"s3://{bucket}/{prefix}"
    found: dict[str, tuple[str, int]] = {}
    with _s3_errors(where):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) + 1 :]
                if name and not name.endswith("/"):
                    found[name] = (obj["ETag"].strip('"'), int(obj["Size"]))
    if not found:
        raise ModelSourceError(f"{where}: no objects under this prefix", "NotFound")
    return found


def listing_digest(listing: dict[str, tuple[str, int]]) -> str:
    """``etags-<16 hex>``: the sha256 of the sorted (name, ETag, size) lines of a listing."""
    text = "".join(f"{name}\t{etag}\t{size}\n" for name, (etag, size) in sorted(listing.items()))
    return "etags-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def fetch_s3(
    bucket: str, prefix: str, root: Path, progress: Progress | None = None
) -> tuple[Path, str]:
    """Download ``s3://bucket/prefix/`` into the cache under ``root``; return (the revision's
    directory, the listing digest).

    Raises:
        ModelSourceError: ``NotFound``, ``Unauthorized``, ``ChecksumMismatch`` (size or ETag
            differs from the listing; the bad file is deleted), ``FetchFailed``.
    """
    client = s3_client()
    listing = list_prefix(client, bucket, prefix)
    if not any(name.endswith(".safetensors") for name in listing):
        raise ModelSourceError(
            f"s3://{bucket}/{prefix}: no *.safetensors object; Shardline loads safetensors only",
            "NotAModel",
        )
    digest = listing_digest(listing)
    total = sum(size for _, size in listing.values())

    def fill(partial: Path) -> None:
        done = 0
        for name, (etag, size) in sorted(listing.items()):
            target = partial / name
            if not target.is_file():
                base = done

                def written(have: int, base: int = base) -> None:
                    if progress is not None:
                        progress(base + have, total)

                _download(client, bucket, f"{prefix}/{name}", target, size, written)
                _verify(client, bucket, f"{prefix}/{name}", target, etag, size)
            done += size
            if progress is not None:
                progress(done, total)

    verified = {"uri": f"s3://{bucket}/{prefix}", "resolvedRevision": digest}
    key = revision_key("s3", bucket, prefix, digest)
    return stage_revision(root, key, fill, verified), digest


def _download(
    client: Any,
    bucket: str,
    key: str,
    target: Path,
    size: int,
    written: Callable[[int], None] | None = None,
) -> None:
    """Write ``key`` to ``target`` through ``target.incomplete``, resuming what is there;
    ``written(bytes of the file on disk)`` after each :data:`CHUNK`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    incomplete = target.with_name(target.name + ".incomplete")
    have = incomplete.stat().st_size if incomplete.exists() else 0
    if have > size:
        incomplete.unlink()
        have = 0
    if have < size:
        extra = {"Range": f"bytes={have}-"} if have else {}
        with _s3_errors(f"s3://{bucket}/{key}"), open(incomplete, "ab") as out:
            body = client.get_object(Bucket=bucket, Key=key, **extra)["Body"]
            for chunk in iter(lambda: body.read(CHUNK), b""):
                out.write(chunk)
                have += len(chunk)
                if written is not None:
                    written(have)
    else:
        incomplete.touch()
    os.rename(incomplete, target)


def _verify(client: Any, bucket: str, key: str, path: Path, etag: str, size: int) -> None:
    actual_size = path.stat().st_size
    part_size = None
    if "-" in etag:
        with _s3_errors(f"s3://{bucket}/{key}"):
            part_size = int(
                client.head_object(Bucket=bucket, Key=key, PartNumber=1)["ContentLength"]
            )
    actual = file_etag(path, part_size)
    if actual_size != size or actual != etag:
        path.unlink()
        raise ModelSourceError(
            f"s3://{bucket}/{key}: downloaded {actual_size} bytes with ETag {actual}, the listing "
            f"says {size} bytes with ETag {etag}",
            "ChecksumMismatch",
        )


def file_etag(path: Path, part_size: int | None = None) -> str:
    """S3's ETag of a file's content: hex MD5 (single part), or with ``part_size`` the hex MD5 of
    the concatenated binary MD5s of each ``part_size`` part, then ``-<parts>`` (multipart)."""
    with open(path, "rb") as f:
        if part_size is None:
            whole = hashlib.md5(usedforsecurity=False)
            for chunk in iter(lambda: f.read(CHUNK), b""):
                whole.update(chunk)
            return whole.hexdigest()
        digests = [
            hashlib.md5(part, usedforsecurity=False).digest()
            for part in iter(lambda: f.read(part_size), b"")
        ]
    combined = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
    return f"{combined}-{len(digests)}"


class _s3_errors(SourceErrors):
    """Turn botocore's errors into ``ModelSourceError`` with a reason code."""

    def translate(self, exc: BaseException) -> None:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            FlexibleChecksumError,
            NoCredentialsError,
        )

        if isinstance(exc, FlexibleChecksumError):  # the server's CRC of the body disagrees
            raise ModelSourceError(f"{self.where}: {exc}", "ChecksumMismatch") from exc

        if isinstance(exc, NoCredentialsError):
            raise ModelSourceError(
                f"{self.where}: no S3 credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
                "Unauthorized",
            ) from exc
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchBucket", "NoSuchKey", "404") or status == 404:
                raise ModelSourceError(f"{self.where}: {code or 'not found'}", "NotFound") from exc
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId"):
                raise ModelSourceError(
                    f"{self.where}: access refused ({code}); check the credentials Secret",
                    "Unauthorized",
                ) from exc
            raise ModelSourceError(f"{self.where}: {exc}", "FetchFailed") from exc
        if isinstance(exc, BotoCoreError | OSError):
            raise ModelSourceError(f"{self.where}: {exc}", "FetchFailed") from exc
