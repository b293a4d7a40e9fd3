"""Wrong or slow nodes (issue 41): what a replica's state must equal, who disagrees, who is
slow. Pure parts, each with its own test; the loops wire them in.

- ``fingerprint``: a checksum of a replica's state (parameters, optimizer state) computed
  where the tensors live, equal across replicas exactly when their bits are;
- ``verdict``: the fingerprints of a replica group compared: agreement, or the ranks named;
- ``stragglers``: per-rank step times turned into a straggler score and a policy;
- ``bitflip``: the drill that flips one chosen bit of a chosen tensor (tests, users' drills).
"""
