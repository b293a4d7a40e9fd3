"""Bitwise equality of nested training state (what a checkpoint or a live transfer carries)."""

from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as bytes (a sparse one's dense form)."""
    dense = tensor.detach().to_dense() if tensor.is_sparse else tensor.detach()
    return bytes(dense.cpu().reshape(-1).contiguous().view(torch.uint8).tolist())


def assert_same_state(sent: Any, got: Any) -> None:
    """``got`` has ``sent``'s structure and container types, and each tensor its dtype,
    shape, device, ``requires_grad`` and bytes (NaNs included)."""
    if isinstance(sent, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert (sent.dtype, sent.shape, sent.device, sent.requires_grad) == \
            (got.dtype, got.shape, got.device, got.requires_grad)
        assert tensor_bytes(sent) == tensor_bytes(got)
        return
    assert type(sent) is type(got)
    if isinstance(sent, dict):
        assert list(sent) == list(got)
        for key in sent:
            assert_same_state(sent[key], got[key])
    elif isinstance(sent, (list, tuple)):
        assert len(sent) == len(got)
        for a, b in zip(sent, got, strict=True):
            assert_same_state(a, b)
    else:
        assert sent == got
