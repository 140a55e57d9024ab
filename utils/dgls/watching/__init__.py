"""Watching: what the engine and the transport tell the parts that observe them.

Modules
    - ``listener.py``: the events (a use began, a copy was fetched or waited for, a copy in any direction, a
      pass ended).
    - ``stats.py``: swap statistics per backward pass, read without stalling the device.
    - ``profiler.py``: ``--profile``: a timeline of every direction's copies, compute and the waits between
      them (a feature and a listener).

May import: memory, streaming.
"""
