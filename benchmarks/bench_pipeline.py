"""Pipeline parallel on 2 ranks: meshwise vs torch.distributed.pipelining, bubble and activation memory.

The same GPT is cut the same way (our balanced partition) for every contender; in one run the same two
processes hold:

- ``torch/gloo``: ``torch.distributed.pipelining`` ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``
  over the default gloo group (the baseline);
- ``meshwise/gloo``: our executor over the same gloo group;
- ``meshwise/shm``: our executor over the shared-memory transport.

Each round times ``--steps`` training steps (zero_grad, pipeline step, SGD) of every contender in turn,
the order rotating each round; a step's time is the slower rank's, in wall-clock time and in main-thread
CPU time (which leaves out time blocked in receives or descheduled by a busy machine). Reported: median
step time, the median of per-round ratios to torch with the same schedule and m, and for each of our
transports, as medians over every timed step:

- the measured bubble (one definition with the theory's, see docs/pipeline.md) next to the theory
  (p−1)/(m+p−1) and to the *replayed* bubble (the schedule re-run in the simulator with the measured op
  times and free messages: measured − replay is what messages, overheads and a busy machine cost;
  replay − theory is what uneven op times cost);
- ``floor``: the replayed makespan over torch's median step — the ratio no executor could beat with
  these op times even with free messages and no optimizer step;
- ``hop µs``: the latency the pipeline sees per message (a compute's end to the start of the compute it
  feeds on the other rank, where that rank sat idle);

the peak bytes of activations autograd holds on stage 0 (tensors saved for backward, parameters
excluded; same accounting for both libraries), and ``max |Δw|``, the largest difference between a
contender's weights and torch's after the run: the contenders train the same model. torch's schedule
leaves the two copies of the tied embedding/head matrix apart, so its step sums their gradients with one
all-reduce, as our executor does (without it the weights drift apart by ~3e-4 within a few steps).

    python benchmarks/bench_pipeline.py --json benchmarks/results/pipeline.json \
        --timeline-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch_baselines import pipeline_stepper

import meshwise
from meshwise.comm.api import ReduceOp
from meshwise.comm.shm import ShmCommunicator
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel import (
    Event,
    build_schedule,
    chunk_parameters,
    partition,
    theoretical_bubble,
)
from meshwise.parallel.pipeline_parallel.builder import build_pipeline, micro_batches_of
from meshwise.parallel.pipeline_parallel.partition import chunks_of_rank, tied_parameters
from meshwise.parallel.pipeline_parallel.timeline import (
    draw,
    gather_events,
    measured_bubble,
    message_hops,
    replay,
    write_trace,
)
from meshwise.runtime.spawn import spawn

#: ``--config``: the GPT every contender cuts into the same two stages. ``tiny`` (the default) is where
#: messages and executor overheads weigh most against compute that is still real; ``small`` has 4× the
#: compute per op and 4× the bytes per message; ``overhead`` is so small that compute is a fraction of a
#: millisecond and a step's time is what the executors themselves cost (instructions, messages,
#: synchronisation).
CONFIGS = {
    "tiny": GPTConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab=256),
    "small": GPTConfig(layers=4, hidden=128, heads=4, seq_len=128, vocab=256),
    "overhead": GPTConfig(layers=4, hidden=16, heads=2, seq_len=8, vocab=32),
}
MICRO = 4  # sequences per micro-batch
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
#: chunks per rank: interleaving runs two on each (v = 2), with the same loop placement in both libraries
VIRTUAL_STAGES = {"interleaved": 2}
TARGETS = {"meshwise/gloo": 1.0, "meshwise/shm": 0.8}  # step time vs torch/gloo, at most


class SavedBytes:
    """Bytes of non-parameter tensors autograd keeps for backward, current and peak."""

    def __init__(self, module: nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.current = self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def _pack(self, tensor: torch.Tensor) -> object:
        return _Held(tensor, self, tensor.untyped_storage().data_ptr() not in self._params)


class _Held:
    def __init__(self, tensor: torch.Tensor, owner: SavedBytes, counted: bool) -> None:
        self.tensor, self._owner = tensor, owner
        self._bytes = tensor.numel() * tensor.element_size() if counted else 0
        owner.current += self._bytes
        owner.peak = max(owner.peak, owner.current)

    def __del__(self) -> None:
        self._owner.current -= self._bytes


def _measured(module: nn.Module) -> SavedBytes:
    """Wrap ``module.forward`` so every forward records its saved tensors."""
    meter, forward = SavedBytes(module), module.forward

    def counted(*args: torch.Tensor) -> torch.Tensor:
        with meter.hooks():
            return forward(*args)

    module.forward = counted  # type: ignore[method-assign]
    return meter


def _data(config: GPTConfig, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, config.vocab, (MICRO * m, config.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _contenders(
    config: GPTConfig, rank: int, m: int, schedule: str, shm: ShmCommunicator, gloo
) -> dict[str, tuple]:
    """name → (step function, stage-0 memory meter, schedule its events follow, executor or None, this
    rank's modules) for one (schedule, m); every step function returns that step's F/B events."""
    torch.manual_seed(0)
    model = GPT(config)
    x, y = _data(config, m)
    out: dict[str, tuple] = {}
    v = VIRTUAL_STAGES.get(schedule, 1)
    for name, comm in (("meshwise/gloo", gloo), ("meshwise/shm", shm)):
        executor, chunks = build_pipeline(
            model, gpt_plan(model.config), comm, schedule=schedule, micro_batches=m, virtual_stages=v
        )
        meter = _measured(chunks[0])
        opt = torch.optim.SGD(chunk_parameters(chunks), lr=0.01)
        inputs, targets = micro_batches_of(x, m), micro_batches_of(y, m)

        def ours(executor=executor, opt=opt, inputs=inputs, targets=targets) -> list:
            opt.zero_grad()
            result = executor.step(inputs if rank == 0 else None, targets if rank == 1 else None)
            opt.step()
            return result.events

        out[name] = (ours, meter, executor.schedule, executor, chunks)
    plan = build_schedule(schedule, 2, m, v)
    local = chunks_of_rank(partition(model, gpt_plan(model.config), 2, v), rank, 2)
    meter = _measured(local[0])
    ids = plan.local_chunks(rank)
    stages = [PipelineStage(c, i, 2 * v, torch.device("cpu")) for c, i in zip(local, ids, strict=True)]
    pipe = TORCH_SCHEDULES[schedule](stages if v > 1 else stages[0], m, loss_fn=language_model_loss)
    timeline = _TorchTimeline(stages, pipe, rank)
    opt = torch.optim.SGD(chunk_parameters(local), lr=0.01)
    tied = tied_parameters(local)

    torch_step = pipeline_stepper(pipe, opt, tied, rank == 0, x, y)

    def theirs() -> list:
        timeline.events = []
        torch_step()
        return timeline.events

    # torch's GPipe and 1F1B run each rank's F and B in the order of ours, so our schedule replays them;
    # its interleaved order may differ, and then the replay is that of our order on its op times
    out["torch/gloo"] = (theirs, meter, plan, None, local)
    return out


class _TorchTimeline:
    """Our :class:`Event` records for torch's stage — F (with the loss on the last stage, as ours) and B
    of every micro-batch — so both executors' bubbles and message hops are measured the same way."""

    def __init__(self, stages: list[PipelineStage], pipe, rank: int) -> None:
        self.events: list[Event] = []
        self._rank = rank
        self._t0 = time.perf_counter() - time.time()  # wall clock at perf_counter resolution, as ours
        for stage in stages:
            chunk = stage.stage_index
            stage.forward_one_chunk = self._timed("F", chunk, stage.forward_one_chunk)  # type: ignore[method-assign]
            stage.backward_one_chunk = self._timed("B", chunk, stage.backward_one_chunk)  # type: ignore[method-assign]
        loss = pipe._maybe_compute_loss

        def loss_in_forward(*args, **kwargs):  # extends the forward it follows, as our F includes it
            result = loss(*args, **kwargs)
            if self.events and self.events[-1].op == "F":
                self.events[-1] = replace(self.events[-1], end=time.perf_counter() - self._t0)
            return result

        pipe._maybe_compute_loss = loss_in_forward

    def _timed(self, op: str, chunk: int, method: Callable) -> Callable:
        def timed(micro_batch: int, *args, **kwargs):
            start = time.perf_counter()
            result = method(micro_batch, *args, **kwargs)
            start, end = start - self._t0, time.perf_counter() - self._t0
            self.events.append(Event(self._rank, op, micro_batch, chunk, start, end))
            return result

        return timed


def _weight_drift(contenders: dict[str, tuple], comm) -> dict[str, float]:
    """Largest |w − torch's w| over both stages after every contender ran the same steps on the same data
    from the same weights: the executors train the same model, not merely run as fast."""
    theirs = {n: p for module in contenders["torch/gloo"][4] for n, p in module.named_parameters()}
    drift = {}
    for name, entry in contenders.items():
        worst = torch.zeros(1, dtype=torch.float64)
        for module in entry[4]:
            for n, p in module.named_parameters():
                worst[0] = max(worst[0].item(), (p.detach() - theirs[n].detach()).abs().max().item())
        comm.all_reduce(worst, ReduceOp.MAX)
        drift[name] = worst.item()
    return drift


def _time(step: Callable[[], list], steps: int) -> tuple[list[float], list[float], list[list]]:
    """Wall time and main-thread CPU time of each step (the slower rank's), and our executor's events.

    CPU time counts the Python and compute work of the step but not time spent blocked in a receive
    or descheduled by a busy machine, so it compares executors' own costs where wall time is noisy."""
    times, cpu, events = [], [], []
    for _ in range(steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        events.append(step())
        elapsed = torch.tensor([time.perf_counter() - start, time.thread_time() - start_cpu])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed[0].item())
        cpu.append(elapsed[1].item())
    return times, cpu, events


def _worker(
    config: GPTConfig,
    micro_batches: list[int],
    schedules: list[str],
    rounds: int,
    steps: int,
    warmup: int,
    timeline_dir: str | None,
) -> list[dict]:
    world = meshwise.init(backend="gloo")
    shm = ShmCommunicator(None)
    rows = []
    try:
        for m in micro_batches:
            for schedule in schedules:
                contenders = _contenders(config, world.rank, m, schedule, shm, world.comm)
                names = list(contenders)
                for name in names:  # warm-up: shapes, allocator, first-call costs
                    _time(contenders[name][0], warmup)
                per_round: dict[str, list[float]] = {n: [] for n in names}
                cpu_round: dict[str, list[float]] = {n: [] for n in names}
                timelines: dict[str, _Timelines] = {n: _Timelines() for n in names}
                for r in range(rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        times, cpu, events = _time(contenders[name][0], steps)
                        per_round[name].append(statistics.median(times))
                        cpu_round[name].append(statistics.median(cpu))
                        # after the timed steps: gathering is not timed
                        gathered = [gather_events(world.comm, e) for e in events]
                        if world.rank == 0:
                            timelines[name].add(contenders[name][2], gathered)  # type: ignore[arg-type]
                            if r == rounds - 1:
                                _save_timeline(timeline_dir, schedule, m, name, gathered[-1])  # type: ignore[arg-type]
                base = per_round["torch/gloo"]
                for name in names:
                    rows.append(
                        {
                            "schedule": schedule,
                            "micro_batches": m,
                            "contender": name,
                            "step_ms": statistics.median(per_round[name]) * 1e3,
                            "cpu_ms": statistics.median(cpu_round[name]) * 1e3,
                            "ratio_vs_torch": statistics.median(
                                a / b for a, b in zip(per_round[name], base, strict=True)
                            ),
                            "stage0_peak_activation_bytes": contenders[name][1].peak,
                            **timelines[name].summary(statistics.median(base)),
                            "bubble_theory": _theory(schedule, m),
                        }
                    )
                drift = _weight_drift(contenders, world.comm)
                for row in rows[-len(names) :]:
                    row["max_weight_diff_vs_torch"] = drift[row["contender"]]
                for _, _, _, executor, _ in contenders.values():
                    if executor is not None:
                        executor.close()
        return rows
    finally:
        shm.close()
        meshwise.shutdown()


class _Timelines:
    """Per-step figures of one contender's gathered timelines, over every timed step of every round."""

    def __init__(self) -> None:
        self.bubbles: list[float] = []
        self.replayed: list[float] = []
        self.floors: list[float] = []
        self.hops: list[float] = []

    def add(self, schedule, steps: list[list]) -> None:
        for events in steps:
            perfect = replay(schedule, events)
            self.bubbles.append(measured_bubble(events))
            self.replayed.append(perfect.bubble)
            self.floors.append(perfect.makespan)
            self.hops.extend(message_hops(schedule, events))

    def summary(self, torch_step: float) -> dict[str, float | None]:
        """Medians; ``floor_vs_torch`` is the replayed makespan (these op times, free messages, no
        optimizer step) over torch's median step: the ratio no executor could beat with these ops."""
        if not self.bubbles:
            return dict.fromkeys(("bubble_measured", "bubble_replayed", "floor_vs_torch", "hop_us"))
        return {
            "bubble_measured": statistics.median(self.bubbles),
            "bubble_replayed": statistics.median(self.replayed),
            "floor_vs_torch": statistics.median(self.floors) / torch_step,
            "hop_us": statistics.median(self.hops) * 1e6 if self.hops else None,
        }


def _save_timeline(directory: str | None, schedule: str, m: int, contender: str, events: list) -> None:
    if directory is None:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    suffix = {"meshwise/gloo": "", "meshwise/shm": "_shm", "torch/gloo": "_torch"}[contender]
    stem = Path(directory) / f"pipeline_{schedule}_m{m}{suffix}"
    write_trace(events, f"{stem}.json")
    draw(events, f"{stem}.png", title=f"{contender} {schedule}, p=2, m={m}", theory=_theory(schedule, m))


def _theory(schedule: str, m: int) -> float:
    return theoretical_bubble(2, m, VIRTUAL_STAGES.get(schedule, 1))


def _number(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _table(rows: list[dict]) -> str:
    lines = [
        f"{'schedule':>11} {'m':>3} {'contender':>14} {'step ms':>9} {'cpu ms':>7} {'vs torch':>9} "
        f"{'target':>7} {'floor':>6} {'stage0 act MiB':>15} {'bubble':>7} {'replay':>7} {'theory':>7} "
        f"{'hop µs':>7} {'max |Δw|':>9}"
    ]
    for r in rows:
        target = TARGETS.get(r["contender"])
        lines.append(
            f"{r['schedule']:>11} {r['micro_batches']:>3} {r['contender']:>14} {r['step_ms']:>9.1f} "
            f"{r['cpu_ms']:>7.1f} "
            f"{r['ratio_vs_torch']:>8.2f}x {('≤' + format(target, '.1f')) if target else '':>7} "
            f"{_number(r['floor_vs_torch'], '.2f'):>6} "
            f"{r['stage0_peak_activation_bytes'] / 2**20:>15.2f} {_number(r['bubble_measured'], '.1%'):>7} "
            f"{_number(r['bubble_replayed'], '.1%'):>7} {r['bubble_theory']:>7.1%} "
            f"{_number(r['hop_us'], '.0f'):>7} {r['max_weight_diff_vs_torch']:>9.1e}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default="4,8", help="comma-separated m values (default 4,8)")
    parser.add_argument(
        "--schedules", default="gpipe,1f1b", help="comma-separated, of gpipe,1f1b,interleaved (v = 2)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every contender (default 5)")
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per contender per round (default 3)"
    )
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny", help="the GPT (default tiny)")
    parser.add_argument("--overhead", action="store_true", help="the same as --config overhead")
    parser.add_argument("--json", default=None, help="write the rows as JSON")
    parser.add_argument("--timeline-dir", default=None, help="write pipeline_<schedule>_m<m>.{json,png} here")
    args = parser.parse_args()
    ms = [int(v) for v in args.micro_batches.split(",")]
    schedules = args.schedules.split(",")
    unknown = set(schedules) - set(TORCH_SCHEDULES)
    if unknown:
        parser.error(
            f"--schedules: {sorted(unknown)} not comparable; choose from {', '.join(TORCH_SCHEDULES)}"
        )
    config = CONFIGS["overhead" if args.overhead else args.config]
    work = (config, ms, schedules, args.rounds, args.steps, args.warmup, args.timeline_dir)
    rows = spawn(_worker, 2, args=work, timeout=1800)[0]
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": config.__dict__, "micro_batch": MICRO, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
