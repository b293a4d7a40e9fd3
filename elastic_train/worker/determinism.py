"""Deterministic kernels, for runs that must resume bit for bit on a GPU.

On the CPU our training is deterministic already (fixed thread count, seeds derived per
step). CUDA picks kernels with atomics or by timing (cuBLAS split-K workspaces, cuDNN
autotuning, ``index_add`` / scatter backward), so two runs of the same steps can differ in
the last bits. ``make_deterministic`` asks torch for the deterministic variants: a little
slower, and an operation with no deterministic variant raises instead of drifting.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def make_deterministic() -> None:
    """Deterministic algorithms for this process; call it before the first CUDA matmul.

    cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when its handle is created; a value the user
    set is kept.
    """
    os.environ.setdefault(CUBLAS_WORKSPACE, CUBLAS_DETERMINISTIC_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
