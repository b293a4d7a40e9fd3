"""The contract between an agent and its workers, and between agents, for live recovery.

``environment`` names the variables the agent sets for its workers; ``messages`` what it
announces in its store and what the workers set there; ``plan`` what a generation of the
world is (its members, ranks, what was lost) and how one is planned; ``peers`` how agents
reach each other's stores; ``state_wire`` the format of the state a survivor sends a
restarted worker; ``spare`` a hot spare's protocol; ``memory_tier`` what the agents'
snapshot holders and their workers say to each other.

Imports neither side (``elastic_train.agent``, ``elastic_train.worker``), so both read one
definition of each message (tests/unit/test_package_rules.py).
"""
