"""Benchmarks of the published claims, each measured side by side with its baseline.

    pagedllm bench throughput|memory|serving|roofline|attention|all --help

Every benchmark writes a JSON result (and PNG plots) under --out; docs/benchmarks.md describes them.
"""
