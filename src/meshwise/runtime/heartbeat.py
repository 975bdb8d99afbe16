"""A line every few seconds while long work runs, so a terminal or a job log is never silent for minutes.

Long runs (π over 10¹¹ samples, a benchmark sweep, a scaling study) otherwise print nothing until they
end, which reads the same as a hang. The lines go to stderr, so stdout keeps only results that scripts
parse.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


@contextmanager
def heartbeat(
    what: str, *, every: float = 10.0, enabled: bool = True, stream: IO[str] | None = None
) -> Iterator[None]:
    """Print ``what: N s …`` every ``every`` seconds until the block ends (nothing for shorter work)."""
    if not enabled:
        yield
        return
    sink = stream if stream is not None else sys.stderr
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            sink.write(f"{what}: {time.monotonic() - start:.0f} s …\n")
            sink.flush()

    thread = threading.Thread(target=beat, name="meshwise-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
