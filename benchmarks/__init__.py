"""Benchmarks and results of graphgrad (not part of the installed package)."""
