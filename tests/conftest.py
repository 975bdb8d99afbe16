"""Shared fixtures: multi-rank tests spawn ranks on CPU with gloo through meshwise.runtime.spawn."""
