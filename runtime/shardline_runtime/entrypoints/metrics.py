"""Prometheus metrics of the HTTP process (``GET /metrics``), named like vLLM's / SGLang's.

Counters and histograms are observed as tokens arrive; gauges (running / queued requests, KV
usage) mirror the latest ``SchedulerStats`` the rank-0 scheduler pushed. All names carry the
``shardline:`` prefix; times are seconds.

The model-server protocol of the Gateway API Inference Extension (its
``docs/proposals/003-model-server-protocol/README.md``, checked at commit 84436a96b9e6 in
``tests/contract/test_model_server_protocol.py``) is served in full: TotalQueuedRequests =
``shardline:num_requests_waiting``, TotalRunningRequests = ``shardline:num_requests_running``,
KVCacheUtilization = ``shardline:kv_cache_usage_perc`` (a fraction in [0, 1], as vLLM's),
BlockSize / NumGPUBlocks = the ``block_size`` / ``num_gpu_blocks`` labels of
``shardline:cache_config_info``, and, with LoRA, ``shardline:lora_requests_info`` (labels
``max_lora``, ``running_lora_adapters``, ``waiting_lora_adapters``; the value is the Unix time
of the last change, so a picker takes the newest sample).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServingMetrics:
    """The server's metrics, in their own registry (so tests can build several servers).

    Args:
        model_name: the served model name (label ``model_name`` on every series).
        num_gpu_blocks: KV-cache blocks in device memory (``max_total_num_tokens / block_size``),
            exported in ``shardline:cache_config_info``; None leaves that series out.
        block_size: tokens per KV block (1: the allocator hands out single token slots).
        max_lora: adapters one batch can serve (``--max-loras-per-batch``) when LoRA is on;
            None (LoRA off) leaves ``shardline:lora_requests_info`` out, as vLLM does.
    """

    def __init__(
        self,
        model_name: str,
        *,
        num_gpu_blocks: int | None = None,
        block_size: int = 1,
        max_lora: int | None = None,
    ):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        self._token_children: tuple[Any, Any, Any] | None = None
        self._max_lora = max_lora
        self._lora_seen: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        r = self.registry
        self.requests = Counter(
            "shardline:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "shardline:prompt_tokens",
            "Prompt tokens of finished requests.",
            ["model_name"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "shardline:generation_tokens", "Generated tokens.", ["model_name"], registry=r
        )
        self.cached_tokens = Counter(
            "shardline:cached_tokens",
            "Prompt tokens served from the prefix cache.",
            ["model_name"],
            registry=r,
        )
        self.ttft = Histogram(
            "shardline:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "shardline:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "shardline:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "shardline:num_requests_running",
            "Requests in the running batch.",
            ["model_name"],
            registry=r,
        )
        self.waiting = Gauge(
            "shardline:num_requests_waiting",
            "Requests waiting for admission.",
            ["model_name"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "shardline:kv_cache_usage_perc",
            "Fraction of KV slots held by requests (0..1).",
            ["model_name"],
            registry=r,
        )
        self.kv_used = Gauge(
            "shardline:kv_cache_used_tokens",
            "KV slots held by requests.",
            ["model_name"],
            registry=r,
        )
        self.spec_accept_rate = Gauge(
            "shardline:spec_accept_rate",
            "Speculative decoding: draft tokens kept / draft tokens proposed, since start (0..1).",
            ["model_name"],
            registry=r,
        )
        self.spec_accept_length = Gauge(
            "shardline:spec_accept_length",
            "Speculative decoding: mean tokens a request gains per verify step (kept drafts + 1).",
            ["model_name"],
            registry=r,
        )
        self.spec_draft_tokens = Gauge(
            "shardline:spec_draft_tokens",
            "Speculative decoding: draft tokens proposed and verified since start.",
            ["model_name"],
            registry=r,
        )
        self.spec_verify_steps = Gauge(
            "shardline:spec_verify_steps",
            "Speculative decoding: TARGET_VERIFY forwards since start.",
            ["model_name"],
            registry=r,
        )
        self.weights = Gauge(
            "shardline:weights_info",
            "1 for the weights being served (revision, path, checkpoint digest).",
            ["model_name", "revision", "model_path", "digest"],
            registry=r,
        )
        self.held = Counter(
            "shardline:weight_update_held_requests",
            "Requests that arrived during a weight update and were held.",
            ["model_name"],
            registry=r,
        )
        self.hold_time = Histogram(
            "shardline:weight_update_hold_seconds",
            "Seconds a request was held by a weight update.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.weight_version = Gauge(
            "shardline:weight_version_info",
            "1 for the weight_version being served (set by every weight update).",
            ["model_name", "weight_version"],
            registry=r,
        )
        self.cache_config = Gauge(
            "shardline:cache_config_info",
            "1, labelled with the KV cache's block size (tokens) and its number of blocks.",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=r,
        )
        if num_gpu_blocks is not None:
            self.cache_config.labels(
                block_size=str(block_size), num_gpu_blocks=str(num_gpu_blocks), **labels
            ).set(1)
        self.lora_requests = Gauge(
            "shardline:lora_requests_info",
            "Unix time of the last change, labelled with the adapters of running and of waiting "
            "requests (comma-separated) and the adapters one batch can serve.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        if max_lora is not None:
            self._set_lora((), ())
        for metric in (
            self.held,
            self.hold_time,
            self.prompt_tokens,
            self.generation_tokens,
            self.cached_tokens,
            self.running,
            self.waiting,
            self.kv_usage,
            self.kv_used,
        ):
            metric.labels(**labels)

    def set_weights(self, state) -> None:
        """The served weights (a ``WeightsState``): ``weights_info`` and ``weight_version_info``."""
        self.weights.clear()
        self.weights.labels(
            revision=state.revision or "",
            model_path=state.model_path,
            digest=state.digest or "",
            **self._labels,
        ).set(1)
        self.weight_version.clear()
        self.weight_version.labels(weight_version=state.weight_version, **self._labels).set(1)

    def observe_hold(self, seconds: float) -> None:
        """A request was held ``seconds`` by a weight update (then admitted or refused)."""
        self.held.labels(**self._labels).inc()
        self.hold_time.labels(**self._labels).observe(seconds)

    def observe_stats(self, stats) -> None:
        self.running.labels(**self._labels).set(stats.num_running_reqs)
        self.waiting.labels(**self._labels).set(stats.num_queued_reqs)
        self.kv_usage.labels(**self._labels).set(stats.kv_usage)
        self.kv_used.labels(**self._labels).set(stats.kv_used_tokens)
        if self._max_lora is not None:
            self._set_lora(stats.running_lora_adapters, stats.waiting_lora_adapters)
        spec = stats.speculative
        if spec is not None:
            self.spec_accept_rate.labels(**self._labels).set(spec.acceptance_rate)
            self.spec_accept_length.labels(**self._labels).set(spec.mean_accepted_length)
            self.spec_draft_tokens.labels(**self._labels).set(spec.draft_tokens)
            self.spec_verify_steps.labels(**self._labels).set(spec.verify_steps)

    def _set_lora(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        """One ``lora_requests_info`` series for the current adapter sets, stamped when they
        change (an unchanged set keeps its time)."""
        if self._lora_seen == (running, waiting):
            return
        self._lora_seen = (running, waiting)
        self.lora_requests.clear()
        self.lora_requests.labels(
            max_lora=str(self._max_lora),
            running_lora_adapters=",".join(running),
            waiting_lora_adapters=",".join(waiting),
            **self._labels,
        ).set(time.time())

    def _per_token_children(self) -> tuple[Any, Any, Any]:
        """The labelled children observed on every chunk, looked up once (``labels()`` takes a
        lock and builds a key each call)."""
        if self._token_children is None:
            self._token_children = (
                self.generation_tokens.labels(**self._labels),
                self.ttft.labels(**self._labels),
                self.itl.labels(**self._labels),
            )
        return self._token_children

    def observe_tokens(self, state, now: float, count: int) -> None:
        """``count`` new output tokens of a request arrived at ``now`` (monotonic seconds)."""
        generation_tokens, ttft, itl = self._per_token_children()
        generation_tokens.inc(count)
        gaps = count
        if state.last_token_time is None:
            ttft.observe(now - state.created)
            gaps -= 1
        elif gaps > 0:
            gap = (now - state.last_token_time) / gaps
            for _ in range(gaps):
                itl.observe(gap)
        state.last_token_time = now

    def observe_finish(self, state, now: float, chunk) -> None:
        """A request's last chunk (``chunk.finish`` set) arrived at ``now``."""
        reason = chunk.finish.type if chunk.finish is not None else "abort"
        self.requests.labels(finished_reason=reason, **self._labels).inc()
        self.prompt_tokens.labels(**self._labels).inc(chunk.usage.prompt_tokens)
        self.cached_tokens.labels(**self._labels).inc(chunk.usage.cached_tokens)
        self.e2e.labels(**self._labels).observe(now - state.created)

    def observe_disconnect(self) -> None:
        """A client went away before its request finished (counted as ``abort``)."""
        self.requests.labels(finished_reason="abort", **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
