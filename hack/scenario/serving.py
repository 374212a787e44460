"""Reach a TP group leader (rank-0 pod ``<name>-g<group>-0``) at ``http://<podIP>:8000``, as
the operator does, and talk to it with the OpenAI client."""
from __future__ import annotations

import base64

import httpx

from hack.localcluster.rest import RestClient

HTTP_PORT = 8000


def leader_ip(client: RestClient, namespace: str, name: str, group: int = 0) -> str:
    """podIP of group ``group``'s rank-0 pod. Raises RuntimeError if it has none yet."""
    pod = client.get(f"/api/v1/namespaces/{namespace}/pods/{name}-g{group}-0")
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        raise RuntimeError(f"pod {namespace}/{name}-g{group}-0 has no podIP yet")
    return ip


def admin_headers(client: RestClient, namespace: str, name: str) -> dict[str, str]:
    """``Authorization`` header with the deployment's admin token (Secret ``<name>-admin-token``,
    created by the operator), for calls to the control endpoints a user makes by hand."""
    secret = client.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-admin-token")
    return {"Authorization": f"Bearer {base64.b64decode(secret['data']['token']).decode()}"}


def chat(ip: str, model: str, prompt: str, max_tokens: int = 12, api_key: str | None = None) -> str:
    """Greedy chat completion (temperature 0) from the leader at ``ip``; returns the text.

    ``api_key`` is the deployment's serving key (``spec.auth.apiKeySecretRef``), if it has one.
    Raises ``openai.AuthenticationError`` when the leader refuses the key.
    """
    from openai import OpenAI

    api = OpenAI(base_url=f"http://{ip}:{HTTP_PORT}/v1", api_key=api_key or "unused", timeout=120,
                 max_retries=0)
    resp = api.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                       messages=[{"role": "user", "content": prompt}])
    return resp.choices[0].message.content or ""


def server_info(ip: str, api_key: str | None = None) -> dict:
    """The leader's ``/get_server_info`` (weights_phase, weights_revision, model_path, ...)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"http://{ip}:{HTTP_PORT}/get_server_info", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()
