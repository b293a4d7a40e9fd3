"""The names of a checkpoint's objects in an object store (checkpoint/object_checkpoints.py's
layout), torch-free: the agent's memory tier uploads payloads under them
(agent/write_behind.py) without importing the checkpoint code."""

from __future__ import annotations

import re
import secrets

__all__ = ["PAYLOAD_KEY", "STEP_DIR", "payload_name"]

STEP_DIR = re.compile(r"^step-(\d{8,})$")
"""A committed checkpoint's folder: ``step-`` and the step, 8 digits or more."""
PAYLOAD_KEY = re.compile(r"(?:^|/)step-\d{8,}/state-[0-9a-f]{12}\.pt$")
"""An object store key that names a checkpoint's payload (``payload_name`` in a step's
folder): the only objects a memory tier's holder uploads, and the only ones an object
checkpoint store's housekeeping deletes."""


def payload_name() -> str:
    """A new payload's name: each save its own, so that a save never overwrites the bytes
    another manifest covers."""
    return f"state-{secrets.token_hex(6)}.pt"
