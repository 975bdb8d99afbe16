"""Where a rank's local tensors lie in the plain model's (:mod:`meshwise.parallel.state_dict`), without
processes: a tensor-parallel shard's chunk moves to its rank's slice and loses the vocabulary padding, and
the plain layout names a tied parameter's keys and their optimizer-state key."""

from __future__ import annotations

import torch

from meshwise.models.gpt import CONFIGS, GPT
from meshwise.parallel.placement import Placement
from meshwise.parallel.state_dict import PlainLayout, plain_chunks


def test_a_tp_shard_lies_at_its_ranks_slice_and_its_padding_is_never_written() -> None:
    placement = Placement("wte.weight", divided=frozenset({"tp"}), tp_dim=0)
    shard = torch.arange(12.0).view(3, 4)  # 3 of the 6 rows of a 5-row vocabulary padded for tp = 2
    ((first, at_first),) = plain_chunks([(shard, (0, 0))], shard.shape, placement, (5, 4), tp_rank=0)
    assert at_first == (0, 0) and first.shape == (3, 4)
    ((last, at_last),) = plain_chunks([(shard, (0, 0))], shard.shape, placement, (5, 4), tp_rank=1)
    assert at_last == (3, 0) and torch.equal(last, shard[:2])  # the padding row is dropped
    assert last.data_ptr() == shard.data_ptr()  # a view: DCP writes and loads it in place
    # a ZeRO rectangle of a shard's padding only is no chunk at all
    assert plain_chunks([(shard[2:], (2, 0))], shard.shape, placement, (5, 4), tp_rank=1) == []


def test_a_replicated_tensor_lies_as_it_is() -> None:
    chunk = torch.ones(2, 4)
    assert plain_chunks([(chunk, (1, 0))], (3, 4), Placement("w"), (3, 4), tp_rank=1) == [(chunk, (1, 0))]


def test_the_plain_layout_keys_a_tied_copy_by_the_parameter_it_copies() -> None:
    with torch.device("meta"):
        model = GPT(CONFIGS["gpt-tiny"])
        plain = PlainLayout.of(model, torch.optim.AdamW(model.parameters()))
    assert plain.canonical["head.weight"] == "wte.weight"  # the last stage's head copy: wte's state
    assert plain.keys_of("head.weight") == plain.keys_of("wte.weight") == ["wte.weight", "head.weight"]
    assert plain.group_names == [[name for name, _ in model.named_parameters()]]
    assert set(plain.shapes) == set(model.state_dict())
