"""``meshwise train gpt``'s settings sections (see :mod:`meshwise.train.sections`): mesh, model,
optimizer, data, output, profile. Each checks what it can alone; the config, how they fit together."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshwise.train.sections import MeshSection, OutputSection, ProfileSection, at_least_one, check_seed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class GPTMeshSection(MeshSection):
    """The device mesh and how the model is cut over it. ``dp`` None is inferred from the ranks."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (train/gpt/context_parallel.py)
    ep: int = 1  # expert parallelism: E/ep experts per rank (train/gpt/moe.py); ep ranks are data ranks
    sp: bool = False  # sequence parallelism, with tp
    schedule: str = "1f1b"  # pipeline schedule (pp > 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    recompute: str = "none"  # activation recomputation: none, selective (attention core), full (blocks)
    recompute_layers: int | None = None  # with full: only the first K blocks of each pipeline stage


@dataclass(frozen=True)
class ModelSection:
    """What is trained: a named size with overrides, or GPT-2 weights (``init_from``); None: the named
    config's (or the checkpoint's) own value."""

    config: str | None = None  # named size; None: gpt-nano, or the --init-from checkpoint's architecture
    init_from: str | None = None  # Hugging Face GPT-2 weights to start from (train/gpt/init_from.py)
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    seq_len: int | None = None  # training context; None: the config's (at most CPU_SEQ_LEN on a CPU)
    experts: int | None = None  # mixture of experts (train/gpt/moe.py)
    top_k: int | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    dropout: float = 0.0  # on attention weights and residual branches, as GPT-2
    dtype: str = "fp32"  # compute precision
    compile: bool = False  # torch.compile each transformer block in place (train/gpt/loop.py)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def sizes(self) -> dict[str, int | None]:
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads, "vocab": self.vocab}

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is unknown; choose {' or '.join(DTYPES)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")


#: the schedules ``--lr-schedule`` offers
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
#: the share of the steps a ``wsd`` schedule spends decaying (the MiniCPM paper's ~10–20 %)
WSD_DECAY_FRACTION = 0.2


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW and its learning-rate schedule over ``steps`` optimizer steps."""

    steps: int = 100
    lr: float = 2e-3
    warmup: int | None = None  # default: a tenth of the steps
    min_lr: float = 1e-4
    lr_schedule: str = "cosine"  # the decay after warmup: cosine, linear, constant or wsd (lr_at)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay (GPT-3's 0.95 rather than torch's 0.999)
    eps: float = 1e-8  # AdamW's denominator floor

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.steps // 10

    def lr_at(self, step: int) -> float:
        """Rate for 0-based ``step``: ``lr·(step+1)/warmup`` while warming up, then ``lr_schedule`` from
        ``lr`` at the end of warmup to ``min_lr`` at the last step: ``cosine`` (GPT-2/3, nanoGPT),
        ``linear``, ``constant`` (stays at ``lr``), or ``wsd`` — warmup, stable, decay (MiniCPM, DeepSeek):
        ``lr`` held until the last :data:`WSD_DECAY_FRACTION` of the steps, then a linear decay, so a run
        can be extended from any checkpoint of its stable phase. A pure function of the step (no scheduler
        object): a resumed run continues on exactly the same curve with nothing extra in the checkpoint."""
        lr, min_lr, warmup, steps, shape = (
            self.lr,
            self.min_lr,
            self.warmup_steps,
            self.steps,
            self.lr_schedule,
        )
        if step < warmup:
            return lr * (step + 1) / warmup
        if shape == "constant":
            return lr
        if shape == "wsd":
            decay_start = max(warmup, steps - max(1, round(WSD_DECAY_FRACTION * steps)))
            if step < decay_start:
                return lr
            warmup = decay_start - 1  # the decay below runs from the last stable step (at lr) to the end
        span = max(1, steps - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        if shape in ("linear", "wsd"):
            return min_lr + (lr - min_lr) * (1.0 - progress)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))

    def check(self) -> None:
        at_least_one({"--steps": self.steps})
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"--lr-schedule {self.lr_schedule!r} is unknown; choose one of {', '.join(LR_SCHEDULES)}"
            )
        for flag, value in (("--beta1", self.beta1), ("--beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{flag} must be in [0, 1), got {value}")
        for flag, value in (("--eps", self.eps), ("--lr", self.lr), ("--min-lr", self.min_lr)):
            if not (math.isfinite(value) and value >= 0) or (flag != "--min-lr" and value == 0):
                raise ValueError(f"{flag} must be a positive number, got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}: the cosine decays to it")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"--warmup must be in 0..{self.steps - 1} (fewer than --steps), got {self.warmup_steps}"
            )
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"--grad-clip must be ≥ 0 (0 turns clipping off), got {self.grad_clip}")
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")


@dataclass(frozen=True)
class DataSection:
    """The token stream, how a step's batch is cut, and the validation it is measured on. ``micro_batch``
    and ``micro_batches`` None: no accumulation (under pp, a default count of micro-batches)."""

    data: str | None = None  # text or uint16 .bin token file; None: the default corpus
    tokenizer: str | None = None  # local tokenizer.json (or its folder) for a text --data and --sample
    cache_dir: str | None = None  # where the default corpus is cached (tests use a temporary one)
    global_batch: int = 8
    micro_batch: int | None = None
    micro_batches: int | None = None  # alternative to micro_batch: how many per rank per step
    eval_every: int = 25
    eval_windows: int = 64
    seed: int = 0  # initial weights and data order

    def check(self) -> None:
        at_least_one(
            {
                "--global-batch": self.global_batch,
                "--eval-every": self.eval_every,
                "--eval-windows": self.eval_windows,
                "--micro-batch-size": self.micro_batch,
            }
        )
        if self.micro_batches is not None and self.micro_batch is not None:
            raise ValueError("give --micro-batch-size (sequences) or --micro-batches (how many), not both")
        check_seed(self.seed)


@dataclass(frozen=True)
class GPTOutputSection(OutputSection):
    """Checkpoints, exports, the sample and the reports written as the run goes."""

    keep: int = 1  # the latest checkpoints kept in --checkpoint DIR
    checkpoint_every: int | None = None  # checkpoint every N steps (default: at every evaluation)
    export_hf: str | None = None  # folder rank 0 writes Hugging Face GPT-2 weights into at the end
    sample: int = 0  # generated tokens printed at the end
    log_every: int | None = None  # also report every N-th step (default: the evaluation steps only)
    metrics: str | None = None  # JSON-lines file: one record per reported step, as the run goes
    tensorboard: str | None = None  # directory for TensorBoard event files of the reported steps

    def check(self) -> None:
        at_least_one({"--log-every": self.log_every, "--checkpoint-every": self.checkpoint_every})
        if self.checkpoint_every is not None and self.checkpoint is None:
            raise ValueError("--checkpoint-every needs --checkpoint DIR: where to write them")
        if self.keep < 1:
            raise ValueError(f"--keep must be at least 1 (the latest checkpoint), got {self.keep}")
        if self.sample < 0:
            raise ValueError(f"--sample must be a number of tokens ≥ 0, got {self.sample}")
        super().check()


@dataclass(frozen=True)
class GPTProfileSection(ProfileSection):
    """Measurements beyond the step breakdown: the pipeline diagram, torch.profiler, collective counts."""

    timeline: str | None = None  # PNG diagram of the last pipeline step
    torch_profile: str | None = None  # directory for torch.profiler's per-rank traces of a few steps
    comm_stats: bool = False  # count calls and bytes per collective on each mesh axis
