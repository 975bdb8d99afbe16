"""``meshwise train gpt`` settings: the sections of :mod:`meshwise.train.gpt.sections`, how they fit
together, and what follows from them alone; the machine is read by :mod:`meshwise.train.gpt.resolve`."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshwise.comm.mesh import MeshShape
from meshwise.train.gpt.moe import check_moe_training
from meshwise.train.gpt.sections import (
    DataSection,
    GPTMeshSection,
    GPTOutputSection,
    GPTProfileSection,
    ModelSection,
    OptimizerSection,
)
from meshwise.train.sections import FlagSections

#: Default training context on a CPU: a longer one makes the default run take far more than minutes.
CPU_SEQ_LEN = 128
DEFAULT_MODEL = "gpt-nano"


@dataclass(frozen=True)
class GPTTrainConfig(FlagSections):
    """One GPT training run, as its flags say it. Build it with :meth:`from_flags` (``tp=2, global_batch=4``;
    the rest default)."""

    mesh: GPTMeshSection = field(default_factory=GPTMeshSection)
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataSection = field(default_factory=DataSection)
    output: GPTOutputSection = field(default_factory=GPTOutputSection)
    profile: GPTProfileSection = field(default_factory=GPTProfileSection)

    @property
    def model_name(self) -> str:
        """What the run trains, for banners and results: the --config name, or where --init-from points."""
        if self.model.config is not None:
            return self.model.config
        return f"GPT-2 from {self.model.init_from}" if self.model.init_from is not None else DEFAULT_MODEL

    def mesh_shape(self, world_size: int) -> MeshShape:
        m = self.mesh
        return MeshShape.infer(world_size, dp=m.dp, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep)

    def accumulation(self, dp: int) -> int:
        """Micro-batches per rank per step: global batch = dp · micro-batch · accumulation."""
        return self.data.global_batch // (dp * self.per_rank_micro_batch(dp))

    def per_rank_micro_batch(self, dp: int) -> int:
        per_rank = self.data.global_batch // dp
        if self.data.micro_batches is not None:
            return per_rank // self.data.micro_batches
        if self.data.micro_batch is not None:
            return self.data.micro_batch
        if self.mesh.pp > 1:
            return per_rank // default_pipeline_micro_batches(per_rank, self.mesh.pp, self.mesh.schedule)
        return per_rank

    def validate(self) -> GPTTrainConfig:
        """Raise ValueError naming the fix when the flags contradict each other or a number is out of
        range; return self. Pure: what needs the disk or the ranks is checked by resolve."""
        check_moe_training(self, DEFAULT_MODEL)  # first: --ep's own before the mesh's
        self.mesh.check()
        for section in (self.optimizer, self.data, self.output, self.model):
            section.check()
        if self.model.dtype == "fp16" and not self.mesh.zero:
            raise ValueError(
                "--dtype fp16 needs loss scaling, which meshwise train gpt does with --zero 1|2|3: add "
                "--zero (or train in bf16: fp16's bytes, fp32's range, no scaling needed)"
            )
        if self.mesh.pp == 1:
            asked = [
                flag
                for flag, on in (
                    ("--schedule", self.mesh.schedule != "1f1b"),
                    ("--virtual-stages", self.mesh.virtual_stages != 1),
                    ("--timeline", self.profile.timeline is not None),
                )
                if on
            ]
            if asked:
                raise ValueError(f"{' '.join(asked)} configure pipeline parallelism: add --pp 2 or more")
        return self


#: with no --micro-batch(es), a pipeline gets up to this many micro-batches per stage (m ≤ 4·p keeps the
#: GPipe/1F1B bubble (p−1)/(m+p−1) at or below 1/5 when the batch allows, instead of m = 1's (p−1)/p)
DEFAULT_MICRO_BATCHES_PER_STAGE = 4


def default_pipeline_micro_batches(per_rank: int, pp: int, schedule: str) -> int:
    """The largest divisor of the per-rank batch up to 4·pp (a multiple of pp for the interleaved
    schedule, which needs one); 1 when none fits, which validation then explains."""
    most = min(per_rank, DEFAULT_MICRO_BATCHES_PER_STAGE * pp)
    divisors = [m for m in range(1, most + 1) if per_rank % m == 0]
    if schedule == "interleaved":
        divisors = [m for m in divisors if m % pp == 0] or [1]
    return max(divisors)
