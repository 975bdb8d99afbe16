"""Scaling studies: run a workload at several rank counts and say whether — and why not — it scales."""
