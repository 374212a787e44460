"""The operator's only Kubernetes API client: server-side apply, list, delete, status patches.

Uses the ``kubernetes`` package for configuration and authentication (in-cluster service
account first, then ``KUBECONFIG`` / ``~/.kube/config``) and its REST layer for requests;
objects are plain dicts, as rendered.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.config.config_exception import ConfigException

from . import labels

REQUEST_TIMEOUT_SECONDS = 30
# (apiVersion, kind) -> (API prefix, plural)
RESOURCES = {
    ("v1", "Service"): ("/api/v1", "services"),
    ("v1", "Pod"): ("/api/v1", "pods"),
    ("v1", "Secret"): ("/api/v1", "secrets"),
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): (
        "/apis/rbac.authorization.k8s.io/v1",
        "rolebindings",
    ),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("/apis/networking.k8s.io/v1", "networkpolicies"),
    ("apps/v1", "StatefulSet"): ("/apis/apps/v1", "statefulsets"),
    ("batch/v1", "Job"): ("/apis/batch/v1", "jobs"),
    ("policy/v1", "PodDisruptionBudget"): ("/apis/policy/v1", "poddisruptionbudgets"),
    ("discovery.k8s.io/v1", "EndpointSlice"): ("/apis/discovery.k8s.io/v1", "endpointslices"),
    (f"{labels.API_GROUP}/{labels.API_VERSION}", labels.KIND): (
        f"/apis/{labels.API_GROUP}/{labels.API_VERSION}",
        labels.PLURAL,
    ),
}


class KubeError(RuntimeError):
    """An API request failed; ``status`` is the HTTP status (0 for transport errors)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def load_configuration() -> client.Configuration:
    """In-cluster config when running in a pod, else the kubeconfig (``KUBECONFIG``)."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


def resource_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """REST path of a namespaced collection (``name=None``) or object.

    Raises:
        KeyError: the kind is not one the operator manages (see :data:`RESOURCES`).
    """
    prefix, plural = RESOURCES[(api_version, kind)]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeClient:
    """Thin synchronous client; every method raises :class:`KubeError` on an API error."""

    def __init__(self, configuration: client.Configuration | None = None) -> None:
        self._api = client.ApiClient(configuration or load_configuration())

    def request(
        self,
        method: str,
        path: str,
        query: Iterable[tuple[str, Any]] = (),
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """Send one request; returns the decoded JSON body ({} when empty)."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, post = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list(query) or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self._api.call_api(
                method, url, headers, body, post, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
            response.read()
        except client.ApiException as exc:
            raise KubeError(exc.status or 0, str(exc.body or exc.reason)) from exc
        except Exception as exc:  # urllib3 transport errors have no common public base here
            raise KubeError(0, f"{exc.__class__.__name__}: {exc}") from exc
        text = response.data.decode() if response.data else ""
        if response.status >= 400:
            try:
                text = json.loads(text).get("message", text)
            except ValueError:
                pass
            raise KubeError(response.status, text)
        return json.loads(text) if text else {}

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` with field manager ``shardline-operator`` (force: we own these)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self.request(
            "PATCH",
            path,
            [("fieldManager", labels.FIELD_MANAGER), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create ``obj``; None when an object of that name exists already (it is left as is)."""
        meta = obj["metadata"]
        try:
            return self.request(
                "POST",
                resource_path(obj["apiVersion"], obj["kind"], meta["namespace"]),
                body=dict(obj),
            )
        except KubeError as exc:
            if exc.status == 409:
                return None
            raise

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects of ``kind`` in ``namespace`` matching the label ``selector``."""
        reply = self.request(
            "GET",
            resource_path(api_version, kind, namespace),
            [("labelSelector", labels.label_selector_string(dict(selector)))],
        )
        return list(reply.get("items") or [])

    def delete(
        self, api_version: str, kind: str, namespace: str, name: str, uid: str | None = None
    ) -> bool:
        """Delete one object (background propagation); False when it was already gone.

        With ``uid`` the deletion only happens if the object is still that incarnation.
        """
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name), body=body)
        except KubeError as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """JSON merge patch of an object (or of its ``status`` subresource)."""
        path = resource_path(api_version, kind, namespace, name)
        if subresource:
            path = f"{path}/{subresource}"
        return self.request(
            "PATCH", path, body=dict(patch), content_type="application/merge-patch+json"
        )

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ``InferenceDeployment`` as stored now, or None when it is gone."""
        path = resource_path(
            f"{labels.API_GROUP}/{labels.API_VERSION}", labels.KIND, namespace, name
        )
        try:
            return self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def patch_deployment_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch ``status`` of an ``InferenceDeployment`` (None values delete fields)."""
        return self.merge_patch(
            f"{labels.API_GROUP}/{labels.API_VERSION}",
            labels.KIND,
            namespace,
            name,
            {"status": dict(status)},
            subresource="status",
        )
