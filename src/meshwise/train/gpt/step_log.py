"""Which steps a GPT run reports and checkpoints: progress lines, the ``--metrics`` stream, checkpoints.

Every evaluation step is reported; ``--log-every N`` adds every N-th step, printed as a plain line
whether or not stdout is a terminal (a batch job's log has no progress bar). Each reported step is also
one JSON line of the ``--metrics`` stream (:mod:`meshwise.train.metrics_stream`) and, with
``--tensorboard DIR``, scalars in TensorBoard's own event-file format (torch's writer, which needs the
optional ``tensorboard`` package). Only rank 0 reports; the other ranks' calls return at once.
"""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console

from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.report import StepStats, step_line
from meshwise.train.gpt.sections import GPTOutputSection
from meshwise.train.metrics_stream import MetricsStream


class StepLog:
    """Rank 0's reporting of logged steps; :meth:`close` at the end of the run."""

    def __init__(self, is_main: bool, steps: int, output: GPTOutputSection) -> None:
        self.is_main, self.steps, self.log_every = is_main, steps, output.log_every
        self.stream = MetricsStream(output.metrics) if is_main and output.metrics is not None else None
        self.board = None
        if is_main and output.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir=output.tensorboard)

    def after_step(self, stats: StepStats, mfu: float, console: Console) -> None:
        """Report ``stats`` if it is a logged step (an evaluation, a --log-every step, the last with
        --log-every): a line unless the evaluation prints one, a record."""
        evaluated, every = stats.val_loss is not None, self.log_every
        due = every is not None and (stats.step % every == 0 or stats.step == self.steps)
        if not self.is_main or not (evaluated or due):
            return
        if not evaluated:
            console.print(step_line(stats, self.steps, mfu))
        record = asdict(stats) | {"tokens_per_second": stats.tokens_per_second, "mfu": mfu}
        if self.stream is not None:
            self.stream.write(record)
        if self.board is not None:
            for name in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_second", "mfu"):
                if record[name] is not None:
                    self.board.add_scalar(f"train/{name}", record[name], stats.step)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.board is not None:
            self.board.close()


def checkpoint_due(config: GPTTrainConfig, step: int, *, evaluated: bool) -> bool:
    """Is a checkpoint written after 1-based ``step``? At every evaluation by default; with
    ``--checkpoint-every N`` every N-th step and the last one instead, whatever the evaluations do."""
    every = config.output.checkpoint_every
    if config.output.checkpoint is None:
        return False
    if every is None:
        return evaluated
    return step % every == 0 or step == config.optimizer.steps


def check_tensorboard() -> None:
    """``--tensorboard`` needs the optional ``tensorboard`` package: say so before any rank starts."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install 'meshwise[tensorboard]'"
        ) from None
