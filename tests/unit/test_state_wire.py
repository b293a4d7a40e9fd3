"""The live state transfer's wire format: every state a trainer holds arrives equal, in
its own tensors, and a peer's header runs no pickled code. (The transfer between real
workers is in tests/integration/test_live_recovery.py and test_session_live.py.)"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any

import pytest
import torch

from elastic_train.live import state_wire
from tests.state_equality import assert_same_state


def _roundtrip(states: Any) -> tuple[Any, state_wire.Packed]:
    packed = state_wire.pack(states, torch.device("cpu"))
    received = torch.empty_like(packed.data).copy_(packed.data)  # what the broadcast fills
    return state_wire.unpack(state_wire.read_header(packed.header), received,
                             torch.device("cpu")), packed


def test_a_trainers_state_arrives_equal_and_loads() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7),
                                torch.nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    scheduler.step()
    states = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "scheduler": {k: v for k, v in scheduler.state_dict().items()
                            if k != "lr_lambdas"}, "trainer": {"step": 7, "seen": 28}}
    got, packed = _roundtrip(states)
    assert_same_state(states, got)
    assert packed.data.numel() >= sum(t.numel() * 4 for t in model.state_dict().values())

    twin = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7),
                               torch.nn.Linear(7, 3))
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=0.01)
    twin.load_state_dict(got["model"])
    twin_optimizer.load_state_dict(got["optimizer"])
    batch = torch.randn(4, 5)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.zero_grad()
        m(batch).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)  # the next step is bitwise the same


def test_every_dtype_shape_and_container_survives() -> None:
    states = {
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(3, 5, dtype=torch.bfloat16),
        "half": torch.randn(7, dtype=torch.float16),
        "int8": torch.tensor([-1, 2, 3], dtype=torch.int8),
        "complex": torch.randn(2, 2, dtype=torch.complex64),
        "transposed": torch.randn(4, 6).t(),  # not contiguous
        "empty": torch.empty(0, 3),
        "needs_grad": torch.ones(2, requires_grad=True),
        "sparse": torch.randn(3, 3).to_sparse(),  # not movable: goes in the header
        "nested": [1, (2.5, torch.arange(5)), {"k": None, "s": "text"}],
        "ordered": OrderedDict(b=torch.ones(2), a=torch.zeros(1)),
    }
    got, _ = _roundtrip(states)
    assert_same_state(states, got)
    assert got["transposed"].is_contiguous()


def test_the_bulk_travels_in_the_buffer_not_the_header() -> None:
    packed = state_wire.pack({"w": torch.zeros(1 << 20)}, torch.device("cpu"))
    assert packed.data.numel() == 4 << 20 and len(packed.header) < 4096


def test_received_tensors_do_not_share_the_buffer() -> None:
    states = {"w": torch.ones(3)}
    packed = state_wire.pack(states, torch.device("cpu"))
    got = state_wire.unpack(state_wire.read_header(packed.header), packed.data,
                            torch.device("cpu"))
    packed.data.zero_()
    assert got["w"].tolist() == [1.0, 1.0, 1.0]


def test_every_slot_is_aligned_for_its_dtype() -> None:
    states = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(5, dtype=torch.float64),
              "c": torch.ones(1, dtype=torch.int16), "d": torch.ones(2, dtype=torch.complex128)}
    header = state_wire.read_header(state_wire.pack(states, torch.device("cpu")).header)
    assert all(start % state_wire.ALIGNMENT == 0 for start, *_ in header["layout"])


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("pickled code ran",))


def test_a_header_with_pickled_code_is_refused() -> None:
    buffer = io.BytesIO()
    torch.save({"skeleton": Payload(), "layout": [], "size": 0}, buffer,
               pickle_module=pickle)
    with pytest.raises(pickle.UnpicklingError):
        state_wire.read_header(buffer.getvalue())


def test_unpacked_without_copy_the_tensors_are_views_of_the_buffer() -> None:
    states = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    packed = state_wire.pack(states, torch.device("cpu"))
    received = torch.empty_like(packed.data).copy_(packed.data)
    header = state_wire.read_header(packed.header)
    buffer = received.untyped_storage().data_ptr()
    out = state_wire.unpack(header, received, torch.device("cpu"), copy=False)
    assert torch.equal(out["model"]["w"], states["model"]["w"]) and out["step"] == 3
    assert out["model"]["w"].untyped_storage().data_ptr() == buffer
    copied = state_wire.unpack(header, received, torch.device("cpu"))
    assert copied["model"]["w"].untyped_storage().data_ptr() != buffer
