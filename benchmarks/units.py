"""Byte units, shared by the benchmarks and by report.py (which must load without torch)."""

GiB = 2**30
MiB = 2**20
