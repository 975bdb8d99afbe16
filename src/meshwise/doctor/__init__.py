"""``meshwise doctor``: check what breaks distributed jobs on this machine, and say how to fix it."""

from meshwise.doctor.checks import Check, run_checks

__all__ = ["Check", "run_checks"]
