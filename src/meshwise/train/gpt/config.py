"""``meshwise train gpt`` settings, checked completely (model, mesh, batch arithmetic, data, checkpoint)
before any rank starts, each failure one line that says what to change."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from meshwise.comm.factory import check_backend_here
from meshwise.comm.mesh import MeshShape
from meshwise.data.corpus import NAME as DEFAULT_CORPUS
from meshwise.data.corpus import default_corpus
from meshwise.data.tokens import load_tokens
from meshwise.data.windows import TokenSplits
from meshwise.models.gpt import GPTConfig, gpt_config
from meshwise.runtime.env import plan_ranks
from meshwise.runtime.timeouts import wait_timeout
from meshwise.train.checkpoint import checkpoint_directory
from meshwise.train.checkpoint_check import check_dcp_checkpoint
from meshwise.train.gpt.moe import check_moe_training, moe_overrides
from meshwise.train.torch_profile import check_directory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Default training context on a CPU: a longer one makes the default run take far more than minutes.
CPU_SEQ_LEN = 128
DEFAULT_MODEL = "gpt-nano"


@dataclass(frozen=True)
class GPTTrainConfig:
    """One GPT training run. ``None`` mesh sizes are inferred; ``micro_batch`` None means no accumulation."""

    nproc: int | None = None
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (train/gpt/context_parallel.py)
    ep: int = 1  # expert parallelism: E/ep experts per rank (train/gpt/moe.py); ep ranks are data ranks
    zero: int = 0
    sp: bool = False
    config: str | None = None  # named size; None: gpt-nano, or the --init-from checkpoint's architecture
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None  # default: the config's context (at most CPU_SEQ_LEN on a CPU)
    vocab: int | None = None
    steps: int = 100
    global_batch: int = 8
    micro_batch: int | None = None
    micro_batches: int | None = None  # alternative to micro_batch: how many per rank per step
    schedule: str = "1f1b"  # pipeline schedule (--pp > 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    trace: str | None = None  # Chrome/Perfetto trace of the profiled steps, every rank (implies profile)
    timeline: str | None = None  # PNG diagram of the last pipeline step
    lr: float = 2e-3
    warmup: int | None = None  # default: a tenth of the steps
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "fp32"
    data: str | None = None
    eval_every: int = 25
    eval_windows: int = 64
    checkpoint: str | None = None
    resume: bool = False
    sample: int = 0
    comm_stats: bool = False  # count calls and bytes per collective on each mesh axis
    profile: bool = False  # time each step's phases, print the breakdown and a verdict
    torch_profile: str | None = None  # directory for torch.profiler's per-rank traces of a few steps
    seed: int = 0
    backend: str = "auto"
    device: str | None = None
    timeout: float | None = None  # a deadline for the whole job (None: none); waits time out anyway
    cache_dir: str | None = None  # where the default corpus is cached (tests use a temporary one)
    init_from: str | None = None  # Hugging Face GPT-2 weights to start from (train/gpt/init_from.py)
    export_hf: str | None = None  # folder rank 0 writes Hugging Face GPT-2 weights into at the end
    # mixture of experts (train/gpt/moe.py); None: the named config's own
    experts: int | None = None
    top_k: int | None = None
    capacity_factor: float | None = None
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    recompute: str = "none"  # activation recomputation: none, selective (attention core), full (blocks)
    recompute_layers: int | None = None  # with full: only the first K blocks of each pipeline stage
    log_every: int | None = None  # also report every N-th step (default: the evaluation steps only)
    lr_schedule: str = "cosine"  # the decay after warmup: cosine, linear, constant or wsd (schedule.py)
    dropout: float = 0.0  # on attention weights and residual branches, as GPT-2 (pp = 1)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay (GPT-3's 0.95 rather than torch's 0.999)
    eps: float = 1e-8  # AdamW's denominator floor
    checkpoint_every: int | None = None  # checkpoint every N steps (default: at every evaluation)
    keep: int = 1  # the latest checkpoints kept in --checkpoint DIR
    metrics: str | None = None  # JSON-lines file: one record per reported step, as the run goes
    tokenizer: str | None = None  # local tokenizer.json (or its folder) for a text --data and --sample
    compile: bool = False  # torch.compile each transformer block in place (train/gpt/loop.py)
    tensorboard: str | None = None  # directory for TensorBoard event files of the reported steps

    # ------------------------------------------------------------------ derived
    @property
    def model_config(self) -> GPTConfig:
        """The named config with --layers/--hidden/--heads/--vocab applied (its position table is kept:
        --seq-len trains on windows up to that length), or the --init-from checkpoint's, checked against
        those flags."""
        sizes = {"layers": self.layers, "hidden": self.hidden, "heads": self.heads, "vocab": self.vocab}
        if self.init_from is not None:
            from meshwise.train.gpt.init_from import init_model_config

            model = init_model_config(self.init_from, self.config, sizes)
        else:
            model = gpt_config(self.config or DEFAULT_MODEL, **sizes, **moe_overrides(self))
        return replace(model, dropout=self.dropout) if self.dropout else model

    @property
    def model_name(self) -> str:
        """What the run trains, for banners and results: the --config name, or where --init-from points."""
        if self.config is not None:
            return self.config
        return f"GPT-2 from {self.init_from}" if self.init_from is not None else DEFAULT_MODEL

    @property
    def train_seq_len(self) -> int:
        if self.seq_len is not None:
            return self.seq_len
        on_gpu = self.device == "cuda" or (self.device is None and torch.cuda.is_available())
        return self.model_config.seq_len if on_gpu else min(self.model_config.seq_len, CPU_SEQ_LEN)

    def world_size(self) -> int:
        return plan_ranks(self.nproc, default=1).world_size

    def mesh_shape(self, world_size: int) -> MeshShape:
        return MeshShape.infer(world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)

    def accumulation(self, dp: int) -> int:
        """Micro-batches per rank per step: global batch = dp · micro-batch · accumulation."""
        return self.global_batch // (dp * self.per_rank_micro_batch(dp))

    def per_rank_micro_batch(self, dp: int) -> int:
        per_rank = self.global_batch // dp
        if self.micro_batches is not None:
            return per_rank // self.micro_batches
        if self.micro_batch is not None:
            return self.micro_batch
        if self.pp > 1:
            return per_rank // default_pipeline_micro_batches(per_rank, self.pp, self.schedule)
        return per_rank

    @property
    def profiling(self) -> bool:
        return self.profile or self.trace is not None

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else self.steps // 10

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def comm_timeout(self) -> float:
        return wait_timeout(self.timeout)

    def load_data(self) -> TokenSplits:
        """The token stream (``--data`` or the default corpus) split into training and validation."""
        tokens: np.ndarray
        if self.data is None:
            tokens, name = default_corpus(self.cache_dir), DEFAULT_CORPUS
        elif self.tokenizer_path is not None and Path(self.data).suffix != ".bin":
            from meshwise.data.local_tokenizer import tokenize_cached

            tokens, cache = tokenize_cached(self.data, self.tokenizer_path)
            name = cache.name
        else:
            tokens, name = load_tokens(self.data), Path(self.data).name
        return TokenSplits.split(name, tokens, self.train_seq_len)

    @property
    def tokenizer_path(self) -> str | None:
        """--tokenizer, else the --init-from folder's tokenizer.json when it has one (None: bytes)."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.init_from is not None:
            folder = Path(self.init_from) if Path(self.init_from).is_dir() else Path(self.init_from).parent
            if (folder / "tokenizer.json").is_file():
                return str(folder)
        return None

    def to_json(self) -> dict:
        return asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> GPTTrainConfig:
        """Raise ValueError (FileNotFoundError for missing paths) naming the fix; return self."""
        from meshwise.train.gpt.parallelize import check_supported  # the seam knows what has landed

        check_moe_training(self, DEFAULT_MODEL)  # first: --ep's own checks before the mesh's
        check_supported(self)
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"-np must be at least 1, got {self.nproc}")
        model = self.model_config
        if self.train_seq_len < 1 or self.train_seq_len > model.seq_len:
            raise ValueError(
                f"--seq-len {self.train_seq_len} is outside 1..{model.seq_len}, the position table of "
                f"{self.model_name}: lower --seq-len or pick a config with a longer context"
            )
        shape = self.mesh_shape(self.world_size())
        self._check_numbers()
        batch, ranks = shape.batch_size, "dp" if shape.ep == 1 else "dp·ep"  # ep ranks read other sequences
        if self.global_batch % batch:
            raise ValueError(
                f"--global-batch {self.global_batch} is not divisible by {ranks} = {batch}: choose a "
                f"multiple of {batch} so every data-parallel rank gets the same number of sequences"
            )
        self._check_pipeline(shape)
        micro = self.per_rank_micro_batch(batch)
        if micro < 1 or self.global_batch % (batch * micro):
            raise ValueError(
                f"--micro-batch-size {micro} does not divide the per-rank batch "
                f"{self.global_batch // batch} (--global-batch {self.global_batch} / {ranks} {batch}): "
                "choose a divisor of it"
            )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available here; use --device cpu")
        check_backend_here(self.backend, device=self.device, command="train gpt")
        from meshwise.train.gpt.recompute import check_recompute_config

        check_recompute_config(self)
        if self.torch_profile is not None:
            check_directory(self.torch_profile)
        self.load_data().check_vocab(model.vocab)  # builds the default corpus once, before ranks start
        self._check_checkpoint(model)
        if self.export_hf is not None:
            from meshwise.train.gpt.init_from import check_export_dir

            check_export_dir(self.export_hf)
        return self

    def _check_numbers(self) -> None:
        positive = {
            "--steps": self.steps,
            "--global-batch": self.global_batch,
            "--eval-every": self.eval_every,
            "--eval-windows": self.eval_windows,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.log_every is not None and self.log_every < 1:
            raise ValueError(f"--log-every must be at least 1, got {self.log_every}")
        check_optimisation(self)
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"--micro-batch-size must be at least 1, got {self.micro_batch}")
        for flag, value in (("--lr", self.lr), ("--min-lr", self.min_lr)):
            if not (math.isfinite(value) and value >= 0) or (flag == "--lr" and value == 0):
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
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is unknown; choose {' or '.join(DTYPES)}")
        if self.dtype == "fp16" and not self.zero:
            raise ValueError(
                "--dtype fp16 needs loss scaling, which meshwise train gpt does with --zero 1|2|3: add "
                "--zero (or train in bf16: fp16's bytes, fp32's range, no scaling needed)"
            )
        if self.sample < 0:
            raise ValueError(f"--sample must be a number of tokens ≥ 0, got {self.sample}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in 0 .. 2**63-1, got {self.seed}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout}")

    def _check_pipeline(self, shape: MeshShape) -> None:
        """--micro-batches and the pipeline flags: consistent, and a pipeline that can be built."""
        if self.micro_batches is not None:
            if self.micro_batch is not None:
                raise ValueError(
                    "give --micro-batch-size (sequences) or --micro-batches (how many), not both"
                )
            per_rank = self.global_batch // shape.batch_size
            if self.micro_batches < 1 or per_rank % self.micro_batches:
                raise ValueError(
                    f"--micro-batches {self.micro_batches} does not divide the per-rank batch {per_rank} "
                    f"(--global-batch {self.global_batch} / dp {shape.batch_size}): choose a divisor of it"
                )
        if shape.pp == 1:
            asked = [
                flag
                for flag, on in (
                    ("--schedule", self.schedule != "1f1b"),
                    ("--virtual-stages", self.virtual_stages != 1),
                    ("--timeline", self.timeline is not None),
                )
                if on
            ]
            if asked:
                raise ValueError(f"{' '.join(asked)} configure pipeline parallelism: add --pp 2 or more")
            return
        from meshwise.parallel.pipeline_parallel.builder import validate_pipeline

        if self.global_batch % shape.batch_size == 0 and self.per_rank_micro_batch(shape.batch_size) >= 1:
            m = self.accumulation(shape.batch_size)
            validate_pipeline(self.model_config.layers, shape.pp, m, self.schedule, self.virtual_stages)

    def _check_checkpoint(self, model: GPTConfig) -> None:
        from meshwise.train.gpt.checkpoint import RUN_FILE, read_run, step_dir

        directory = checkpoint_directory(self.checkpoint, self.resume)
        if directory is None:
            return
        if not self.resume:
            if (directory / RUN_FILE).exists():
                raise ValueError(
                    f"{directory / RUN_FILE} already exists; pass --resume to continue that run, or choose "
                    "another --checkpoint"
                )
            return
        run = read_run(directory)
        saved = GPTConfig(**run["model"])
        if saved != model:
            raise ValueError(f"{directory} holds a run of {saved}, not of {model}: pass the same model flags")
        for key in ("global_batch", "seed", "train_seq_len"):
            if run["run"][key] != getattr(self, key):
                raise ValueError(
                    f"{directory} was trained with {key} {run['run'][key]}, not {getattr(self, key)}: resume "
                    "with the same value (the data order depends on it)"
                )
        if run["step"] >= self.steps:
            raise ValueError(
                f"{directory} has already completed {run['step']} of --steps {self.steps}; pass a larger "
                "--steps to train further"
            )
        check_dcp_checkpoint(step_dir(directory, run["step"]))  # one line naming a damaged file


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


def check_optimisation(config: GPTTrainConfig) -> None:
    """The flags of the Add list (issue 30): schedule shape, dropout, AdamW's betas and eps, checkpoints."""
    from meshwise.train.gpt.schedule import LR_SCHEDULES

    if config.lr_schedule not in LR_SCHEDULES:
        raise ValueError(
            f"--lr-schedule {config.lr_schedule!r} is unknown; choose one of {', '.join(LR_SCHEDULES)}"
        )
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"--dropout must be in [0, 1), got {config.dropout}")
    if config.dropout and config.pp > 1:
        raise ValueError(
            "--dropout is supported with data, tensor, context and expert parallelism and ZeRO, not yet "
            "with --pp (its stages' random streams are untested); drop --dropout or --pp"
        )
    for flag, value in (("--beta1", config.beta1), ("--beta2", config.beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")
    if not (math.isfinite(config.eps) and config.eps > 0):
        raise ValueError(f"--eps must be a positive number, got {config.eps}")
    if config.checkpoint_every is not None:
        if config.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1, got {config.checkpoint_every}")
        if config.checkpoint is None:
            raise ValueError("--checkpoint-every needs --checkpoint DIR: where to write them")
    if config.keep < 1:
        raise ValueError(f"--keep must be at least 1 (the latest checkpoint), got {config.keep}")
    if config.tensorboard is not None:
        from meshwise.train.gpt.step_log import check_tensorboard

        check_tensorboard()
