"""The GPT training loop every rank runs: batches, steps, evaluation, checkpoints, progress, sample.

It is strategy-agnostic: the model is cut and stepped by the :class:`ParallelStep` that
:func:`~meshwise.train.gpt.parallelize.parallelize` returns, so every strategy reuses this loop unchanged.
Data and learning rate are pure functions of the step, so a resumed run restores model and optimizer
state, the next step and — for ``--dropout`` — each rank's random streams, and continues exactly
(:mod:`meshwise.train.random_state` says what another layout gets).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from rich.progress import TextColumn

from meshwise.comm.api import ReduceOp
from meshwise.comm.counting import CountingCommunicator
from meshwise.comm.mesh import AXES, MeshShape
from meshwise.data.local_tokenizer import FileTokenizer
from meshwise.data.tokens import ByteTokenizer
from meshwise.data.windows import lockstep_val_batches, train_batch
from meshwise.models.gpt import GPT
from meshwise.models.gpt_hf import save_hf_gpt2
from meshwise.parallel.context_parallel import split_sequence
from meshwise.runtime.cores import available_cores
from meshwise.train import checkpoint, random_state
from meshwise.train.checkpoint import GPT_FORMAT, GPT_READS
from meshwise.train.errors import TrainingError, launch, train_on_rank
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.init_from import load_weights
from meshwise.train.gpt.moe import moe_banner, router_report
from meshwise.train.gpt.parallelize import parallelize
from meshwise.train.gpt.peak import peak_flops, shared_cores_peak, thread_hint
from meshwise.train.gpt.peak_memory import MEASURED_STEPS, PeakMemory
from meshwise.train.gpt.profiling import GPTProfiling
from meshwise.train.gpt.report import GPTResult, StepStats, step_line
from meshwise.train.gpt.resolve import GPTRun, resolve
from meshwise.train.gpt.step_log import StepLog, checkpoint_due
from meshwise.train.loop_parts import Lifecycle
from meshwise.train.notes import start_notes
from meshwise.world import World

SAMPLE_PROMPT = "\ndef "


def train_gpt_rank_main(run: GPTRun) -> GPTResult | TrainingError | None:
    """Join the job on the run's mesh, train, leave; rank 0 returns the result (the others None)."""
    return train_on_rank(run.config.mesh, lambda world: GPTTrainer(world, run).run(), mesh=run.shape)


def run_gpt_training(config: GPTTrainConfig) -> GPTResult | None:
    """Resolve ``config`` here (validating it, building the default corpus if needed), train, and return
    rank 0's result (see :func:`launch`)."""
    return launch(train_gpt_rank_main, resolve(config), config.mesh)


class GPTTrainer(Lifecycle):
    """One rank's share of a GPT training run."""

    unit, stats = "step", StepStats

    def __init__(self, world: World, run: GPTRun) -> None:
        config = run.config
        super().__init__(world, config.output.checkpoint)
        self.resolved, self.config = run, config
        self.mesh = world.mesh.map_axes(CountingCommunicator) if config.profile.comm_stats else world.mesh
        self.dp, self.dp_rank = self.mesh.shape.batch_size, self.mesh.batch_index  # the batch axes
        self.splits = run.load_data()
        self.model_config = run.model_config
        self.seq_len = run.seq_len
        self.micro_batch = config.per_rank_micro_batch(self.dp)
        # from here: the bytes a plan predicts (see peak_memory)
        self.memory = PeakMemory(
            replace(self.model_config, seq_len=self.seq_len), self.micro_batch, world.device
        )
        torch.manual_seed(config.data.seed)
        model = GPT(self.model_config).to(world.device)
        init_from = config.model.init_from
        if init_from is not None and not config.output.resume:  # a resumed run continues its own weights
            load_weights(model, init_from)
        if config.model.compile:  # per block and in place: parameter names, so checkpoints, stay as they are
            for block in model.blocks:
                block.compile()
        self.step_runner = parallelize(model, self.mesh, run)
        del model  # this rank's shard lives on in the step runner
        self.memory.training_starts()
        self.first_step = 0
        self.initial_val_loss: float | None = None  # before the first step: the baseline learning beats
        self.saved_run: dict | None = None  # the resumed checkpoint's run record
        self.peak_notes: list[str] = []  # what the MFU peak had to assume (shared cores)
        # a resume's random streams, set when its first step starts (nothing before it may draw them away)
        self._resumed_random: Callable[[], None] | None = None
        self.random_note: str | None = None  # a resume that cannot continue the streams says so
        if config.output.resume:
            self._restore()
        steps = config.optimizer.steps
        self.profiling = GPTProfiling(world, run, self.step_runner, steps - self.first_step)
        self.step_log = StepLog(world.is_main, steps, config.output)

    # ------------------------------------------------------------------ checkpoints
    def _run_record(self, step: int) -> dict:
        """What run.json keeps beside the tensors and the history (see :mod:`meshwise.train.checkpoint`)."""
        data, seq_len = self.config.data, self.seq_len
        run = {"global_batch": data.global_batch, "seed": data.seed, "steps": self.config.optimizer.steps}
        position = {"seed": data.seed, "global_batch": data.global_batch, "seq_len": seq_len}
        return {
            "model": asdict(self.model_config),
            "run": run | {"config": self.config.model.config, "train_seq_len": seq_len},
            "world_size": self.world.world_size,
            "mesh": self.mesh.shape.sizes,
            "data": position | {"next_step": step},
            "initial_val_loss": self.initial_val_loss,
        }

    def save_checkpoint(self, step: int) -> None:
        """Collective: write the DCP checkpoint of ``step`` steps completed, with this rank's random
        streams (:meth:`save`)."""
        state = self.step_runner.state_dict()
        state["rng"] = {self._rank_key: random_state.capture([self.step_runner.model], self.world.device)}
        keep = self.config.output.keep
        self.save(step, step, state, self._run_record(step), format=GPT_FORMAT, keep=keep)

    @property
    def _rank_key(self) -> str:
        return random_state.rank_key(self.mesh.coordinates)

    def _restore(self) -> None:
        assert self.directory is not None
        state = self.step_runner.state_dict()
        run = checkpoint.read_run(self.directory, GPT_READS, "GPT ")
        models, device = [self.step_runner.model], self.world.device
        same_layout = run.get("mesh") == self.mesh.shape.sizes
        if same_layout:  # this rank's own streams, filled in place by the load
            state["rng"] = {self._rank_key: random_state.capture(models, device)}
        self.load(run, state)
        self.saved_run = run
        self.first_step = self.kept = checkpoint.next_step(run)
        self.initial_val_loss = run["initial_val_loss"]
        if same_layout:
            streams = state["rng"][self._rank_key]
            self._resumed_random = lambda: random_state.restore(streams, models, device)
            return
        coordinates, seed, step = self.mesh.coordinates, self.config.data.seed, self.first_step
        self._resumed_random = lambda: random_state.rederive(seed, step, coordinates, models)
        if self.model_config.dropout:
            why = (
                f"was written by another layout ({MeshShape(**run['mesh']).describe()})"
                if "mesh" in run
                else f"(format {run['format']}) holds no random streams"
            )
            self.random_note = (
                f"the checkpoint {why}, so its random streams are not continued: --dropout draws "
                f"masks re-derived from (--seed, step {step}) — deterministic, but not the uninterrupted "
                "run's (resume on the layout that wrote it to continue exactly)"
            )

    # ------------------------------------------------------------------ steps
    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's micro-batches of 0-based ``step`` (its slice of the same global batch), under
        --cp this rank's chunks of each sequence."""
        data = self.config.data
        inputs, targets = train_batch(
            self.splits, self.seq_len, data.global_batch, data.seed, step, self.dp_rank, self.dp
        )
        cp = self.mesh.cp
        inputs, targets = (split_sequence(t, cp.world_size, cp.rank) for t in (inputs, targets))
        device = self.world.device
        return [
            (x.to(device), y.to(device))
            for x, y in zip(inputs.split(self.micro_batch), targets.split(self.micro_batch), strict=True)
        ]

    def train_step(self, step: int) -> StepStats:
        """One optimizer step (0-based ``step``); the returned loss is the global batch's mean."""
        optimizer, runner, profiling = self.config.optimizer, self.step_runner, self.profiling
        if self._resumed_random is not None:
            self._resumed_random()
            self._resumed_random = None
        lr = optimizer.lr_at(step)
        with profiling.step():
            started = time.perf_counter()
            with runner.phase("optimizer"):
                for group in runner.optimizer.param_groups:
                    group["lr"] = lr
                runner.optimizer.zero_grad(set_to_none=True)
            with runner.phase("data"):
                batches = self.micro_batches(step)
            with runner.phase("forward_backward"):
                local = runner.forward_backward(batches)
            with runner.phase("optimizer"):
                norm = runner.clip_grad_norm(optimizer.grad_clip)
                runner.optimizer.step()
            loss = torch.tensor([local], dtype=torch.float64)
            # over the ranks reading other sequences and (cp) other tokens of them: equal token counts
            self.mesh.replicas.all_reduce(loss, ReduceOp.AVG)
            seconds = time.perf_counter() - started
        if not math.isfinite(loss.item()):  # the same on every rank: the loss is known everywhere
            _, where = self.first_diverged(0 if math.isfinite(local) else step + 1)
            raise TrainingError(
                f"training diverged: the loss became {loss.item()} at step {step + 1}{where} "
                f"(lr {self.config.optimizer.lr:g}); lower --lr"
            )
        return StepStats(
            step + 1, loss.item(), lr, norm, seconds, self.config.data.global_batch * self.seq_len
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over the fixed validation windows, summed over the dp ranks and the cp
        ranks' chunks (every rank runs as many forwards as the busiest, since a sharded forward is
        collective)."""
        self.step_runner.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        cp = self.mesh.cp
        for inputs, targets, counted in lockstep_val_batches(
            self.splits, self.seq_len, self.config.data.eval_windows, self.micro_batch, self.dp_rank, self.dp
        ):
            inputs, targets = (split_sequence(t, cp.world_size, cp.rank) for t in (inputs, targets))
            loss = self.step_runner.eval_loss_sum(inputs.to(self.world.device), targets.to(self.world.device))
            if counted:
                totals += torch.tensor([loss.item(), targets.numel()], dtype=torch.float64)
        self.step_runner.model.train()
        self.mesh.replicas.all_reduce(totals, ReduceOp.SUM)
        return (totals[0] / totals[1]).item()

    def sample(self, tokens: int) -> str | None:
        """Collective: rank 0's ``tokens`` generated after a fixed prompt (bytes decoded as text; ids shown
        for a larger vocab)."""
        model = self.step_runner.sampling_model()
        if not self.world.is_main:
            return None
        model.eval()
        path = self.resolved.tokenizer
        tokenizer = ByteTokenizer() if path is None else FileTokenizer(path)
        prompt = torch.tensor(tokenizer.encode(SAMPLE_PROMPT).astype("int64"), device=self.world.device)
        generator = torch.Generator(device=self.world.device).manual_seed(self.config.data.seed)
        out = model.generate(prompt[None], tokens, temperature=0.8, top_k=40, generator=generator)[0].tolist()
        model.train()
        decodable = self.model_config.vocab <= 256 or path is not None
        return tokenizer.decode(out) if decodable else " ".join(map(str, out))

    def export_hf(self, directory: str) -> str | None:
        """Collective: rank 0 writes the trained weights in Hugging Face GPT-2 format (safetensors +
        config.json) and returns the file."""
        model = self.step_runner.sampling_model()
        return str(save_hf_gpt2(model, directory)) if self.world.is_main else None

    # ------------------------------------------------------------------ the run
    def _peak(self) -> tuple[float, str]:
        """All ranks' peak FLOP/s, measured at the same moment (ranks may share cores)."""
        self.world.comm.barrier()
        mine, source = peak_flops(self.world.device, self.config.model.torch_dtype)
        total = torch.tensor([mine], dtype=torch.float64)
        self.world.comm.all_reduce(total, ReduceOp.SUM)
        if source == "measured":  # CPU ranks may share this host's cores: see shared_cores_peak
            return self._shared_cores_peak(total.item(), mine), source
        return total.item(), source

    def _shared_cores_peak(self, summed: float, mine: float) -> float:
        """The summed peak capped at this host's cores (every node alike), and the notes it implies."""
        threads = torch.get_num_threads()
        best = torch.tensor([mine / threads], dtype=torch.float64)
        self.world.comm.all_reduce(best, ReduceOp.MAX)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world.world_size))
        nodes = max(1, self.world.world_size // local)
        cores = available_cores()
        peak, note = shared_cores_peak(summed / nodes, best.item(), local * threads, cores)
        self.peak_notes = [n for n in (note,) if n]
        if self.world.world_size == 1:
            self.peak_notes += [n for n in (thread_hint(threads, cores, os.getloadavg()[0]),) if n]
        return peak * nodes

    def run(self) -> GPTResult:
        config, world = self.config, self.world
        with torch.device("meta"):  # counted, not reassembled: a sharded full_model() is a whole copy
            parameters = sum(p.numel() for p in GPT(self.model_config).parameters())
        flops = replace(self.model_config, seq_len=self.seq_len).flops_per_token()
        peak, source = self._peak()
        if world.is_main:
            self.console.print(
                f"meshwise train gpt: {config.model_name} ({parameters:,} parameters) on {self.splits.name} "
                f"({len(self.splits.train):,} training tokens), {self.ranks()}, "
                f"global batch {config.data.global_batch} × {self.seq_len}"
            )
            if (experts := moe_banner(self.model_config)) is not None:
                self.console.print(experts)
            notes = [*start_notes(self.resolved, self.model_config.vocab, self.saved_run), *self.peak_notes]
            for note in [*notes, *([self.random_note] if self.random_note else [])]:
                self.console.print(f"note: {note}")
        if self.first_step == 0:
            self.initial_val_loss = self.evaluate()
        started, steps = time.perf_counter(), config.optimizer.steps
        with self.progress_bar(TextColumn("{task.fields[status]}")) as progress:
            task = progress.add_task("train", total=steps, completed=self.first_step, status="")
            for step in range(self.first_step, steps):
                stats = self.train_step(step)
                if step + 1 - self.first_step == MEASURED_STEPS:
                    self.memory.stop()  # the peak is in; the sampler need not run on
                last = step + 1 == steps
                if (step + 1) % config.data.eval_every == 0 or last:
                    stats = replace(stats, val_loss=self.evaluate())
                self.history.append(stats)
                mfu = stats.tokens_per_second * flops / peak
                progress.update(
                    task, advance=1, status=f"loss {stats.loss:.3f}  {stats.tokens_per_second:,.0f} tok/s"
                )
                self.step_log.after_step(stats, mfu, progress.console)
                if stats.val_loss is not None:
                    router = router_report(self.step_runner.model, self.mesh, self.model_config.layers)
                    if world.is_main:
                        progress.console.print(step_line(stats, steps, mfu))
                        if router is not None:
                            progress.console.print(f"  {router.line()}")
                if checkpoint_due(config, step + 1, evaluated=stats.val_loss is not None):
                    self.save_checkpoint(step + 1)
        self.step_log.close()
        peak_memory = self._peak_memory()
        self.step_runner.finish()
        output = config.output
        text = self.sample(output.sample) if output.sample else None
        exported = self.export_hf(output.export_hf) if output.export_hf is not None else None
        notes = tuple(self.step_runner.summary_lines())
        return GPTResult(
            model=config.model_name,
            parameters=parameters,
            dataset=self.splits.name,
            world_size=world.world_size,
            mesh=self.mesh.shape.describe(),
            backend=world.backend,
            device=str(world.device),
            dtype=config.model.dtype,
            global_batch=config.data.global_batch,
            micro_batch=self.micro_batch,
            accumulation=config.accumulation(self.dp),
            seq_len=self.seq_len,
            steps=steps,
            first_step=self.first_step,
            initial_val_loss=self.initial_val_loss,
            history=tuple(self.history),
            flops_per_token=flops,
            peak_flops=peak,
            peak_source=source,
            wall_seconds=time.perf_counter() - started,
            checkpoint=self.checkpoint,
            sample=text,
            comm_stats=self._comm_stats(),
            peak_memory=peak_memory,
            exported=exported,
            profile=self.profiling.finish(),
            notes=notes,
            strategy={
                "dp": self.dp,
                "tp": self.mesh.shape.tp,
                "pp": self.mesh.shape.pp,
                "cp": self.mesh.shape.cp,
                "ep": self.mesh.shape.ep,
                "zero": config.mesh.zero,
                "sp": config.mesh.sp,
                "schedule": config.mesh.schedule if self.mesh.shape.pp > 1 else None,
                "virtual_stages": config.mesh.virtual_stages,
                "micro_batches": config.accumulation(self.dp),
                "micro_batch_size": self.micro_batch,
            },
            outputs={
                flag: path
                for flag, path in (
                    ("Trace", config.profile.trace),
                    ("Timeline", config.profile.timeline),
                    ("Torch profile", config.profile.torch_profile),
                    ("Metrics", config.output.metrics),
                )
                if path is not None
            },
        )

    def _peak_memory(self) -> dict[str, int | None]:
        """Collective: the fullest rank's peak bytes during the steps (see :mod:`peak_memory`)."""
        mine = self.memory.stop()
        keys = sorted(mine)
        values = torch.tensor([-1 if mine[k] is None else mine[k] for k in keys], dtype=torch.float64)
        self.world.comm.all_reduce(values, ReduceOp.MAX)
        return {k: None if v < 0 else int(v) for k, v in zip(keys, values.tolist(), strict=True)}

    def _comm_stats(self) -> dict[str, dict[str, dict[str, float]]] | None:
        if not self.config.profile.comm_stats:
            return None
        return {axis: self.mesh[axis].stats.as_dict() for axis in AXES if getattr(self.mesh.shape, axis) > 1}
