"""Without processes: bucket planning (reverse order, caps, dtypes, torch DDP's own plan) and the
wrapper's argument checks, which fail before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshwise.models import DeepMLP, SmallCNN
from meshwise.parallel import DataParallel, plan_buckets
from meshwise.parallel.data_parallel.buckets import MIB


def _params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def test_benchmark_mlp_gets_a_small_first_bucket_then_the_rest():
    params = _params(DeepMLP(1024, 8).to("meta"))
    buckets = plan_buckets(params, 25 * MIB, MIB)
    # the last 4 MiB layer alone reaches the 1 MiB first cap; the other seven fill the 25 MiB one
    assert [b.params for b in buckets] == [(7,), (6, 5, 4, 3, 2, 1, 0)]
    assert [b.nbytes for b in buckets] == [4 * MIB, 28 * MIB]


def test_layout_covers_every_parameter_once_contiguously_in_reverse_order():
    params = _params(SmallCNN())
    buckets = plan_buckets(params, 2000, 300)
    assert len(buckets) >= 3
    order = [p for b in buckets for p in b.params]
    assert order == list(reversed(range(len(params))))
    for bucket in buckets:
        sizes = [params[p].numel() for p in bucket.params]
        assert list(bucket.offsets) == [sum(sizes[:i]) for i in range(len(sizes))]
        assert bucket.numel == sum(sizes)
        assert bucket.index == buckets.index(bucket)


@pytest.mark.parametrize("caps", [(25 * MIB, MIB), (1000, 200), (4096, 4096), (1, 1)])
@pytest.mark.parametrize("model", [lambda: DeepMLP(64, 3, 10), SmallCNN, lambda: DeepMLP(1024, 8)])
def test_same_assignment_as_torch_ddp(caps, model):
    params = _params(model().to("meta"))
    reverse = list(reversed(range(len(params))))
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in reverse], [caps[1], caps[0]], [False] * len(params), reverse
    )
    assert [list(b.params) for b in plan_buckets(params, *caps)] == theirs


def test_dtypes_and_devices_never_share_a_bucket():
    params = [torch.zeros(300), torch.zeros(300, dtype=torch.float64), torch.zeros(300), torch.zeros(10)]
    buckets = plan_buckets(params, 10 * MIB, 10 * MIB)
    assert {(b.dtype, b.params) for b in buckets} == {(torch.float32, (3, 2, 0)), (torch.float64, (1,))}
    assert [b.params[0] for b in buckets] == [3, 1]  # ordered by when their first gradient is ready


def test_each_dtype_gets_its_own_small_first_bucket():
    params = [torch.zeros(64, dtype=torch.float64), torch.zeros(64), torch.zeros(64, dtype=torch.float64)]
    buckets = plan_buckets(params, 10_000, 100)  # 256 B and 512 B tensors all exceed the first cap
    assert [b.params for b in buckets] == [(2,), (1,), (0,)]


@pytest.mark.parametrize("caps", [(0, MIB), (MIB, 0), (-1, -1)])
def test_caps_must_be_positive(caps):
    with pytest.raises(ValueError, match="must be positive"):
        plan_buckets([torch.zeros(3)], *caps)


def test_no_parameters_no_buckets():
    assert plan_buckets([], MIB, MIB) == []


@pytest.mark.parametrize(
    "module,kwargs,error,match",
    [
        ("not a module", {}, TypeError, "wraps an nn.Module"),
        (nn.Linear(2, 2), {"compress": "int8"}, ValueError, "compress='int8' is unknown"),
        (nn.Linear(2, 2), {"bucket_mb": 0}, ValueError, "must be positive"),
    ],
)
def test_bad_wrapper_arguments_fail_before_any_communication(module, kwargs, error, match):
    with pytest.raises(error, match=match):
        DataParallel(module, **kwargs)  # no communicator exists in this process: nothing was attempted
