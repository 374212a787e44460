"""HTTP calls to a group leader's admin API (``/update_weights_from_disk``,
``/abort_weight_update``, ``/get_server_info``).

An update can take minutes (weight load + graph recapture) and the runtime answers only when
it is done, so the POST runs on a background thread and the reconciler polls it by key.
Control and info calls carry the deployment's admin token as ``Authorization: Bearer``; the
canary gate calls serving endpoints (``/health_generate``, ``/v1/completions``), which the
runtime opens only to the API key, so it carries the deployment's API key instead
(:meth:`HttpLeaderClient.with_token`). Tested against a real runtime with both keys set in
``tests/serving/test_operator_calls_with_keys.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from .return_check import ReturnChecks

INFO_TIMEOUT_SECONDS = 3.0
GATE_TIMEOUT_SECONDS = 30.0
LORA_TIMEOUT_SECONDS = 30.0
ABORT_TIMEOUT_SECONDS = 900.0  # the runtime answers once the update ended (committed or not)
PHASE_POLL_SECONDS = 0.1
logger = logging.getLogger(__name__)


class HttpLeaderClient:
    """Implements ``observe.LeaderClient`` over HTTP with a small thread pool.

    ``on_update_end(key)``, when given, is called (from a background thread) as soon as an
    update started under ``key`` has ended and :meth:`poll` hands out its result, so the
    reconciler can run its next pass at once instead of on its polling timer. An update that
    succeeded also starts the group's return-to-routing ``/health_generate`` at once
    (``return_check.py``); :meth:`verify` without a ``verify`` spec takes its result.
    """

    def __init__(
        self, max_workers: int = 4, on_update_end: Callable[[str], None] | None = None
    ) -> None:
        self._on_update_end = on_update_end
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="leader-update")
        self._futures: dict[str, Future] = {}
        self._phases: dict[str, list[str]] = {}
        self._samplers: dict[str, threading.Thread] = {}
        self._seconds: dict[str, dict[str, float]] = {}  # what poll last handed out, per key
        self._aborts: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._returns = ReturnChecks(lambda url, key: self._health_generate(url, key))

    def with_token(self, token: str | None, api_key: str | None = None) -> TokenLeaderClient:
        """This client as a ``rollout.LeaderClient`` that sends the admin ``token`` on control and
        info calls and ``api_key`` (``spec.auth``'s key; the first one of a comma-separated
        rotation list) on the canary gate's serving calls. Without ``api_key`` the gate sends no
        key: the runtime's serving endpoints are then open."""
        return TokenLeaderClient(self, token, api_key)

    def start_update(
        self,
        key: str,
        url: str,
        body: Mapping[str, Any],
        timeout_seconds: float,
        token: str | None = None,
        serving_key: str | None = None,
    ) -> None:
        """Start ``POST {url}/update_weights_from_disk``; a previous request under ``key`` is forgotten.

        A second thread samples ``weights_phase`` every 0.1 s while the request runs, so phases
        shorter than a reconcile interval are still seen (:meth:`observed_phases`); once the
        update succeeded it starts the return check (``/health_generate`` with ``serving_key``).
        """
        self._returns.forget(url)  # a check of the previous update must not return this one
        future = self._pool.submit(_post_update, url, dict(body), timeout_seconds, token)
        sampler = threading.Thread(
            target=self._sample_phases,
            args=(key, url, future, token, serving_key),
            daemon=True,
            name=f"phases-{key}",
        )
        with self._lock:
            self._futures[key] = future
            self._samplers[key] = sampler
            self._phases[key] = []
            self._seconds.pop(key, None)
        sampler.start()

    def _sample_phases(
        self, key: str, url: str, future: Future, token: str | None, serving_key: str | None
    ) -> None:
        last = None
        while not future.done():
            phase = (self.server_info(url, token) or {}).get("weights_phase")
            if phase and phase != last:
                with self._lock:
                    if self._futures.get(key) is not future:
                        return
                    self._phases.setdefault(key, []).append(phase)
                last = phase
            future_or_sleep(future, PHASE_POLL_SECONDS)
        if future.exception() is None and future.result()[0] == "success":
            self._returns.start(url, serving_key)
        if self._on_update_end is not None:
            # poll() answers once this thread has ended: hand over right after it does
            threading.Thread(
                target=_after,
                args=(threading.current_thread(), self._on_update_end, key),
                daemon=True,
            ).start()

    def abort_update(self, key: str, url: str, token: str | None = None) -> None:
        """Send ``POST {url}/abort_weight_update`` in the background, unless one under ``key``
        is still in flight (the runtime answers once the update ended). Its outcome shows in
        :meth:`poll` of the update (``aborted``, or ``success`` when it had committed)."""
        with self._lock:
            running = self._aborts.get(key)
            if running is not None and running.is_alive():
                return
            thread = threading.Thread(
                target=_post_json,
                args=(url, "/abort_weight_update", {}, ABORT_TIMEOUT_SECONDS, token),
                daemon=True,
                name=f"abort-{key}",
            )
            self._aborts[key] = thread
        thread.start()

    def observed_phases(self, key: str) -> list[str]:
        """``weights_phase`` values seen under ``key`` since the last call, in order."""
        with self._lock:
            seen, self._phases[key] = self._phases.get(key, []), []
        return seen

    def poll(self, key: str) -> tuple[str, str]:
        """``(state, message)``: ``pending``, ``success``, ``failure``, ``aborted`` (stopped by
        ``/abort_weight_update`` before it committed) or ``unknown`` (no request under key).

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
        state, message, seconds = future.result()
        with self._lock:
            self._seconds[key] = seconds
        return state, message

    def update_seconds(self, key: str) -> dict[str, float]:
        """``load_seconds`` / ``recapture_seconds`` (floats, seconds) that the runtime reported in
        its reply to the update :meth:`poll` last handed out under ``key``; kept until the next
        update under ``key`` starts, so a success held back until the group is Ready again still
        has them when it counts (empty when it reported none: an older runtime, or a refused or
        unreachable update)."""
        with self._lock:
            return dict(self._seconds.get(key, {}))

    def server_info(self, url: str, token: str | None = None) -> Mapping[str, Any] | None:
        """``GET {url}/get_server_info`` as a dict, or None when unreachable, refused or not JSON."""
        try:
            response = httpx.get(
                f"{url}/get_server_info", headers=_auth(token), timeout=INFO_TIMEOUT_SECONDS
            )
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def _health_generate(self, url: str, token: str | None) -> tuple[bool, str]:
        """``GET {url}/health_generate`` (``token``: the serving key): ``(answered 200, why not)``."""
        try:
            response = httpx.get(
                f"{url}/health_generate", headers=_auth(token), timeout=GATE_TIMEOUT_SECONDS
            )
        except httpx.HTTPError as exc:
            return False, f"/health_generate: {exc.__class__.__name__}: {exc}"
        if response.status_code != 200:
            return (
                False,
                f"/health_generate answered HTTP {response.status_code}: {response.text[:200]}",
            )
        return True, "/health_generate answered 200"

    def verify(self, url: str, verify: Any = None, token: str | None = None) -> tuple[bool, str]:
        """The canary gate: ``GET /health_generate`` must answer 200; then, with ``verify`` (a
        ``spec.VerifySpec``), a greedy ``/v1/completions`` of ``verify.prompt`` must answer 200
        within ``verify.max_latency_seconds``. Returns ``(passed, what failed or took)``.
        ``token`` is the serving (API) key: both calls are serving endpoints. Without ``verify``
        (a return to routing), the check begun as the leader's update succeeded is used when
        there is one (waiting for it if it still runs; ``return_check.py``)."""
        if verify is None:
            early = self._returns.take(url, GATE_TIMEOUT_SECONDS)
            if early is not None:
                return early
        passed, message = self._health_generate(url, token)
        if not passed or verify is None:
            return passed, message
        body = {"prompt": verify.prompt, "max_tokens": verify.max_tokens, "temperature": 0}
        started = time.monotonic()
        try:
            response = httpx.post(
                f"{url}/v1/completions",
                json=body,
                headers=_auth(token),
                timeout=verify.max_latency_seconds + 5,
            )
        except httpx.HTTPError as exc:
            return False, f"verify prompt: {exc.__class__.__name__}: {exc}"
        latency = time.monotonic() - started
        if response.status_code != 200:
            return (
                False,
                f"verify prompt answered HTTP {response.status_code}: {response.text[:200]}",
            )
        if latency > verify.max_latency_seconds:
            return (
                False,
                f"verify prompt took {latency:.3f}s, over maxLatencySeconds {verify.max_latency_seconds:g}",
            )
        return True, f"verify prompt answered in {latency:.3f}s"

    def lora_adapters(self, url: str, token: str | None = None) -> Mapping[str, str] | None:
        """``{name: path}`` of the LoRA adapters ``GET {url}/v1/models`` lists (cards with a
        ``parent``), or None when unreachable or not the expected JSON."""
        try:
            response = httpx.get(
                f"{url}/v1/models", headers=_auth(token), timeout=INFO_TIMEOUT_SECONDS
            )
            response.raise_for_status()
            cards = response.json()["data"]
            return {c["id"]: c.get("root", "") for c in cards if c.get("parent")}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def load_lora_adapter(
        self, url: str, name: str, path: str, token: str | None = None
    ) -> tuple[bool, str]:
        """``POST {url}/load_lora_adapter``: ``(success, message)``."""
        return _post_json(
            url,
            "/load_lora_adapter",
            {"lora_name": name, "lora_path": path},
            LORA_TIMEOUT_SECONDS,
            token,
        )

    def unload_lora_adapter(
        self, url: str, name: str, token: str | None = None
    ) -> tuple[bool, str]:
        """``POST {url}/unload_lora_adapter`` (the runtime answers once the adapter's running
        requests finished; a timeout is a failure retried next pass)."""
        return _post_json(
            url, "/unload_lora_adapter", {"lora_name": name}, LORA_TIMEOUT_SECONDS, token
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TokenLeaderClient:
    """A view of an :class:`HttpLeaderClient` (same requests in flight) that sends the admin
    token on control and info calls and the API key on the canary gate."""

    def __init__(self, client: HttpLeaderClient, token: str | None, api_key: str | None) -> None:
        self._client, self._token = client, token
        keys = [key.strip() for key in (api_key or "").split(",") if key.strip()]
        self._serving_key = keys[0] if keys else None

    def start_update(
        self, key: str, url: str, body: Mapping[str, Any], timeout_seconds: float
    ) -> None:
        self._client.start_update(key, url, body, timeout_seconds, self._token, self._serving_key)

    def abort_update(self, key: str, url: str) -> None:
        self._client.abort_update(key, url, self._token)

    def poll(self, key: str) -> tuple[str, str]:
        return self._client.poll(key)

    def server_info(self, url: str) -> Mapping[str, Any] | None:
        return self._client.server_info(url, self._token)

    def observed_phases(self, key: str) -> list[str]:
        return self._client.observed_phases(key)

    def update_seconds(self, key: str) -> dict[str, float]:
        return self._client.update_seconds(key)

    def verify(self, url: str, verify: Any = None) -> tuple[bool, str]:
        return self._client.verify(url, verify, self._serving_key)

    def lora_adapters(self, url: str) -> Mapping[str, str] | None:
        return self._client.lora_adapters(url, self._token)

    def load_lora_adapter(self, url: str, name: str, path: str) -> tuple[bool, str]:
        return self._client.load_lora_adapter(url, name, path, self._token)

    def unload_lora_adapter(self, url: str, name: str) -> tuple[bool, str]:
        return self._client.unload_lora_adapter(url, name, self._token)


def future_or_sleep(future: Future, seconds: float) -> None:
    """Wait ``seconds``, or less if ``future`` finishes first."""
    try:
        future.exception(timeout=seconds)
    except TimeoutError:
        pass


def _after(thread: threading.Thread, callback: Callable[[str], None], key: str) -> None:
    thread.join()
    callback(key)


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _post_update(
    url: str, body: dict[str, Any], timeout_seconds: float, token: str | None = None
) -> tuple[str, str, dict[str, float]]:
    """Send the update; ``(state, message, seconds)``: state ``success``, ``failure`` or
    ``aborted`` (the reply's ``aborted``), ``seconds`` the reply's ``load_seconds`` /
    ``recapture_seconds`` that are numbers. Transport errors are failures."""
    reply: dict[str, Any] = {}
    started = time.monotonic()
    logger.info("update of %s to %s sent", url, body.get("revision"))
    success, message = _post_json(
        url, "/update_weights_from_disk", body, timeout_seconds, token, reply
    )
    logger.info(
        "update of %s answered after %.2f s: success=%s, load %s s, recapture %s s",
        url,
        time.monotonic() - started,
        success,
        reply.get("load_seconds"),
        reply.get("recapture_seconds"),
    )
    seconds = {
        k: float(v)
        for k, v in reply.items()
        if k.endswith("_seconds") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    state = "success" if success else "aborted" if reply.get("aborted") is True else "failure"
    return state, message, seconds


def _post_json(
    url: str,
    route: str,
    body: dict[str, Any],
    timeout_seconds: float,
    token: str | None = None,
    reply_out: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """POST ``body`` to ``url + route``; ``(success, message)`` of a ``{"success", "message"}``
    reply (transport errors and non-JSON replies are failures naming ``url``). With
    ``reply_out``, the JSON reply is copied into it."""
    try:
        response = httpx.post(
            f"{url}{route}", json=body, headers=_auth(token), timeout=timeout_seconds
        )
    except httpx.HTTPError as exc:
        return False, f"request to {url} failed: {exc.__class__.__name__}: {exc}"
    try:
        reply = response.json()
    except ValueError:
        return False, f"HTTP {response.status_code} from {url}: {response.text[:200]}"
    if not isinstance(reply, dict):
        return False, f"HTTP {response.status_code} from {url}: unexpected reply {reply!r:.200}"
    if reply_out is not None:
        reply_out.update(reply)
    if response.status_code >= 400 or not reply.get("success", False):
        message = (
            reply.get("message") or (reply.get("error") or {}).get("message") or str(reply)[:200]
        )
        return False, str(message)
    return True, str(reply.get("message", ""))
