"""Copy training state to host memory fast, into buffers reused from one save to the next.

The snapshot is the only part of a save that training may wait for. Reusing the buffers
avoids allocating (and page-faulting) the whole state again at every save; on CUDA they
are pinned so the device-to-host copy runs at full speed. A buffer is reused only after
the persist that read it has finished (the manager guarantees that).

A snapshot can also *overlap* the next step (:meth:`SnapshotBuffers.begin`): tensors that
only the optimizer's ``step()`` changes (parameters, optimizer state) are copied while the
next forward and backward run, by a thread on CPU or a side stream on CUDA, and the
optimizer's next ``step()`` waits until they are copied. Everything else (buffers a
forward pass may change, counters, RNG and sampler state) is copied at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def changed_only_by_step(optimizer: torch.optim.Optimizer) -> set[int]:
    """Data pointers of the tensors that only ``optimizer.step()`` writes: its parameters
    and its per-parameter state (moments, step counts)."""
    pointers = {p.data_ptr() for group in optimizer.param_groups for p in group["params"]}
    for state in optimizer.state.values():
        pointers.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    pointers.discard(0)  # empty tensors share the null pointer
    return pointers


def split_deferred(pairs: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                              list[tuple[torch.Tensor, torch.Tensor]]]:
    """Which deferred copies to make now and which to overlap with the next step.

    One save overlaps on one device: a thread for CPU training, a copy stream for one
    accelerator. Host tensors among accelerator state (AdamW's ``step`` counts stay on the
    CPU unless the optimizer is fused or capturable) are a few bytes: they are copied now,
    so they do not stop the device's tensors from overlapping. State spread over several
    accelerators is all copied now.
    """
    accelerators = {src.device for src, _ in pairs if src.device.type != "cpu"}
    if not accelerators:
        return [], pairs
    if len(accelerators) > 1:
        return pairs, []
    on_host = [pair for pair in pairs if pair[0].device.type == "cpu"]
    return on_host, [pair for pair in pairs if pair[0].device.type != "cpu"]


class PendingCopies:
    """Copies into host buffers that run while training goes on.

    ``wait_for_training`` is what the optimizer's next step calls: on CPU it blocks until
    the copies are done; on CUDA it only orders the compute stream after the copy stream
    (the host does not block). ``wait`` blocks the calling thread until the buffers hold
    the copied bytes (the persist calls it before reading them).
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 stream: Any | None = None, device: torch.device | None = None) -> None:
        self.copy_seconds: float | None = None
        self.training_waited = 0.0
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._event: Any | None = None
        self._device = device
        if stream is None:
            threading.Thread(target=self._copy_on_host, args=(pairs,),
                             name="checkpoint-snapshot-copy", daemon=True).start()
        else:
            started = time.monotonic()
            with torch.cuda.stream(stream):
                for src, dst in pairs:
                    dst.copy_(src, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(stream)
            self.copy_seconds = time.monotonic() - started  # enqueueing; the copy is async
            self._done.set()

    def _copy_on_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        started = time.monotonic()
        try:
            for src, dst in pairs:
                dst.copy_(src)
        except BaseException as exc:  # the persist reports it; the checkpoint is not written
            self.error = exc
        finally:
            self.copy_seconds = time.monotonic() - started
            self._done.set()

    def wait_for_training(self) -> None:
        """Before the tensors change: let the copies finish first (adds the seconds blocked
        to ``training_waited``)."""
        started = time.monotonic()
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        else:
            self._done.wait()
        self.training_waited += time.monotonic() - started

    def wait(self) -> None:
        """Block until the buffers hold the copies; raise what a copy raised."""
        self._done.wait()
        if self._event is not None:
            self._event.synchronize()
        if self.error is not None:
            raise self.error


class SnapshotBuffers:
    """Host buffers keyed by their place in the state tree."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}
        self.bytes_allocated = 0

    def _buffer_for(self, path: tuple[Any, ...], tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                 pin_memory=pin)
            self._buffers[path] = buffer
            self.bytes_allocated += buffer.numel() * buffer.element_size()
        return buffer

    def copy(self, objects: Mapping[str, Stateful]) -> dict[str, Any]:
        """Every object's state dict with each tensor copied into its host buffer."""
        state, pending = self.begin(objects, deferred=())
        assert pending is None
        return state

    def begin(self, objects: Mapping[str, Stateful], deferred: Collection[int]
              ) -> tuple[dict[str, Any], PendingCopies | None]:
        """The state tree now, with the tensors whose data pointer is in ``deferred`` still
        being copied by the returned :class:`PendingCopies` (None when nothing is)."""
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        on_cuda: set[torch.device] = set()

        def walk(value: Any, path: tuple[Any, ...]) -> Any:
            if isinstance(value, torch.Tensor):
                source = value.detach()
                buffer = self._buffer_for(path, source)
                if source.device.type == "cuda":
                    on_cuda.add(source.device)
                if source.numel() and source.data_ptr() in deferred:
                    later.append((source, buffer))
                else:
                    buffer.copy_(source, non_blocking=source.device.type == "cuda")
                return buffer
            if isinstance(value, dict):
                return {k: walk(v, (*path, k)) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
            return value

        snapshot = {name: walk(obj.state_dict(), (name,)) for name, obj in objects.items()}
        for device in on_cuda:  # the copies made at once are complete on return
            torch.cuda.current_stream(device).synchronize()
        now, later = split_deferred(later)
        for src, dst in now:
            dst.copy_(src)
        if not later:
            return snapshot, None
        device = later[0][0].device
        if device.type != "cuda":
            return snapshot, PendingCopies(later)
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        # The copies read what the compute stream has written up to now.
        stream.wait_stream(torch.cuda.current_stream(device))
        return snapshot, PendingCopies(later, stream, device)
