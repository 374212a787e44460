"""A small Kubernetes REST client (httpx, bearer token) for the local cluster's own tooling.

The control-plane starter and the node agent need a handful of calls (create, patch status,
delete, list, watch, TokenRequest); a thin client keeps their behaviour explicit.
"""
from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml


class ApiError(RuntimeError):
    """An API call answered with an HTTP error; ``status`` is the HTTP code."""

    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status


class RestClient:
    """Bearer-token client for one API server.

    Args:
        server: ``https://127.0.0.1:<port>``.
        token: bearer token.
        ca_cert: PEM file of the CA that signed the serving certificate.
    """

    def __init__(self, server: str, token: str, ca_cert: Path | str, timeout: float = 30.0):
        self.server = server.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.ca_cert = str(ca_cert)
        self._verify = ssl.create_default_context(cafile=self.ca_cert)
        self._client = httpx.Client(base_url=self.server, headers=self._headers,
                                    verify=self._verify, timeout=timeout)

    @classmethod
    def from_kubeconfig(cls, path: Path | str) -> RestClient:
        """Build from a kubeconfig written by ``pki.write_kubeconfig`` (token + CA file)."""
        cfg = yaml.safe_load(Path(path).read_text())
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        return cls(cluster["server"], user["token"], cluster["certificate-authority"])

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, body: Any = None, *,
                params: dict | None = None, content_type: str = "application/json",
                ok_missing: bool = False) -> dict | None:
        """One call; returns the decoded JSON body, or None for 404 when ``ok_missing``.

        Raises ApiError on any other HTTP error status.
        """
        headers = {"Content-Type": content_type} if body is not None else {}
        data = json.dumps(body) if body is not None else None
        resp = self._client.request(method, path, content=data, params=params, headers=headers)
        if resp.status_code == 404 and ok_missing:
            return None
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, method, path, resp.text)
        return resp.json() if resp.content else {}

    def get(self, path: str, **kw) -> dict | None:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw) -> dict | None:
        return self.request("POST", path, body, **kw)

    def delete(self, path: str, body: Any = None, **kw) -> dict | None:
        return self.request("DELETE", path, body, **kw)

    def merge_patch(self, path: str, body: Any) -> dict | None:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def strategic_patch(self, path: str, body: Any) -> dict | None:
        return self.request("PATCH", path, body,
                            content_type="application/strategic-merge-patch+json")

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60,
              params: dict | None = None) -> Iterator[dict]:
        """Yield watch events ``{"type", "object"}`` until the server closes the stream.

        Raises ApiError on an HTTP error (410 Gone means relist).
        """
        query = dict(params or {}, watch="true", resourceVersion=resource_version,
                     timeoutSeconds=str(timeout_seconds), allowWatchBookmarks="true")
        with httpx.Client(base_url=self.server, headers=self._headers, verify=self._verify,
                          timeout=httpx.Timeout(10.0, read=timeout_seconds + 15)) as c:
            with c.stream("GET", path, params=query) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise ApiError(resp.status_code, "WATCH", path, resp.text)
                for line in resp.iter_lines():
                    if line.strip():
                        yield json.loads(line)
