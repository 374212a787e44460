"""A CPU stand-in for "this tensor lives on the GPU": reading its values on the host raises while
a step is in flight.

On CUDA, ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` (and a blocking ``.to("cpu")``) of a
device tensor wait until the device has run everything queued before it, i.e. the overlap
scheduler's step in flight. On the CPU the same reads cost nothing, so no test could see them.
:class:`OnDevice` marks tensors as device tensors (results of ops on them are marked too);
:func:`guard_scheduler` marks everything a scheduler sends to its device and makes any such read
raise :class:`DeviceReadError` while a step is launched and not yet waited for, except inside
the launch itself and inside ``GenerationBatchResult.wait`` (the one documented wait).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from shardline_runtime import device_copy
from shardline_runtime.managers import overlap_steps
from shardline_runtime.model_executor.generation_result import GenerationBatchResult


class DeviceReadError(AssertionError):
    """The host read a device tensor while a step was in flight."""


@dataclass
class GuardState:
    in_flight: int = 0  # steps launched and not waited for
    exempt: int = 0  # inside the launch or the documented wait
    reads_blocked: int = 0  # how many reads the guard refused (the test expects 0)
    max_in_flight: int = 0  # the most steps in flight at once (2: the loop overlapped)

    @property
    def active(self) -> bool:
        return self.in_flight > 0 and self.exempt == 0


STATE = GuardState()

_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
    torch.equal,
}


def _to_host(args: tuple, kwargs: dict) -> bool:
    targets = [kwargs.get("device")] + list(args[1:])
    return any(
        (isinstance(t, str) and t.startswith("cpu"))
        or (isinstance(t, torch.device) and t.type == "cpu")
        for t in targets
    )


class OnDevice(torch.Tensor):
    """A tensor the code under test must treat as living on the model's device."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            _refuse(getattr(func, "__name__", str(func)))
        if func is torch.Tensor.to and _to_host(args, kwargs):
            if not kwargs.get("non_blocking", False):
                _refuse("to('cpu') without non_blocking")
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).clone()  # a host copy, no longer a device tensor
        return super().__torch_function__(func, types, args, kwargs)


def _refuse(what: str) -> None:
    if STATE.active:
        STATE.reads_blocked += 1
        raise DeviceReadError(f"host read of a device tensor ({what}) while a step is in flight")


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(OnDevice)


def guard_scheduler(scheduler, monkeypatch) -> GuardState:
    """Mark ``scheduler``'s device state (``req_to_token`` with a separate host copy, the future
    map, everything that goes through ``device_copy.to_device``) and guard reads of it."""
    global STATE
    STATE = GuardState()
    pool = scheduler.cache.req_to_token_pool
    pool.req_to_token_host = pool.req_to_token.clone()
    pool.req_to_token = on_device(pool.req_to_token)
    future_map = scheduler.overlap.future_map
    future_map.token_ids = on_device(future_map.token_ids)
    # the CPU-only shortcuts of the host path off: the device path runs, as on CUDA
    scheduler.worker.model_runner.host_decode_inputs = None
    monkeypatch.setattr(GenerationBatchResult, "host_results_as_is", False)

    real_to_device = device_copy.to_device

    def marked_to_device(values, device, dtype=None):
        return on_device(real_to_device(values, device, dtype))

    for module in list(sys.modules.values()):
        if getattr(module, "to_device", None) is real_to_device and module is not device_copy:
            monkeypatch.setattr(module, "to_device", marked_to_device)

    real_launch, real_wait = overlap_steps.launch_step, GenerationBatchResult.wait
    launched: set[int] = set()

    def launch(worker, batch, future_map):
        STATE.exempt += 1
        try:
            result = real_launch(worker, batch, future_map)
        finally:
            STATE.exempt -= 1
        STATE.in_flight += 1
        STATE.max_in_flight = max(STATE.max_in_flight, STATE.in_flight)
        launched.add(id(result))
        return result

    def wait(result):
        STATE.exempt += 1
        try:
            return real_wait(result)
        finally:
            STATE.exempt -= 1
            if id(result) in launched:
                launched.discard(id(result))
                STATE.in_flight -= 1

    monkeypatch.setattr(overlap_steps, "launch_step", launch)
    monkeypatch.setattr(GenerationBatchResult, "wait", wait)
    return STATE
