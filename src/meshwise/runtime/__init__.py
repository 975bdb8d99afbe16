"""Runtime: launch-environment detection, process-group set-up, and spawning ranks."""
