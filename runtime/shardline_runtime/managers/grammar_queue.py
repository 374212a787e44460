"""Grammars compile off the scheduler loop: a constrained request waits here, holding no KV,
while a worker thread compiles its grammar; the other requests keep decoding meanwhile.

SGLang's scheduler does the same (``grammar_queue``: a request whose grammar is not ready is
parked, polled every iteration, and moved to the waiting queue once its future is done).
Compiling a deep JSON schema takes seconds, and xgrammar releases the GIL while it compiles, so
the loop keeps stepping.

Every rank compiles its own copy (ranks are separate processes) but they must admit a request at
the same iteration, so rank 0 of stage 0 (the *leader*) decides: it puts a
:class:`GrammarsReady` with the requests whose compile it has finished into the iteration's
messages (``RequestReceiver.local_source``), which reach every rank as any message does; a rank
whose own compile is not finished yet waits for it then (they started together). An abort of a
pending request drops it on every rank and answers it at once.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardline_runtime.constrained.grammar_spec import GrammarError, GrammarSpec
from shardline_runtime.constrained.xgrammar_backend import RequestGrammar
from shardline_runtime.managers.req import FinishReason, Req
from shardline_runtime.managers.scheduler_output import OutputSender

COMPILE_THREADS = 2


@dataclass
class GrammarsReady:
    """Leader -> every rank: admit these pending requests now, in this order."""

    rids: list[str] = field(default_factory=list)


@dataclass
class _Pending:
    req: Req
    future: Future[RequestGrammar]
    announced: bool = False


class GrammarQueue:
    """Requests whose grammar is compiling, in arrival order.

    Args:
        compile: ``spec -> RequestGrammar`` (``LazyGrammars``; runs in a worker thread; raises
            ``GrammarError`` for a spec the library rejects).
        admit: takes a request whose grammar is ready (``RequestIntake.admit_ready``).
        sender: answers a failed compile or an abort (rank 0's ``OutputSender``).
        threads: compiler threads.
    """

    def __init__(
        self,
        compile: Callable[[GrammarSpec], RequestGrammar],
        admit: Callable[[Req], None],
        sender: OutputSender,
        threads: int = COMPILE_THREADS,
    ):
        self.compile = compile
        self.admit = admit
        self.sender = sender
        self.threads = threads
        self.pending: dict[str, _Pending] = {}
        self._executor: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, req: Req, spec: GrammarSpec) -> None:
        """Start compiling ``spec`` for ``req`` (which waits here until :meth:`on_ready`)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar")
        self.pending[req.rid] = _Pending(req, self._executor.submit(self.compile, spec))

    def ready_messages(self, wait_s: float = 0.0) -> list[GrammarsReady]:
        """Leader only: a :class:`GrammarsReady` naming the pending requests whose compile has
        finished (each named once), or none; waits up to ``wait_s`` seconds for a first one
        (the loop passes a few milliseconds when nothing else can run, so it does not spin)."""
        waiting = [p for p in self.pending.values() if not p.announced]
        if not waiting:
            return []
        if wait_s > 0 and not any(p.future.done() for p in waiting):
            futures = [p.future for p in waiting]
            concurrent.futures.wait(futures, wait_s, concurrent.futures.FIRST_COMPLETED)
        done = [p for p in waiting if p.future.done()]
        for p in done:
            p.announced = True
        return [GrammarsReady([p.req.rid for p in done])] if done else []

    def on_ready(self, msg: GrammarsReady) -> None:
        """Every rank: admit the named requests (waiting for this rank's own compile), or
        answer a rejected grammar; a request aborted meanwhile is skipped."""
        for rid in msg.rids:
            entry = self.pending.pop(rid, None)
            if entry is None:
                continue
            try:
                entry.req.grammar = entry.future.result()
            except GrammarError as exc:  # the HTTP process compiled it already: defensive
                self.sender.reject(rid, len(entry.req.origin_input_ids), str(exc))
                continue
            self.admit(entry.req)

    def abort(self, rid: str | None, reason: dict[str, Any]) -> None:
        """Drop ``rid`` (None: every pending request) and answer it with ``reason`` (an
        ``AbortReq``'s); its compile runs on in the background (xgrammar cannot stop one)."""
        finish = FinishReason.from_dict(reason)
        hit = [p.req for r, p in self.pending.items() if rid is None or r == rid]
        for req in hit:
            del self.pending[req.rid]
            req.finished_reason = finish
        if hit:
            self.sender.stream(hit)

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """This part's entries of the scheduler's dispatch table."""
        return {GrammarsReady: self.on_ready}
