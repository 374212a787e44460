"""An in-memory stand-in for ``kube.KubeClient`` and the StatefulSet controller (tests only)."""

from __future__ import annotations

import copy
import itertools

from shardline_operator import labels
from shardline_operator.kube import KubeError

_uids = itertools.count(1)


class FakeKube:
    """Objects by (kind, namespace, name); ``statuses`` records every status patch."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.statuses: list[dict] = []
        self.deleted: list[tuple[str, str]] = []

    def apply(self, obj):
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        stored = copy.deepcopy(obj)
        stored["metadata"]["uid"] = self.objects.get(key, {}).get("metadata", {}).get("uid") or f"uid-{next(_uids)}"
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def create(self, obj):
        meta = obj["metadata"]
        if (obj["kind"], meta["namespace"], meta["name"]) in self.objects:
            return None
        return self.apply(obj)

    def get(self, api_version, kind, namespace, name):
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, api_version, kind, namespace, selector):
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and ns == namespace
                and all((o["metadata"].get("labels") or {}).get(a) == b for a, b in selector.items())]

    def delete(self, api_version, kind, namespace, name, uid=None):
        key = (kind, namespace, name)
        if key not in self.objects or (uid and self.objects[key]["metadata"]["uid"] != uid):
            return False
        del self.objects[key]
        self.deleted.append((kind, name))
        return True

    def merge_patch(self, api_version, kind, namespace, name, patch, subresource=None):
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            raise KubeError(404, f"{kind} {name} not found")
        obj["metadata"].setdefault("labels", {}).update(patch.get("metadata", {}).get("labels", {}))
        return copy.deepcopy(obj)

    def patch_deployment_status(self, namespace, name, status):
        self.statuses.append(copy.deepcopy(status))
        return {}

    # --- the StatefulSet controller and kubelet, as far as the tests need them
    def run_statefulsets(self, namespace="default", ready=True):
        """Create the missing pods of every StatefulSet from its current template."""
        for (kind, ns, name), sts in list(self.objects.items()):
            if kind != "StatefulSet" or ns != namespace:
                continue
            template = sts["spec"]["template"]
            for rank in range(sts["spec"]["replicas"]):
                pod_name = f"{name}-{rank}"
                if ("Pod", ns, pod_name) in self.objects:
                    continue
                meta = copy.deepcopy(template["metadata"])
                meta["labels"][labels.LABEL_POD_INDEX] = str(rank)
                meta.update(name=pod_name, namespace=ns, uid=f"pod-{next(_uids)}")
                self.objects[("Pod", ns, pod_name)] = {
                    "metadata": meta, "spec": copy.deepcopy(template["spec"]),
                    "status": {"phase": "Running", "podIP": f"127.0.{meta['labels'].get(labels.LABEL_GROUP, '0')}.{rank + 2}",
                               "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                               "containerStatuses": [{"name": "runtime", "restartCount": 0, "state": {"running": {}}}]}}

    def set_ready(self, pod_name, ready=True, namespace="default"):
        pod = self.objects[("Pod", namespace, pod_name)]
        pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]

    def pods(self, namespace="default"):
        return {name: o for (k, ns, name), o in self.objects.items() if k == "Pod" and ns == namespace}
