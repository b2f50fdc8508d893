"""graphgrad benchmarks, each runnable as ``python -m benchmarks.<name>``."""
