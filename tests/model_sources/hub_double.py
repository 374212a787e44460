"""A local HTTP server speaking the part of the Hugging Face Hub API that
``huggingface_hub.snapshot_download`` and ``HfApi.verify_repo_checksums`` use (the one test
double the issue allows: the Hub cannot run here).

Routes, as the Hub answers them (huggingface_hub 2.x ``hf_api.py`` / ``file_download.py``):

- ``GET /api/models/{org}/{name}[/revision/{rev}]``: ``id``, ``sha`` (the commit) and ``siblings``;
- ``GET /api/models/{org}/{name}/tree/{rev}``: the files, each with ``oid`` (git blob sha1),
  ``size`` and, for LFS files, ``lfs: {oid: sha256, size, pointerSize}``;
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``: a small file answers 200 with ``ETag`` (its blob
  sha1) and ``X-Repo-Commit``; an LFS file answers 302 to another origin (``localhost`` for
  ``127.0.0.1``, as the Hub sends to its CDN) with ``X-Linked-Etag`` (sha256), ``X-Linked-Size``
  and ``X-Repo-Commit``, so the client stops at the redirect for metadata and follows it to read;
- ``GET /cdn/{sha256}``: the LFS bytes, honouring ``Range`` (resume);
- errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) and
  a private repository answers 401 without the right ``Authorization: Bearer`` token.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".model")


def git_blob_sha1(data: bytes) -> str:
    """Git's blob id: sha1 of ``b"blob <len>\\0" + data`` (what the Hub lists as ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class HubRepo:
    """One repository: ``commits`` (sha -> {path: bytes}), ``refs`` (branch/tag -> sha),
    ``token`` (required when set), ``corrupt`` (paths whose served bytes differ by one byte from
    what the listing describes)."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None
    corrupt: set[str] = field(default_factory=set)

    def commit(self, files: dict[str, bytes], ref: str = "main") -> str:
        """Add a commit holding ``files``, point ``ref`` at it; returns its 40-hex sha."""
        digest = hashlib.sha1(
            json.dumps({k: git_blob_sha1(v) for k, v in sorted(files.items())}).encode()
            + str(len(self.commits)).encode(),
            usedforsecurity=False,
        ).hexdigest()
        self.commits[digest] = dict(files)
        self.refs[ref] = digest
        return digest

    def resolve(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


class HubDouble:
    """The server; ``repos`` maps ``org/name`` to a :class:`HubRepo`. ``requests`` logs
    ``(method, path)`` of every request, to check what the client really did."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}/cdn"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def blob(self, sha256: str) -> tuple[bytes, bool] | None:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for path, data in files.items():
                    if hashlib.sha256(data).hexdigest() == sha256:
                        return data, path in repo.corrupt
        return None


def _is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


def _tree_entry(path: str, data: bytes) -> dict:
    entry: dict = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
    if _is_lfs(path):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/.*)?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: HubDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            return None

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        def _route(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path))
            if path.startswith("/cdn/"):
                return self._cdn(path[len("/cdn/") :], head)
            api, resolve = _API.match(path), _RESOLVE.match(path)
            match = api or resolve
            if match is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
            repo = hub.repos.get(match.group(1))
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                given = self.headers.get("Authorization") is not None
                message = "Invalid credentials in Authorization header" if given else "Unauthorized"
                return self._send(401, b"", {"X-Error-Message": message})
            rev = (match.group(3) or "main") if api else match.group(2)
            commit = repo.resolve(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            files = repo.commits[commit]
            if api and api.group(2) != "tree":
                siblings = [{"rfilename": p, "size": len(d)} for p, d in sorted(files.items())]
                body = {"id": match.group(1), "modelId": match.group(1), "sha": commit,
                        "siblings": siblings, "private": bool(repo.token)}
                return self._json(body)
            if api:
                return self._json([_tree_entry(p, d) for p, d in sorted(files.items())])
            return self._resolve(commit, files, match.group(3), head)

        def _resolve(self, commit: str, files: dict[str, bytes], name: str, head: bool) -> None:
            data = files.get(name)
            if data is None:
                return self._error(404, "EntryNotFound", f"{name} not found")
            headers = {"X-Repo-Commit": commit}
            if _is_lfs(name):
                sha256 = hashlib.sha256(data).hexdigest()
                headers |= {"Location": f"{hub.cdn}/{sha256}", "X-Linked-Etag": f'"{sha256}"',
                            "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_sha1(data)}"'}
                return self._send(302, b"", headers, head)
            headers["ETag"] = f'"{git_blob_sha1(data)}"'
            return self._send(200, data, headers, head)

        def _cdn(self, sha256: str, head: bool) -> None:
            found = hub.blob(sha256)
            if found is None:
                return self._send(404, b"", {})
            data, corrupt = found
            if corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            ranged = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            if ranged:
                start = int(ranged.group(1))
                headers = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
                return self._send(206, data[start:], headers | {"ETag": f'"{sha256}"'}, head)
            return self._send(200, data, {"ETag": f'"{sha256}"'}, head)

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            headers = {"X-Error-Code": code, "X-Error-Message": message,
                       "Content-Type": "application/json"}
            self._send(status, body, headers)

        def _json(self, body: object) -> None:
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and self.command != "HEAD":
                self.wfile.write(body)

    return Handler
