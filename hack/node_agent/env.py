"""Container environment as kubelet builds it: ``envFrom``, ``env`` with downward-API
``fieldRef``/``resourceFieldRef``, ConfigMap/Secret keys, and ``$(VAR)`` expansion of env
values, command and args (kubelet's ``third_party/forked/golang/expansion`` rules)."""
from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

# fetch(kind, namespace, name) -> the object's "data" dict (Secret data still base64), or None
Fetch = Callable[[str, str, str], "dict | None"]


class EnvError(ValueError):
    """A container's env cannot be built (kubelet reports CreateContainerConfigError)."""


def expand(text: str, mapping: Mapping[str, str]) -> str:
    """Kubelet's expansion: ``$(NAME)`` -> value when NAME is defined, else left verbatim;
    ``$$`` -> ``$`` (so ``$$(NAME)`` is the literal ``$(NAME)``); any other ``$`` is kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close == -1:
                out.append(text[i:])
                break
            name = text[i + 2:close]
            out.append(mapping[name] if name in mapping else f"$({name})")
            i = close + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


_LABEL_REF = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_ref(pod: dict, path: str) -> str:
    """Value of a downward-API ``fieldRef.fieldPath`` for ``pod`` (the object with status
    already carrying podIP/hostIP). Raises EnvError for an unsupported path."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""), "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs", [])),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs", [])),
    }
    if path in simple:
        return simple[path]
    m = _LABEL_REF.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise EnvError(f"unsupported fieldRef.fieldPath {path!r}")


def _resource_ref(container: dict, ref: dict) -> str:
    resource = ref["resource"]
    kind, _, name = resource.partition(".")
    value = (container.get("resources", {}).get(kind) or {}).get(name)
    if value is None:  # kubelet falls back to node allocatable; the fake nodes have 16 CPUs
        value = {"cpu": "16", "memory": str(64 << 30)}.get(name, "0")
    return str(value)


def _key_ref(fetch: Fetch, kind: str, namespace: str, ref: dict) -> str | None:
    data = fetch(kind, namespace, ref["name"])
    optional = ref.get("optional", False)
    if data is None or ref["key"] not in data:
        if optional:
            return None
        raise EnvError(f"{kind} {namespace}/{ref['name']} key {ref['key']!r} not found")
    value = data[ref["key"]]
    return base64.b64decode(value).decode() if kind == "Secret" else value


def container_env(pod: dict, container: dict, fetch: Fetch) -> dict[str, str]:
    """The env a container gets from its pod spec, in kubelet's order (envFrom, then env,
    each value expanded against the variables defined before it). Raises EnvError."""
    ns = pod["metadata"].get("namespace", "default")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in source:
                continue
            ref = source[key]
            data = fetch(kind, ns, ref["name"])
            if data is None:
                if ref.get("optional", False):
                    continue
                raise EnvError(f"envFrom {kind} {ns}/{ref['name']} not found")
            for k, v in data.items():
                env[prefix + k] = base64.b64decode(v).decode() if kind == "Secret" else v
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        if "fieldRef" in src:
            env[name] = field_ref(pod, src["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in src:
            env[name] = _resource_ref(container, src["resourceFieldRef"])
        elif "configMapKeyRef" in src or "secretKeyRef" in src:
            kind, ref = (("ConfigMap", src["configMapKeyRef"]) if "configMapKeyRef" in src
                         else ("Secret", src["secretKeyRef"]))
            value = _key_ref(fetch, kind, ns, ref)
            if value is not None:
                env[name] = value
        else:
            raise EnvError(f"env {name}: unsupported valueFrom {sorted(src)}")
    return env


def container_argv(container: dict, env: Mapping[str, str]) -> list[str]:
    """``command + args`` with ``$(VAR)`` expanded. Raises EnvError without a command (the
    agent has no image to take an entrypoint from)."""
    command = container.get("command") or []
    if not command:
        raise EnvError(f"container {container.get('name')!r} has no command; the node agent "
                       "runs local processes and cannot use an image entrypoint")
    return [expand(a, env) for a in [*command, *container.get("args", [])]]


def empty_dir_paths(pod: dict, container: dict, pod_dir: Path) -> dict[str, str]:
    """``{mountPath: host directory}`` for the container's ``emptyDir`` mounts (not /dev/shm):
    a process on the host cannot see a mount, so each emptyDir is a directory of the pod's
    (``/tmp`` is ``pod_dir`` itself, which keeps ZMQ ``ipc://`` paths under 108 bytes)."""
    empty = {v["name"] for v in pod["spec"].get("volumes", []) if "emptyDir" in v}
    out: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        path = os.path.normpath(mount["mountPath"])
        if mount["name"] not in empty or path == "/dev/shm":
            continue
        host = pod_dir if path == "/tmp" else pod_dir / mount["name"]
        host.mkdir(parents=True, exist_ok=True)
        out[path] = str(host)
    return out


def host_path_paths(pod: dict, container: dict) -> dict[str, str]:
    """``{mountPath: host path}`` for the container's ``hostPath`` mounts: a local process sees
    the host path, so env values under the mount path must name it (e.g. the model cache a
    staging Job and the runtime pods of one node share)."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"].get("volumes", []) if "hostPath" in v}
    return {os.path.normpath(m["mountPath"]): host[m["name"]]
            for m in container.get("volumeMounts", []) if m["name"] in host}


def remap_paths(env: dict[str, str], paths: Mapping[str, str]) -> dict[str, str]:
    """``env`` with each value at or under a mount path (``paths``' keys) moved to its host
    directory: ``HOME=/home/shardline`` becomes ``HOME=<pod dir>/home``."""
    out = dict(env)
    for name, value in env.items():
        for mount, host in paths.items():
            if value == mount or value.startswith(mount + "/"):
                out[name] = host + value[len(mount):]
                break
    return out
