"""``EtcdV3RendezvousBackend``: torch's rendezvous state in one etcd key, fenced by revision.

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous (round, participants,
heartbeats) as one opaque blob and needs a backend that reads it with a fencing token
and writes it only if nobody wrote since. Here the blob is the value of
``<prefix>/<run_id>/state``, the token is the key's ``mod_revision``, and a write is one
etcd transaction: *if mod_revision == token then put (and read back) else read* — the
answer to a lost race is the winner's state, in the same round trip. Creation compares
against revision 0 (the key is absent). The key carries a lease, so an abandoned
rendezvous disappears after ``state_ttl`` seconds.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_train.rendezvous.etcd_v3.kv import KV
from elastic_train.rendezvous.etcd_v3.shared_lease import SharedLease

BACKEND_NAME = "etcd-v3"

# The value is this header then torch's state bytes: anything else under the key was not
# written by this backend (another program, a truncated write) and is reported, not parsed.
STATE_HEADER = b"elastic-train/rendezvous-state/1\n"


def encode_state(state: bytes) -> bytes:
    """The value stored for a rendezvous state."""
    return STATE_HEADER + state


def decode_state(value: bytes, where: str) -> bytes:
    """The state inside a stored value; ``RendezvousStateError`` if it is not one of ours."""
    if not value.startswith(STATE_HEADER):
        raise RendezvousStateError(
            f"the rendezvous state at {where} is corrupt or was not written by the etcd-v3 "
            f"backend ({len(value)} bytes without its header): delete that key or use a new "
            "--rdzv-id")
    return value[len(STATE_HEADER):]


def _revision(token: Token) -> int | None:
    """The revision a token stands for, or None if it is not one of ours."""
    if isinstance(token, int) and not isinstance(token, bool) and token > 0:
        return token
    return None


class EtcdV3RendezvousBackend(RendezvousBackend):
    """A ``RendezvousBackend`` on etcd's v3 API (see the module docstring)."""

    def __init__(self, kv: KV, run_id: str, key_prefix: str, lease: SharedLease) -> None:
        if not run_id:
            raise ValueError("the rendezvous run id must be a non-empty string: pass --rdzv-id")
        self._kv = kv
        self._lease = lease
        self.key = f"{key_prefix.rstrip('/')}/{run_id}/state"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def _where(self) -> str:
        return f"{self.key} on {self._kv.endpoint}"

    def get_state(self) -> tuple[bytes, Token] | None:
        kv = self._kv.get(self.key)
        if kv is None:
            return None
        return decode_state(kv.value, self._where()), kv.mod_revision

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        if token is None:
            revision = 0
        else:
            revision = _revision(token)
            if revision is None:  # not a token we handed out: it cannot match
                current = self.get_state()
                return None if current is None else (*current, False)
        value = encode_state(state)

        def write(lease: int) -> Any:
            return self._kv.swap(self.key, value, revision, lease)

        succeeded, kv = self._lease.write(write)
        if kv is None:  # our token named a state that no longer exists (expired, deleted)
            return None
        if succeeded:
            return state, kv.mod_revision, True
        return decode_state(kv.value, self._where()), kv.mod_revision, False
