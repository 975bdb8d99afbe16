"""Reference models of the seeds and lectures: tiny MLP, deep GELU MLP, small CNN, GPT-2."""

from meshwise.lazy import lazy_names
from meshwise.models.gpt_shape import CONFIGS as GPT_CONFIGS
from meshwise.models.gpt_shape import GPTConfig, gpt_config

# lazily: the planner reads the GPT's shape (torch-free) without building a model
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "meshwise.models.cnn": ("SmallCNN",),
        "meshwise.models.gpt": ("GPT",),
        "meshwise.models.mlp": ("DeepMLP", "TinyMLP"),
    },
)

__all__ = ["GPT", "GPT_CONFIGS", "DeepMLP", "GPTConfig", "SmallCNN", "TinyMLP", "gpt_config"]
