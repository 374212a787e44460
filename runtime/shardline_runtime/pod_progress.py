"""Live download progress as an annotation on the downloading pod itself.

The operator's staging Job runs ``shardline-runtime download``; while it runs, the operator
must see bytes done / total and the rate per node (``status.staging.nodes[]``). The Job's
container merge-patches one annotation, :data:`ANNOTATION`, on its own pod through the
Kubernetes API, at most once per ``interval_seconds``; the operator already lists the staging
pods every pass (for their termination messages), so it reads the progress with no extra
request. This is how Argo's executor reported step outputs (an annotation on its own pod);
reading the pod's log tail instead would cost one API server -> kubelet call per Job per
pass, free-text parsing and a ``pods/log`` grant, and needs a kubelet that keeps logs.

Access: the pod's ServiceAccount token (``/var/run/secrets/kubernetes.io/serviceaccount`` with
``KUBERNETES_SERVICE_HOST`` / ``_PORT``, or a ``KUBECONFIG`` with a token), ``POD_NAME`` and
``POD_NAMESPACE`` from the downward API. The operator binds the staging ServiceAccount to the
chart's ``<release>-staging`` ClusterRole (``get`` and ``patch`` on pods) in the deployment's
namespace. Without any of these, :meth:`PodAnnotator.from_environment` returns None and the
download runs without live progress. A failed patch is logged once and never fails the download.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

ANNOTATION = "shardline.dev/staging-progress"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
INTERVAL_SECONDS = 5.0
TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class ApiAccess:
    """Where the API server is (``server``: ``https://host:port``), the bearer ``token`` and
    the CA bundle (``ca_file`` path, or ``ca_data`` PEM text)."""

    server: str
    token: str
    ca_file: str | None = None
    ca_data: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)


def api_access(env: Mapping[str, str], account_dir: Path = SERVICE_ACCOUNT_DIR) -> ApiAccess | None:
    """The pod's API access: in-cluster (a mounted token) first, then ``KUBECONFIG``'s current
    context when it carries a token; None when there is neither."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    token_file = account_dir / "token"
    if host and token_file.is_file():
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        ca = account_dir / "ca.crt"
        return ApiAccess(server, token_file.read_text().strip(), ca_file=str(ca))
    if env.get("KUBECONFIG"):
        return _kubeconfig_access(Path(env["KUBECONFIG"].split(os.pathsep)[0]))
    return None


def _kubeconfig_access(path: Path) -> ApiAccess | None:
    import base64

    import yaml

    try:
        doc = yaml.safe_load(path.read_text()) or {}
        current = doc.get("current-context")
        ctx = next(c["context"] for c in doc["contexts"] if c["name"] == current)
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in doc["users"] if u["name"] == ctx["user"])
    except (OSError, KeyError, StopIteration, TypeError, yaml.YAMLError):
        return None
    if not user.get("token"):
        return None
    data = cluster.get("certificate-authority-data")
    return ApiAccess(
        cluster["server"],
        user["token"],
        ca_file=cluster.get("certificate-authority"),
        ca_data=base64.b64decode(data).decode() if data else None,
    )


class PodAnnotator:
    """Writes ``{"bytesDone", "bytesTotal", "bytesPerSecond", "updatedAt"}`` (bytes, bytes/s,
    RFC 3339) into :data:`ANNOTATION` of pod ``namespace/pod``, at most once per
    ``interval_seconds`` (the first report is sent at once)."""

    def __init__(
        self,
        access: ApiAccess,
        namespace: str,
        pod: str,
        interval_seconds: float = INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.access, self.namespace, self.pod = access, namespace, pod
        self.interval_seconds = interval_seconds
        self.clock = clock
        self.sent = 0
        self._last: float | None = None
        self._failed = False
        self._context = access.ssl_context()

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str] = os.environ, interval_seconds: float = INTERVAL_SECONDS
    ) -> PodAnnotator | None:
        """An annotator for this pod, or None outside a pod that has API access."""
        pod, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE")
        access = api_access(env) if pod and namespace else None
        if access is None or not pod or not namespace:
            return None
        return cls(access, namespace, pod, interval_seconds)

    def report(self, done: int, total: int, bytes_per_second: int, force: bool = False) -> bool:
        """Patch the annotation unless one was sent under ``interval_seconds`` ago (``force``:
        send anyway). Returns whether a patch was sent and accepted."""
        now = self.clock()
        if not force and self._last is not None and now - self._last < self.interval_seconds:
            return False
        self._last = now
        record = {
            "bytesDone": done,
            "bytesTotal": total,
            "bytesPerSecond": bytes_per_second,
            "updatedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        body = {"metadata": {"annotations": {ANNOTATION: json.dumps(record, sort_keys=True)}}}
        request = urllib.request.Request(
            f"{self.access.server}/api/v1/namespaces/{self.namespace}/pods/{self.pod}",
            data=json.dumps(body).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.access.token}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS, context=self._context):
                pass
        except OSError as exc:  # URLError and HTTPError are OSErrors
            if not self._failed:
                print(f"staging progress: cannot annotate pod {self.pod}: {exc}", file=sys.stderr)
            self._failed = True
            return False
        self.sent += 1
        return True
