"""Benchmarks: `memories bench <name>`. Each prints a table; none is a timed test."""
