"""What a run tells its users, from its event log (elastic_train/events/): the Prometheus
metrics and their endpoint, the console progress, the end-of-run summary, and
``elastic-train report``.
"""
