"""Benchmarks behind `graphinfer bench ...`: each writes JSON and compares within one run."""
