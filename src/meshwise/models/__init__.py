"""Reference models of the seeds and lectures: tiny MLP, deep GELU MLP, small CNN, GPT-2."""

from meshwise.models.cnn import SmallCNN
from meshwise.models.gpt import CONFIGS as GPT_CONFIGS
from meshwise.models.gpt import GPT, GPTConfig, gpt_config
from meshwise.models.mlp import DeepMLP, TinyMLP

__all__ = ["GPT", "GPT_CONFIGS", "DeepMLP", "GPTConfig", "SmallCNN", "TinyMLP", "gpt_config"]
