"""What a run tells its users: the event schema and log every process appends to, the
Prometheus metrics and their endpoint, the console progress, the end-of-run summary, and
``elastic-train report``.
"""
