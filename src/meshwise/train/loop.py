"""The ``train mlp|cnn|deep-mlp`` loop every rank runs: shard, step, reduce the metrics, checkpoint, report.

It is the seeds' DDP recipe with the pitfalls handled in one place: the sampler is re-seeded every epoch
(``set_epoch``), the learning rate is scaled with the number of ranks, validation accuracy is a sum over
every rank's shard (not rank 0's guess), rank 0 alone prints, and a resumed run restores model,
optimizer, sampler and generator so it continues exactly where the checkpoint left off. The model is cut
and stepped by the seam's :class:`~meshwise.train.step.ParallelStep`, as ``train gpt``'s is
(DataParallelStep, or ZeroStep with ``--zero N``), so a run resumes on any number of ranks and any
``--zero`` stage.
"""

from __future__ import annotations

import base64
import contextlib
import math
import time
from typing import Any

import torch
from rich.progress import Progress
from torch import nn

from meshwise.comm.api import ReduceOp
from meshwise.data import DistributedSampler, Splits
from meshwise.parallel.state_dict import PlainLayout
from meshwise.train.checkpoint import TRAIN_FORMAT, read_train_run, run_file
from meshwise.train.config import TrainConfig
from meshwise.train.errors import TrainingError, launch, train_on_rank
from meshwise.train.loop_parts import Lifecycle
from meshwise.train.notes import check_dataset, resume_notes
from meshwise.train.profile import StepProfiler
from meshwise.train.report import EpochStats, TrainResult
from meshwise.train.resolve import resolve
from meshwise.train.step import DataParallelStep, Local, ParallelStep, loss_only
from meshwise.train.zero_step import ZeroStep
from meshwise.world import World

_EVAL_BATCH = 1024


def train_rank_main(config: TrainConfig) -> TrainResult | TrainingError | None:
    """Join the job, train, leave; rank 0 returns the result (the others None).

    A :class:`TrainingError` is returned, not raised, by every rank (they all reach it together: it is
    decided on reduced values), so that whoever started the job prints one sentence, not a traceback.
    """
    debug = config.profile.debug or None  # None: as `meshwise run --debug` says
    return train_on_rank(config.mesh, lambda world: Trainer(world, config).run(), debug=debug)


def run_training(config: TrainConfig) -> TrainResult | None:
    """Resolve ``config`` here (validating it), train, and return rank 0's result (see :func:`launch`)."""
    return launch(train_rank_main, resolve(config), config.mesh)


class Trainer(Lifecycle):
    """One rank's share of a data-parallel training run."""

    unit, stats = "epoch", EpochStats

    def __init__(self, world: World, config: TrainConfig) -> None:
        super().__init__(world, config.output.checkpoint)
        self.config = config
        workload = config.workload
        self.splits: Splits = workload.load_data(config.data.data_dir)
        torch.manual_seed(config.data.seed)
        model = workload.build_model(self.splits).to(world.device)
        self.parameters = sum(p.numel() for p in model.parameters())
        self.lr = config.base_lr * (world.world_size if config.optimizer.lr_scaling else 1)
        self.sampler = DistributedSampler(
            len(self.splits.train), world.world_size, world.rank, seed=config.data.seed
        )
        self.val_indices = DistributedSampler(
            len(self.splits.val), world.world_size, world.rank, shuffle=False, remainder="uneven"
        ).indices()
        self.steps_per_epoch = math.ceil(len(self.sampler) / config.per_rank_batch)
        self.first_epoch = 0
        self.step = 0  # optimizer steps taken, over every run of this checkpoint (names its directory)
        self.scored = Scored()
        self.step_runner = self._parallelize(model)
        self.model = self.step_runner.model  # what runs forward: the DataParallel or ZeRO wrapper
        if config.output.resume:
            self._restore()
        self.profiler: StepProfiler | None = None
        if config.profile.profiling:
            self.profiler = StepProfiler([world.comm], synchronize=world.device)
        self.step_runner.profiler = self.profiler

    def _parallelize(self, model: nn.Module) -> ParallelStep:
        """The seam's step over every rank (``world.mesh``: all of them on dp): DataParallel, or ZeRO of
        ``--zero``'s stage; plain AdamW at the scaled lr (no decay groups) over what the step updates."""

        def adamw(module: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.AdamW(module.parameters(), lr=self.lr)

        plain = PlainLayout.of(model, adamw(model))  # the one-process names, before any wrapper
        local = Local(model, self.scored, loss_only, exchange_timer=None)
        zero = self.config.mesh.zero
        mesh = self.world.mesh
        step = ZeroStep(local, mesh, adamw, zero) if zero else DataParallelStep(local, mesh, adamw)
        step.plain, step.plain_model = plain, lambda: self.config.workload.build_model(self.splits)
        return step

    def _restore(self) -> None:
        """Model and optimizer (any layout's checkpoint), sampler, generator, epoch, step and history."""
        assert self.directory is not None
        run = read_train_run(self.directory)  # before any rank reads a tensor
        check_dataset(run.get("dataset"), self.splits.name, str(run_file(self.directory)))
        self.load(run, self.step_runner.state_dict())
        self.sampler.load_state_dict(run["sampler"])
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(run["rng"])), dtype=torch.uint8))
        self.first_epoch = self.kept = int(run["epoch"])
        self.step = int(run["step"])
        if self.world.is_main:
            for note in resume_notes(run["run"], self._run_settings()):
                print(f"note: {note}", flush=True)

    def _run_settings(self) -> dict[str, Any]:
        return {
            "world_size": self.world.world_size,
            "batch_size": self.config.per_rank_batch,
            "base_lr": self.config.base_lr,
            "lr": self.lr,
            "seed": self.config.data.seed,
            "epochs": self.config.total_epochs,
        }

    def _checkpoint(self, epoch: int) -> None:
        """Collective: every rank writes its part of the checkpoint of ``epoch`` (its ZeRO shards, or
        its share of the replicated tensors) unless a rank's weights became non-finite (:meth:`save`)."""
        finite = all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        if not self.everywhere(finite):
            raise TrainingError(f"the weights became non-finite in epoch {epoch}; not saved, {self.left}")
        state, record = self.step_runner.state_dict(), self._run_record(epoch)
        self.save(epoch, self.step, state, record, format=TRAIN_FORMAT)

    def _run_record(self, epoch: int) -> dict[str, Any]:
        """What run.json keeps beside the tensors and the history (see :mod:`meshwise.train.checkpoint`)."""
        return {
            "model": self.config.model,
            "dataset": self.splits.name,
            "epoch": epoch,
            "zero": self.config.mesh.zero,
            "sampler": self.sampler.state_dict(),
            "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
            "run": self._run_settings(),
        }

    # ------------------------------------------------------------------ steps
    def _lr_at(self, step: int) -> float:
        """Cosine decay from the scaled lr to zero over the whole run, a pure function of the step: a
        resumed run needs no scheduler state to continue on the same curve."""
        total = self.steps_per_epoch * self.config.total_epochs
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * step / total))

    def _train_epoch(self, epoch: int, progress: Progress | None) -> torch.Tensor:
        """Run one epoch on this rank's shard; return [loss sum, samples, correct, first step (1-based)
        whose loss was non-finite or 0] (float64, kept on the device)."""
        data, device, batch = self.splits.train, self.world.device, self.config.per_rank_batch
        self.sampler.set_epoch(epoch)
        indices = self.sampler.indices()
        totals = torch.zeros(4, dtype=torch.float64, device=device)
        progress = progress or Progress(disable=True)
        task = progress.add_task(f"epoch {epoch + 1}", total=self.steps_per_epoch)
        self.model.train()
        for step in range(self.steps_per_epoch):
            with self._step():
                with self.step_runner.phase("data"):
                    chunk = indices[step * batch : (step + 1) * batch]
                    inputs, targets = data.inputs[chunk].to(device), data.targets[chunk].to(device)
                optimizer = self.step_runner.optimizer
                for group in optimizer.param_groups:
                    group["lr"] = self._lr_at(epoch * self.steps_per_epoch + step)
                with self.step_runner.phase("optimizer"):
                    optimizer.zero_grad()
                # the step's forward and backward phases; gradients come back averaged over the ranks
                self.step_runner.forward_backward([(inputs, targets)])
                with self.step_runner.phase("optimizer"):
                    optimizer.step()
                self.step += 1
                loss = self.scored.loss
                with torch.no_grad():  # metric bookkeeping: the profile's "other"
                    totals[:3] += torch.stack(
                        [loss.double() * len(chunk), totals.new_tensor(len(chunk)), self.scored.correct]
                    )
                    first = (totals[3] == 0) & ~torch.isfinite(loss)
                    totals[3] = torch.where(first, totals.new_tensor(step + 1), totals[3])
                progress.update(task, advance=1)
        progress.remove_task(task)
        return totals

    def _step(self) -> contextlib.AbstractContextManager:
        return self.profiler.step() if self.profiler is not None else contextlib.nullcontext()

    def _profile_result(self) -> dict | None:
        """Rank 0's breakdown (and the trace of every rank, gathered on the control plane)."""
        if self.profiler is None or not self.profiler.steps:
            return None
        return self.profiler.summary(self.world.rank, self.world.world_size, self.config.profile.trace)

    @torch.no_grad()
    def _evaluate(self) -> torch.Tensor:
        """[loss sum, samples, correct] over this rank's share of the validation set."""
        part, device = self.splits.val, self.world.device
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        self.model.eval()
        for start in range(0, len(self.val_indices), _EVAL_BATCH):
            chunk = self.val_indices[start : start + _EVAL_BATCH]
            inputs, targets = part.inputs[chunk].to(device), part.targets[chunk].to(device)
            loss = self.step_runner.eval_loss_sum(inputs, targets)
            totals += torch.stack([loss.double(), totals.new_tensor(len(chunk)), self.scored.correct])
        return totals

    # ------------------------------------------------------------------ the run
    def run_epoch(self, epoch: int, progress: Progress | None = None) -> EpochStats:
        """Train and validate one epoch (0-based), reduce its metrics over the ranks, checkpoint it."""
        started = time.perf_counter()
        train = self._train_epoch(epoch, progress)
        seconds = time.perf_counter() - started
        totals = torch.cat([train[:3], self._evaluate()])
        self.world.comm.all_reduce(totals, ReduceOp.SUM)
        t_loss, t_n, t_ok, v_loss, v_n, v_ok = totals.tolist()
        if not (math.isfinite(t_loss) and math.isfinite(v_loss)):  # the same on every rank: reduced
            bad = t_loss if not math.isfinite(t_loss) else v_loss
            step, where = self.first_diverged(int(train[3].item()))
            first = f", first{where} at step {step} of {self.steps_per_epoch}" if step else ""
            saved = "" if self.directory is None else f" (not saved: {self.left})"
            raise TrainingError(
                f"training diverged: the loss became {bad} in epoch {epoch + 1}{first} at lr {self.lr:g}"
                f"{saved}; lower --lr"
            )
        stats = EpochStats(epoch + 1, t_loss / t_n, t_ok / t_n, v_loss / v_n, v_ok / v_n, int(t_n), seconds)
        self.history.append(stats)
        if self.directory is not None:
            self._checkpoint(epoch + 1)
        return stats

    def run(self) -> TrainResult:
        """Every remaining epoch, with a progress bar and a line per epoch on rank 0."""
        parameters = self.parameters
        world, epochs = self.world, self.config.total_epochs
        if world.is_main:
            self.console.print(
                f"meshwise train {self.config.model}: {parameters:,} parameters on {self.splits.name}, "
                f"{self.ranks()}"
            )
            shard = len(self.sampler)
            if self.config.per_rank_batch > shard:  # legal (full-batch steps), but rarely what was meant
                self.console.print(
                    f"note: --batch-size {self.config.per_rank_batch} is above the {shard} training "
                    f"samples of each rank's shard: every step uses the whole shard ({self.steps_per_epoch} "
                    "step per epoch)"
                )
        started = time.perf_counter()
        with self.progress_bar() as progress:
            for epoch in range(self.first_epoch, epochs):
                stats = self.run_epoch(epoch, progress)
                if world.is_main:
                    progress.console.print(stats.line(epochs))
        return TrainResult(
            model=self.config.model,
            dataset=self.splits.name,
            parameters=parameters,
            world_size=world.world_size,
            backend=world.backend,
            device=str(world.device),
            batch_size=self.config.per_rank_batch,
            base_lr=self.config.base_lr,
            lr=self.lr,
            epochs=epochs,
            first_epoch=self.first_epoch,
            history=tuple(self.history),
            wall_seconds=time.perf_counter() - started,
            checkpoint=self.checkpoint,
            zero=self.config.mesh.zero,
            memory=tuple(self.step_runner.memory_lines()),
            profile=self._profile_result(),
        )


class Scored:
    """A classifier's cross-entropy (the step's loss) that keeps, of the last batch it scored, the loss
    and the number of right predictions: the metrics the loop sums on the device."""

    loss: torch.Tensor
    correct: torch.Tensor

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = nn.functional.cross_entropy(logits, targets, reduction=reduction)
        self.loss, self.correct = loss.detach(), (logits.argmax(1) == targets).sum()
        return loss
