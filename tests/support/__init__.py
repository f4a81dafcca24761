"""Generators and harnesses the tests and the benchmarks share (synthetic stores and spools, the profiler
mapping, the fault-injection harness). Not used by the product."""
