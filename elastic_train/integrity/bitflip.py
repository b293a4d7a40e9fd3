"""The drill: flip one chosen bit of one chosen element of a tensor, in place, as a faulty
GPU or memory would. For the tests of silent data corruption and for users' drills
(``--inject-bitflip``); nothing else calls it."""

from __future__ import annotations

import torch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit ``bit`` (0: the lowest) of element ``index`` of ``tensor``'s flattened
    storage, in place, on its device."""
    if not tensor.is_contiguous():
        raise ValueError("flip_bit needs a contiguous tensor (parameters and optimizer "
                         "state are)")
    size = tensor.element_size()
    if not 0 <= bit < 8 * size:
        raise ValueError(f"bit {bit}: a {tensor.dtype} element has bits 0..{8 * size - 1}")
    if not 0 <= index < tensor.numel():
        raise ValueError(f"index {index}: the tensor has {tensor.numel()} elements")
    words = tensor.detach().view(-1).view(_INTS[size])
    mask = 1 << bit
    if mask >= 1 << (8 * size - 1) and size > 1:  # the sign bit of a signed view
        mask -= 1 << (8 * size)
    with torch.no_grad():
        words[index] ^= mask
