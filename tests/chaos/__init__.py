"""Fault campaigns: seeded random faults in sequence across the hosts of a test bed.

schedule.py (which faults, when: pure, seeded, replayable), campaign.py (a job on the bed,
the faults applied, what a user relies on checked from outside), audit.py (the end's
checks: samples, checkpoints, leftovers). Run by tests/integration/test_fault_campaign.py
and the soak command benchmarks/chaos.py.
"""
