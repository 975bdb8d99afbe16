"""What a training run reports: per-epoch metrics (already reduced over the ranks) and a summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshwise.train.profile import table


@dataclass(frozen=True)
class EpochStats:
    """One epoch, over all ranks: loss/accuracy sums divided by the global sample counts."""

    epoch: int  # 1-based
    train_loss: float
    train_accuracy: float
    val_loss: float
    val_accuracy: float
    samples: int  # training samples processed by all ranks (padding included)
    seconds: float  # training time of the epoch, without validation

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def line(self, epochs: int) -> str:
        return (
            f"epoch {self.epoch:>{len(str(epochs))}}/{epochs}  train loss {self.train_loss:.4f}  "
            f"train acc {100 * self.train_accuracy:5.1f}%  val loss {self.val_loss:.4f}  "
            f"val acc {100 * self.val_accuracy:5.1f}%  {self.seconds:6.2f} s  "
            f"{self.samples_per_second:8.0f} samples/s"
        )


@dataclass(frozen=True)
class TrainResult:
    """The run as rank 0 saw it, returned to whoever started the job."""

    model: str
    dataset: str
    parameters: int
    world_size: int
    backend: str
    device: str
    batch_size: int  # per rank
    base_lr: float
    lr: float  # after linear scaling
    epochs: int
    first_epoch: int  # 0, or the epoch a resumed run started from
    history: tuple[EpochStats, ...]
    wall_seconds: float  # this invocation, from the first step to the last validation
    checkpoint: str | None
    zero: int = 0  # the ZeRO stage (0: DataParallel)
    memory: tuple[str, ...] = ()  # per-rank ZeRO memory report lines (empty for DataParallel)
    profile: dict | None = None  # rank 0's step breakdown (profile.breakdown) with --profile

    @property
    def final(self) -> EpochStats:
        return self.history[-1]

    @property
    def trained(self) -> tuple[EpochStats, ...]:
        """The epochs this invocation ran (a resumed run's history also holds the earlier ones)."""
        return self.history[self.first_epoch :]

    def summary(self) -> str:
        samples = sum(e.samples for e in self.trained)
        seconds = sum(e.seconds for e in self.trained)
        lines = ["", "===== TRAINING SUMMARY ====="]
        model = f"{self.model} ({self.parameters:,} parameters) on {self.dataset}"
        lines.append(f"Model               = {model}")
        ranks = f"{self.world_size} × {self.device} ({self.backend})"
        lines.append(
            f"Ranks               = {ranks}, batch {self.batch_size}/rank = "
            f"{self.batch_size * self.world_size} global, lr {self.lr:g} (base {self.base_lr:g})"
        )
        resumed = f", resumed after epoch {self.first_epoch}" if self.first_epoch else ""
        lines.append(f"Epochs              = {len(self.trained)} run{resumed}, {self.epochs} in total")
        lines.append(f"Validation accuracy = {100 * self.final.val_accuracy:.2f} %")
        lines.append(f"Final train loss    = {self.final.train_loss:.4f}")
        lines.append(
            f"Training time       = {seconds:.2f} s ({samples / seconds if seconds else 0:.0f} samples/s)"
        )
        lines.append(f"Wall time           = {self.wall_seconds:.3f} s")
        if self.checkpoint:
            lines.append(f"Checkpoint          = {self.checkpoint}")
        if self.zero:
            lines.append(
                f"Strategy            = ZeRO-{self.zero} (sharded data parallel, --zero {self.zero})"
            )
        for index, line in enumerate(self.memory):
            lines.append(f"{'Memory per rank' if index == 0 else '':<19} {'=' if index == 0 else ' '} {line}")
        if self.profile is not None:
            lines += ["", table(self.profile)]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["history"] = [asdict(e) | {"samples_per_second": e.samples_per_second} for e in self.history]
        data["val_accuracy"] = self.final.val_accuracy
        return data
