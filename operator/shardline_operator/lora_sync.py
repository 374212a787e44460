"""``spec.loraAdapters`` on running groups: decide the load/unload actions (pure), settle their outcome.

A group starts with the adapters of its pod template (``--lora-paths``); afterwards every pass
compares what each Ready leader serves (``GET /v1/models``: cards with a ``parent``, read by
``observe``) with the spec and plans ``POST /unload_lora_adapter`` / ``POST
/load_lora_adapter`` actions, so adapters are added and removed in place, without a pod
restart; ``execute`` runs them and :func:`settle` folds the failures back in. ``status.loraAdapters`` reports, per spec
adapter, how many groups have it loaded and the last error a leader returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .observed import GroupObservation, pod_url
from .pass_plan import Action, LoadAdapter, LoRADecision, Observation, UnloadAdapter
from .spec import LoRAAdapterSpec

LORA_RETRY_SECONDS = 5.0  # adapters not yet on every group: look again soon


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


def decide_lora(
    desired: tuple[LoRAAdapterSpec, ...],
    groups: Sequence[GroupObservation],
    observed: Observation,
    busy: AbstractSet[int] = frozenset(),
) -> tuple[list[Action], LoRADecision]:
    """The load/unload actions that bring every Ready leader (groups not in ``busy``, e.g. one
    updating weights) to ``desired``, and what each synced group serves once they succeed."""
    actions: list[Action] = []
    after: dict[int, dict[str, str]] = {}
    pending = False
    for group in groups:
        if not observed.lora_client:
            break
        url = pod_url(group.leader)
        if group.index in busy or not group.ready or url is None:
            pending = pending or bool(desired)
            continue
        loaded = group.answers.adapters
        if loaded is None:
            pending = True
            continue
        steps = plan(desired, loaded)
        now = dict(loaded)
        for name in steps.unload:
            actions.append(UnloadAdapter(group.index, url, name))
            now.pop(name, None)
        for adapter in steps.load:
            actions.append(LoadAdapter(group.index, url, adapter.name, adapter.path))
            now[adapter.name] = adapter.path
        after[group.index] = now
    return actions, LoRADecision(desired, after, pending)


@dataclass(frozen=True)
class LoRAOutcome:
    """A pass's adapters after its actions ran: per adapter name, the groups that have it
    loaded, the last error a leader returned, and whether to look again soon."""

    loaded_groups: Mapping[str, int]
    errors: Mapping[str, str]
    pending: bool


def settle(decision: LoRADecision, failures: Mapping[tuple[int, str], str]) -> LoRAOutcome:
    """Fold the failed load/unload actions (``(group, adapter name) -> message``; an unload's
    message starts ``unload:``) into ``decision``: a failed adapter is not loaded there."""
    errors = {name: f"group {group}: {message}" for (group, name), message in failures.items()}
    loaded = {a.name: 0 for a in decision.desired}
    for group, serving in decision.loaded_after.items():
        for a in decision.desired:
            if serving.get(a.name) == a.path and (group, a.name) not in failures:
                loaded[a.name] += 1
    return LoRAOutcome(loaded, errors, decision.pending or bool(failures))


def lora_status(desired: tuple[LoRAAdapterSpec, ...], report: LoRAOutcome) -> list[dict[str, Any]]:
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
