"""The run's event log: every event's name and fields (schema.py), the log every process
appends to and reads back (log.py), and the line files it is made of (line_file.py). Below
everything that writes events (checkpoints, the worker, the agent) and everything that reads
them (observe/)."""
