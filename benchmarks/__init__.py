"""graphgrad benchmarks (not part of the installed package).

Each is runnable as ``python -m benchmarks.<name>``.
"""
