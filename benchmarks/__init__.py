"""Benchmarks: scripts that measure and print figures (run with ``python -m benchmarks.NAME``)."""
