"""The graphgrad command line and its demo."""
