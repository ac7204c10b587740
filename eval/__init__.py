"""Evaluations of capgate against public benchmarks (not part of the installed package)."""
