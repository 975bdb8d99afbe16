"""Workloads users run to exercise and measure a job: the seeds' π computations (midpoint and Monte Carlo)."""
