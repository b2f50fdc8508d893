"""The graphgrad command line."""
