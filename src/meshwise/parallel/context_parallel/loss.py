"""The loss and gradients of a context-parallel group: means over all of its tokens.

Every cp rank computes the mean loss of its own tokens (``s/cp`` per sequence, the same count on every
rank), so the group's mean over all tokens is the mean of the ranks' means, and its gradient the mean of
the ranks' gradients. In training the cp ranks therefore simply join the dp ranks' gradient average
(the ``cp`` mesh axis folds into data parallelism's reduction); these helpers do the cp part alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshwise.comm.api import Communicator, ReduceOp


def group_mean(local_mean: torch.Tensor | float, comm: Communicator) -> float:
    """The mean over the group's tokens of a per-rank mean over equally many tokens (for reporting)."""
    value = torch.tensor([float(torch.as_tensor(local_mean).detach())], dtype=torch.float64)
    comm.all_reduce(value, ReduceOp.AVG)
    return value.item()


def average_gradients(parameters: Iterable[torch.nn.Parameter], comm: Communicator) -> None:
    """Average ``.grad`` over the group in place: the gradient of the group-mean loss."""
    for param in parameters:
        if param.grad is not None:
            comm.all_reduce(param.grad, ReduceOp.AVG)
