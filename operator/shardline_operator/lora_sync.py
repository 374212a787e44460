"""``spec.loraAdapters`` on running groups: plan (pure), then load/unload on each group leader.

A group starts with the adapters of its pod template (``--lora-paths``); afterwards every pass
compares what each Ready leader serves (``GET /v1/models``: cards with a ``parent``) with the
spec and calls ``POST /unload_lora_adapter`` / ``POST /load_lora_adapter``, so adapters are
added and removed in place, without a pod restart. ``status.loraAdapters`` reports, per spec
adapter, how many groups have it loaded and the last error a leader returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .observed import GroupObservation
from .rollout_executor import leader_url
from .spec import LoRAAdapterSpec


@runtime_checkable
class LoRALeaderClient(Protocol):
    def lora_adapters(self, url: str) -> Mapping[str, str] | None:
        """``{name: path}`` the leader serves, or None when unreachable."""

    def load_lora_adapter(self, url: str, name: str, path: str) -> tuple[bool, str]:
        """``POST {url}/load_lora_adapter``: ``(success, message)``."""

    def unload_lora_adapter(self, url: str, name: str) -> tuple[bool, str]:
        """``POST {url}/unload_lora_adapter``: ``(success, message)``."""


@dataclass(frozen=True)
class LoRAPlan:
    unload: tuple[str, ...]
    load: tuple[LoRAAdapterSpec, ...]


def plan(desired: tuple[LoRAAdapterSpec, ...], loaded: Mapping[str, str]) -> LoRAPlan:
    """Unload what the spec no longer names (or names with another path, which is then
    reloaded), then load what is missing, in spec order."""
    want = {a.name: a.path for a in desired}
    unload = tuple(n for n, p in loaded.items() if want.get(n) != p)
    load = tuple(a for a in desired if loaded.get(a.name) != a.path)
    return LoRAPlan(unload, load)


@dataclass
class LoRAReport:
    """Per adapter name: groups that have it loaded, and the last error seen this pass."""

    loaded_groups: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    pending: bool = False  # some leader could not be reached or refused: pass again soon


def sync(
    desired: tuple[LoRAAdapterSpec, ...],
    groups: list[GroupObservation],
    client: LoRALeaderClient,
    skip: AbstractSet[int] = frozenset(),
) -> LoRAReport:
    """Bring every Ready leader (groups not in ``skip``, e.g. one updating weights) to ``desired``."""
    report = LoRAReport({a.name: 0 for a in desired})
    for group in groups:
        url = leader_url(group)
        if group.index in skip or not group.ready or url is None:
            report.pending = report.pending or bool(desired)
            continue
        loaded = client.lora_adapters(url)
        if loaded is None:
            report.pending = True
            continue
        loaded = dict(loaded)
        steps = plan(desired, loaded)
        for name in steps.unload:
            ok, message = client.unload_lora_adapter(url, name)
            if ok:
                loaded.pop(name, None)
            else:
                report.pending = True
                report.errors[name] = f"group {group.index}: unload: {message}"
        for adapter in steps.load:
            if adapter.name in loaded:
                continue  # its unload (path change) failed above
            ok, message = client.load_lora_adapter(url, adapter.name, adapter.path)
            if ok:
                loaded[adapter.name] = adapter.path
            else:
                report.pending = True
                report.errors[adapter.name] = f"group {group.index}: {message}"
        for a in desired:
            if loaded.get(a.name) == a.path:
                report.loaded_groups[a.name] += 1
    return report


def lora_status(desired: tuple[LoRAAdapterSpec, ...], report: LoRAReport) -> list[dict[str, Any]]:
    """``status.loraAdapters``: one entry per spec adapter, in spec order."""
    out = []
    for a in desired:
        entry: dict[str, Any] = {
            "name": a.name,
            "path": a.path,
            "loadedGroups": report.loaded_groups.get(a.name, 0),
        }
        if a.name in report.errors:
            entry["error"] = report.errors[a.name]
        out.append(entry)
    return out
