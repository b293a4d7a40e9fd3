"""Copy training state to host memory fast, into buffers reused from one save to the next.

The snapshot is the only part of a save that training waits for. Reusing the buffers
avoids allocating (and page-faulting) the whole state again at every save; on CUDA they
are pinned so the device-to-host copy runs at full speed. A buffer is reused only after
the persist that read it has finished (the manager guarantees that).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class SnapshotBuffers:
    """Host buffers keyed by their place in the state tree."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
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
        on_cuda = False

        def walk(value: Any, path: tuple[Any, ...]) -> Any:
            nonlocal on_cuda
            if isinstance(value, torch.Tensor):
                source = value.detach()
                on_cuda = on_cuda or source.device.type == "cuda"
                buffer = self._buffer_for(path, source)
                buffer.copy_(source, non_blocking=source.device.type == "cuda")
                return buffer
            if isinstance(value, dict):
                return {k: walk(v, (*path, k)) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
            return value

        snapshot = {name: walk(obj.state_dict(), (name,)) for name, obj in objects.items()}
        if on_cuda:
            torch.cuda.synchronize()
        return snapshot
