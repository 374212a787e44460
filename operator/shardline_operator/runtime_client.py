"""HTTP calls to a group leader's admin API (``/update_weights_from_disk``, ``/get_server_info``).

An update can take minutes (weight load + graph recapture) and the runtime answers only when
it is done, so the POST runs on a background thread and the reconciler polls it by key.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import httpx

INFO_TIMEOUT_SECONDS = 3.0
PHASE_POLL_SECONDS = 0.1


class HttpLeaderClient:
    """Implements ``rollout.LeaderClient`` over HTTP with a small thread pool."""

    def __init__(self, max_workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="leader-update")
        self._futures: dict[str, Future] = {}
        self._phases: dict[str, list[str]] = {}
        self._samplers: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def start_update(self, key: str, url: str, body: Mapping[str, Any], timeout_seconds: float) -> None:
        """Start ``POST {url}/update_weights_from_disk``; a previous request under ``key`` is forgotten.

        A second thread samples ``weights_phase`` every 0.1 s while the request runs, so phases
        shorter than a reconcile interval are still seen (:meth:`observed_phases`).
        """
        future = self._pool.submit(_post_update, url, dict(body), timeout_seconds)
        sampler = threading.Thread(target=self._sample_phases, args=(key, url, future), daemon=True,
                                   name=f"phases-{key}")
        with self._lock:
            self._futures[key] = future
            self._samplers[key] = sampler
            self._phases[key] = []
        sampler.start()

    def _sample_phases(self, key: str, url: str, future: Future) -> None:
        last = None
        while not future.done():
            phase = (self.server_info(url) or {}).get("weights_phase")
            if phase and phase != last:
                with self._lock:
                    if self._futures.get(key) is not future:
                        return
                    self._phases.setdefault(key, []).append(phase)
                last = phase
            time.sleep(PHASE_POLL_SECONDS)

    def observed_phases(self, key: str) -> list[str]:
        """``weights_phase`` values seen under ``key`` since the last call, in order."""
        with self._lock:
            seen, self._phases[key] = self._phases.get(key, []), []
        return seen

    def poll(self, key: str) -> tuple[str, str]:
        """``(state, message)``: ``pending``, ``success``, ``failure`` or ``unknown`` (no request under key).

        ``pending`` lasts until the phase sampler has also stopped, so a phase it read just
        before the reply is in :meth:`observed_phases` when the result is handed out.
        """
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                return "unknown", ""
            sampler = self._samplers.get(key)
            if not future.done() or (sampler is not None and sampler.is_alive()):
                return "pending", ""
            del self._futures[key]
            self._samplers.pop(key, None)
        success, message = future.result()
        return ("success" if success else "failure"), message

    def server_info(self, url: str) -> Mapping[str, Any] | None:
        """``GET {url}/get_server_info`` as a dict, or None when unreachable or not JSON."""
        try:
            response = httpx.get(f"{url}/get_server_info", timeout=INFO_TIMEOUT_SECONDS)
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _post_update(url: str, body: dict[str, Any], timeout_seconds: float) -> tuple[bool, str]:
    """Send the update and return ``(success, message)``; transport errors count as failures."""
    try:
        response = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=timeout_seconds)
    except httpx.HTTPError as exc:
        return False, f"request to {url} failed: {exc.__class__.__name__}: {exc}"
    try:
        reply = response.json()
    except ValueError:
        return False, f"HTTP {response.status_code} from {url}: {response.text[:200]}"
    if not isinstance(reply, dict):
        return False, f"HTTP {response.status_code} from {url}: unexpected reply {reply!r:.200}"
    if response.status_code >= 400 or not reply.get("success", False):
        message = reply.get("message") or (reply.get("error") or {}).get("message") or str(reply)[:200]
        return False, str(message)
    return True, str(reply.get("message", ""))
