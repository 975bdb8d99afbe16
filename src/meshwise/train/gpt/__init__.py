"""``meshwise train gpt``: language-model training on a device mesh (data, ZeRO, tensor + sequence and
pipeline parallelism, each plugged into :mod:`meshwise.train.gpt.parallelize`)."""

from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.loop import run_gpt_training
from meshwise.train.gpt.report import GPTResult, StepStats

__all__ = ["GPTResult", "GPTTrainConfig", "StepStats", "run_gpt_training"]
