"""elastic_train/integrity: fingerprints equal exactly when the bits are, a flipped bit
always seen, the odd replica named by majority, stragglers named after their window and
never on a healthy noisy world."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from elastic_train.integrity import fingerprint as fp
from elastic_train.integrity.bitflip import flip_bit
from elastic_train.integrity.slowdown import SlowdownDrill
from elastic_train.integrity.stragglers import StragglerWatch
from elastic_train.integrity.verdict import compare, compare_groups
from tests import procfs
from tests.polling import wait_until

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.uint8, torch.bool]


def state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def words(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[int]]:
    return fp.state_fingerprint([("model", model.state_dict()),
                                 ("optimizer", optimizer.state_dict())]).tolist()


def test_two_replicas_with_the_same_bits_have_the_same_fingerprint() -> None:
    assert words(*state(0)) == words(*state(0))
    assert words(*state(0)) != words(*state(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_the_fingerprint(dtype: torch.dtype) -> None:
    rng = random.Random(7)
    base = (torch.rand(300) * 100).to(dtype) if dtype != torch.bool else torch.rand(300) > 0.5
    before = fp.tensor_words(base).tolist()
    for _ in range(200):
        flipped = base.clone()
        index, bit = rng.randrange(300), rng.randrange(8 * base.element_size())
        flip_bit(flipped, index, bit)
        assert fp.tensor_words(flipped).tolist() != before, (index, bit)


def test_a_flip_of_optimizer_state_is_seen_and_flipping_back_restores_it() -> None:
    model, optimizer = state()
    before = words(model, optimizer)
    moment = optimizer.state_dict()["state"][0]["exp_avg"]
    flip_bit(moment, 3, 30)
    after = words(model, optimizer)
    assert after[0] == before[0] and after[1] != before[1]   # the model's row is untouched
    flip_bit(moment, 3, 30)
    assert words(model, optimizer) == before


def test_swapped_elements_and_chunk_boundaries_are_seen(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setattr(fp, "CHUNK", 64)
    base = torch.arange(1000, dtype=torch.float32)
    swapped = base.clone()
    swapped[[10, 900]] = swapped[[900, 10]]
    assert fp.tensor_words(base)[0] == fp.tensor_words(swapped)[0]   # the plain sum agrees
    assert fp.tensor_words(base).tolist() != fp.tensor_words(swapped).tolist()
    monkeypatch.setattr(fp, "CHUNK", 1 << 22)
    assert fp.tensor_words(base).tolist() == fp.tensor_words(base.clone()).tolist()


def test_a_flip_needs_a_valid_place() -> None:
    with pytest.raises(ValueError, match=r"bits 0\.\.31"):
        flip_bit(torch.zeros(4), 0, 32)
    with pytest.raises(ValueError, match="has 4 elements"):
        flip_bit(torch.zeros(4), 4, 0)
    with pytest.raises(ValueError, match="contiguous"):
        flip_bit(torch.zeros(4, 4).t(), 0, 0)


def test_the_odd_replica_is_named_by_a_strict_majority() -> None:
    good, bad = [1, 2, 3], [1, 2, 4]
    assert compare({0: good, 1: good, 2: good}).agree
    verdict = compare({0: good, 1: bad, 2: good})
    assert not verdict.agree and verdict.named == (1,) and verdict.suspects == (1,)
    assert "rank(s) 1 hold a state that differs" in verdict.describe()


def test_two_replicas_or_a_tie_make_every_rank_a_suspect() -> None:
    verdict = compare({0: [1], 1: [2]})
    assert not verdict.agree and verdict.named == () and verdict.suspects == (0, 1)
    tie = compare({0: [1], 1: [2], 2: [1], 3: [2]})
    assert tie.named == () and tie.suspects == (0, 1, 2, 3)
    assert "no majority" in tie.describe()


def test_replica_groups_are_judged_apart() -> None:
    # HSDP: ranks 0 and 2 hold shard A, 1, 3 and 5 shard B
    prints = {0: [1], 2: [1], 1: [5], 3: [6], 5: [5]}
    verdict = compare_groups(prints, [[0, 2], [1, 3, 5]])
    assert verdict.named == (3,) and verdict.suspects == (3,)
    assert compare_groups(prints, [[0, 2]]).agree


def test_a_rank_slowed_2x_is_named_within_its_window_and_only_it() -> None:
    watch = StragglerWatch(factor=1.5, window=20)
    rng = random.Random(1)
    first = None
    for step in range(60):
        times = {r: 0.1 * rng.uniform(0.9, 1.1) * (2.0 if r == 2 and step >= 30 else 1.0)
                 for r in range(4)}
        named = watch.step(times)
        assert named in ([], [2]), step
        if named and first is None:
            first = step
    # slowed from step 30: named once about half its window is slow, within the window
    assert first is not None and 30 + 20 // 4 <= first <= 30 + 20 // 2 + 2, first
    assert named == [2] and watch.scores[2] > 1.5 and watch.typical_seconds(2) > 0.15


def test_a_new_world_starts_its_window_again() -> None:
    watch = StragglerWatch(factor=1.5, window=5)
    for _ in range(5):
        named = watch.step({0: 1.0, 1: 1.0, 2: 3.0})
    assert named == [2]
    assert watch.step({0: 1.0, 1: 3.0}) == []          # re-formed: ranks renumbered
    assert watch.typical_seconds(1) == 3.0 and watch.scores[1] == 3.0


def test_a_healthy_noisy_world_names_nobody_in_10000_steps() -> None:
    watch = StragglerWatch()
    rng = random.Random(3)
    for _ in range(10_000):
        # jitter of +-30 %, and now and then one rank's step 3x as long (a checkpoint, a
        # page fault): noise, never a straggler
        times = {r: 0.1 * rng.uniform(0.7, 1.3) * (3.0 if rng.random() < 0.02 else 1.0)
                 for r in range(8)}
        assert watch.step(times) == []


def test_the_policy_refuses_a_factor_or_window_that_means_nothing() -> None:
    with pytest.raises(ValueError, match="above 1"):
        StragglerWatch(factor=1.0)
    with pytest.raises(ValueError, match="at least 1 step"):
        StragglerWatch(window=0)


# ---- the drill (--inject-bitflip) ------------------------------------------------------------
def test_the_drill_flips_the_bit_it_names_of_a_weight_or_an_optimizer_state_once() -> None:
    from elastic_train.integrity.drill import BitflipDrill

    assert BitflipDrill.parse("") is None
    assert BitflipDrill.parse("2:40") == BitflipDrill(2, 40, "weight", 0, 12)
    drill = BitflipDrill.parse("1:3:optimizer:2:5")
    assert drill == BitflipDrill(1, 3, "optimizer", 2, 5)
    assert drill.due(1, 3, first_incarnation=True)
    assert not drill.due(1, 3, first_incarnation=False)  # once per job: not after a restart
    assert not drill.due(0, 3, True) and not drill.due(1, 4, True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds no state of weight yet"):
        drill.apply(model, optimizer)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = optimizer.state[model.weight]["exp_avg"].clone()
    assert drill.apply(model, optimizer) == "bit 5 of element 2 of weight (exp_avg)"
    after = optimizer.state[model.weight]["exp_avg"]
    changed = (before.view(-1).view(torch.int32) ^ after.view(-1).view(torch.int32)).tolist()
    assert changed == [0, 0, 1 << 5] + [0] * 9
    weight = model.weight.detach().clone()
    assert BitflipDrill(0, 1).apply(model, optimizer) == "bit 12 of element 0 of weight"
    diff = weight.view(-1).view(torch.int32) ^ model.weight.detach().view(-1).view(torch.int32)
    assert diff.tolist() == [1 << 12] + [0] * 11
    with pytest.raises(ValueError, match="target 'gradient'"):
        BitflipDrill.parse("1:3:gradient")


# ---- the straggler drill (--inject-slowdown) -------------------------------------------------
_SPIN = ("import time, sys\n"
         "end = time.monotonic() + float(sys.argv[1]); n = 0\n"
         "while time.monotonic() < end:\n"
         "    n += 1\n"
         "print(n)\n")


def _spin_count(seconds: float, factor: float | None) -> int:
    """How far a busy loop gets in ``seconds`` of wall time, slowed by ``factor`` or not."""
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    helper = SlowdownDrill(0, factor).start(proc.pid) if factor else None
    try:
        out, _ = proc.communicate(timeout=seconds + 30)
    finally:
        if helper is not None:
            helper.terminate()
            helper.wait(timeout=10)
    return int(out)


def test_the_slowdown_drill_runs_a_process_at_a_fraction_of_its_speed_and_ends_with_it() -> None:
    plain, slowed = _spin_count(1.5, None), _spin_count(1.5, 3.0)
    # a third of the time running: about a third as far (the machine's noise: 0.15-0.55)
    assert 0.15 < slowed / plain < 0.55, (plain, slowed)


def test_the_slowdown_helper_leaves_its_process_running_when_it_ends() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        helper = SlowdownDrill(0, 4.0).start(proc.pid)
        wait_until(lambda: procfs.state(proc.pid) in ("T", "t"), 10, "stopped by the helper")
        helper.terminate()
        assert helper.wait(timeout=10) == 0
        assert procfs.state(proc.pid) not in ("T", "t")  # continued on its way out
    finally:
        proc.kill()
        proc.wait()
    helper = SlowdownDrill(0, 2.0).start(proc.pid)  # its process gone: it ends by itself
    assert helper.wait(timeout=10) == 0


def test_the_slowdown_drill_refuses_a_factor_that_slows_nothing() -> None:
    assert SlowdownDrill.parse("2:1.5:30") == SlowdownDrill(2, 1.5, 30)
    assert SlowdownDrill.parse("") is None
    with pytest.raises(ValueError, match="above 1"):
        SlowdownDrill.parse("0:1")


def test_three_ranks_sharing_two_busy_cores_name_nobody() -> None:
    """This machine's healthy three-rank runs: one step's local part anywhere between
    7 and 36 ms on any rank (their share of two cores), scores of one step from 0.3 to 3.6;
    verdicts on single steps, then on medians over windows (which jump between the two
    modes), named a healthy rank (tests/integration/test_stragglers.py, 2026-12-02). Over
    the windows' means, nobody, at the defaults."""
    for seed in range(3):
        rng, watch = random.Random(seed), StragglerWatch()
        for _ in range(10_000):
            times = {r: rng.choice((0.007, 0.009, 0.018, 0.022)) * rng.uniform(0.9, 1.6)
                     for r in range(3)}
            assert watch.step(times) == []
