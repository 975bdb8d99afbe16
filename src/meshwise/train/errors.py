"""The one error type a training run stops with: a sentence for the user and the exit code it deserves."""

from __future__ import annotations


class TrainingError(Exception):
    """A run that cannot go on (diverged, checkpoint unwritable or unusable), said in one line.

    ``exit_code`` is 2 when the user's input is at fault (a checkpoint of other data, an unwritable
    directory) and 1 otherwise. Ranks return it rather than raise it, so the job that started them can
    print rank 0's sentence instead of a traceback; ``__reduce__`` keeps the code across the pipe.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return type(self), (str(self), self.exit_code)
