"""The one step of ``meshwise train gpt`` that reads this machine — the ranks, CUDA, the ``--init-from``
model, the corpus and its vocabulary, the tokenizer, the checkpoint to resume — once before any rank
starts, into the :class:`GPTRun` every rank trains from."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
from meshwise.train.checkpoint import GPT_READS, check_resumable, read_run, resumed_directory
from meshwise.train.gpt.config import CPU_SEQ_LEN, DEFAULT_MODEL, GPTTrainConfig
from meshwise.train.gpt.moe import moe_overrides


@dataclass(frozen=True)
class GPTRun:
    """A run's settings and what they resolved to here: the ranks, the model, its training context and
    the tokenizer. Plain data: it travels to every rank."""

    config: GPTTrainConfig
    world_size: int
    model_config: GPTConfig  # the named config with its overrides, or the --init-from checkpoint's
    seq_len: int  # the training context
    tokenizer: str | None  # tokenizer.json (or its folder) for the data and --sample; None: bytes

    @property
    def shape(self) -> MeshShape:
        return self.config.mesh_shape(self.world_size)

    def load_data(self) -> TokenSplits:
        """The token stream (``--data`` or the default corpus) split into training and validation."""
        data = self.config.data
        tokens: np.ndarray
        if data.data is None:
            tokens, name = default_corpus(data.cache_dir), DEFAULT_CORPUS
        elif self.tokenizer is not None and Path(data.data).suffix != ".bin":
            from meshwise.data.local_tokenizer import tokenize_cached

            tokens, cache = tokenize_cached(data.data, self.tokenizer)
            name = cache.name
        else:
            tokens, name = load_tokens(data.data), Path(data.data).name
        return TokenSplits.split(name, tokens, self.seq_len)

    def check(self) -> None:
        """The checks of the settings against the resolved facts (arithmetic only)."""
        from meshwise.train.gpt.parallelize import check_supported  # the seam knows what has landed
        from meshwise.train.gpt.recompute import check_recompute_config

        config, model = self.config, self.model_config
        check_supported(self)
        if self.seq_len < 1 or self.seq_len > model.seq_len:
            raise ValueError(
                f"--seq-len {self.seq_len} is outside 1..{model.seq_len}, the position table of "
                f"{config.model_name}: lower --seq-len or pick a config with a longer context"
            )
        shape, global_batch = self.shape, config.data.global_batch
        batch, ranks = shape.batch_size, "dp" if shape.ep == 1 else "dp·ep"  # ep ranks read other sequences
        if global_batch % batch:
            raise ValueError(
                f"--global-batch {global_batch} is not divisible by {ranks} = {batch}: choose a "
                f"multiple of {batch} so every data-parallel rank gets the same number of sequences"
            )
        micro_batches, per_rank = config.data.micro_batches, global_batch // batch
        if micro_batches is not None and (micro_batches < 1 or per_rank % micro_batches):
            raise ValueError(
                f"--micro-batches {micro_batches} does not divide the per-rank batch {per_rank} "
                f"(--global-batch {global_batch} / dp {batch}): choose a divisor of it"
            )
        micro = config.per_rank_micro_batch(batch)
        if shape.pp > 1 and micro >= 1:  # the pipeline can be built
            from meshwise.parallel.pipeline_parallel.builder import validate_pipeline

            mesh = config.mesh
            validate_pipeline(
                model.layers, shape.pp, config.accumulation(batch), mesh.schedule, mesh.virtual_stages
            )
        if micro < 1 or global_batch % (batch * micro):
            raise ValueError(
                f"--micro-batch-size {micro} does not divide the per-rank batch "
                f"{per_rank} (--global-batch {global_batch} / {ranks} {batch}): "
                "choose a divisor of it"
            )
        check_recompute_config(self)


def resolve(config: GPTTrainConfig) -> GPTRun:
    """Validate ``config``, read what it means here (building the default corpus once, before ranks
    start), check it against that; raise ValueError (FileNotFoundError for a missing path) naming the
    fix, or return the run."""
    config.validate()
    mesh = config.mesh
    world_size = plan_ranks(mesh.nproc, default=1).world_size
    if mesh.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available here; use --device cpu")
    check_backend_here(mesh.backend, device=mesh.device, command="train gpt")
    model = model_config(config)
    run = GPTRun(config, world_size, model, train_seq_len(config, model), tokenizer_path(config))
    run.check()
    if config.output.tensorboard is not None:
        from meshwise.train.gpt.step_log import check_tensorboard

        check_tensorboard()
    run.load_data().check_vocab(model.vocab)
    _check_checkpoint(run)
    if config.output.export_hf is not None:
        from meshwise.train.gpt.init_from import check_export_dir

        check_export_dir(config.output.export_hf)
    return run


def model_config(config: GPTTrainConfig) -> GPTConfig:
    """The named config with --layers/--hidden/--heads/--vocab and the experts flags applied (its position
    table is kept: --seq-len trains on windows up to that length), or the --init-from checkpoint's,
    checked against those flags; with --dropout applied."""
    asked = config.model
    if asked.init_from is not None:
        from meshwise.train.gpt.init_from import init_model_config

        model = init_model_config(asked.init_from, asked.config, asked.sizes)
    else:
        model = gpt_config(asked.config or DEFAULT_MODEL, **asked.sizes, **moe_overrides(asked))
    return replace(model, dropout=asked.dropout) if asked.dropout else model


def train_seq_len(config: GPTTrainConfig, model: GPTConfig) -> int:
    """--seq-len, else the model's context (at most CPU_SEQ_LEN when the run is on a CPU)."""
    if config.model.seq_len is not None:
        return config.model.seq_len
    device = config.mesh.device
    on_gpu = device == "cuda" or (device is None and torch.cuda.is_available())
    return model.seq_len if on_gpu else min(model.seq_len, CPU_SEQ_LEN)


def tokenizer_path(config: GPTTrainConfig) -> str | None:
    """--tokenizer, else the --init-from folder's tokenizer.json when it has one (None: bytes)."""
    if config.data.tokenizer is not None:
        return config.data.tokenizer
    init_from = config.model.init_from
    if init_from is not None:
        folder = Path(init_from) if Path(init_from).is_dir() else Path(init_from).parent
        if (folder / "tokenizer.json").is_file():
            return str(folder)
    return None


def _check_checkpoint(run: GPTRun) -> None:
    """A resumed run must find an intact checkpoint of this model, trained with the same data order, with
    steps left (a new run's directory is checked by :func:`resumed_directory`)."""
    config = run.config
    directory = resumed_directory(config.output.checkpoint, config.output.resume)
    if directory is None:
        return
    saved_run = read_run(directory, GPT_READS, "GPT ")
    saved = GPTConfig(**saved_run["model"])
    if saved != run.model_config:
        raise ValueError(
            f"{directory} holds a run of {saved}, not of {run.model_config}: pass the same model flags"
        )
    ours = {"global_batch": config.data.global_batch, "seed": config.data.seed, "train_seq_len": run.seq_len}
    for key, value in ours.items():
        if saved_run["run"][key] != value:
            raise ValueError(
                f"{directory} was trained with {key} {saved_run['run'][key]}, not {value}: resume "
                "with the same value (the data order depends on it)"
            )
    step = saved_run["step"]
    check_resumable(directory, step, directory, "--steps", step, config.optimizer.steps)
