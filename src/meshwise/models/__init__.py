"""Reference models of the seeds and lectures: tiny MLP, deep GELU MLP, small CNN."""

from meshwise.models.cnn import SmallCNN
from meshwise.models.mlp import DeepMLP, TinyMLP

__all__ = ["DeepMLP", "SmallCNN", "TinyMLP"]
