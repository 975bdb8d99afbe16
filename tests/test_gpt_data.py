"""Token data for GPT training: byte tokenizer, uint16 token files, default corpus, windows, LR schedule."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from meshwise.data.corpus import build_corpus, corpus_path, default_corpus, source_files
from meshwise.data.tokens import ByteTokenizer, load_tokens, open_tokens, write_tokens
from meshwise.data.windows import (
    TokenSplits,
    global_offsets,
    lockstep_val_batches,
    train_batch,
    val_batches,
)
from meshwise.train.gpt.sections import OptimizerSection


def test_byte_tokenizer_is_lossless_and_tolerates_cut_characters() -> None:
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode("héllo ∑")
    assert tokens.dtype == np.uint16 and tokens.max() < 256 and len(tokens) == len("héllo ∑".encode())
    assert tokenizer.decode(tokens) == "héllo ∑"
    assert tokenizer.decode(tokens[:-1]).endswith("\ufffd")


def test_token_files_round_trip_memory_mapped_and_text_reads_as_bytes(tmp_path) -> None:
    ids = np.array([0, 1, 50256, 65535])
    path = write_tokens(tmp_path / "t.bin", ids)
    assert path.stat().st_size == 8 and list(path.parent.iterdir()) == [path]  # no temporary left
    mapped = open_tokens(path)
    assert isinstance(mapped, np.memmap) and mapped.tolist() == ids.tolist()
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        write_tokens(tmp_path / "u.bin", np.array([70000]))
    (tmp_path / "a.txt").write_text("ab")
    assert load_tokens(tmp_path / "a.txt").tolist() == [97, 98]


def test_default_corpus_is_built_once_from_sorted_sources_without_tests(tmp_path) -> None:
    root = tmp_path / "lib"
    for name in ("b.py", "a/x.py", "test/t.py", "site-packages/s.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    assert [p.relative_to(root).as_posix() for p in source_files(root)] == ["a/x.py", "b.py"]
    path = build_corpus(tmp_path / "c.bin", root)
    assert ByteTokenizer().decode(open_tokens(path)) == "# a/x.py\n\n\n# b.py\n\n\n"
    assert build_corpus(tmp_path / "d.bin", root, max_bytes=5).stat().st_size == 10
    with pytest.raises(FileNotFoundError, match="pass --data PATH"):
        build_corpus(tmp_path / "e.bin", tmp_path / "empty")
    cached = corpus_path(tmp_path)
    write_tokens(cached, np.array([7, 8]))  # a cached corpus is mapped, not rebuilt
    assert default_corpus(tmp_path).tolist() == [7, 8]


def test_the_global_batch_is_the_same_for_any_number_of_ranks() -> None:
    splits = TokenSplits.split("x", np.arange(5000, dtype=np.uint16), seq_len=16)
    assert len(splits.train) == 4500 and splits.val[0] == 4500
    one = train_batch(splits, 16, 12, seed=3, step=7, rank=0, ranks=1)
    for ranks in (2, 3, 4):
        parts = [train_batch(splits, 16, 12, seed=3, step=7, rank=r, ranks=ranks) for r in range(ranks)]
        assert torch.equal(torch.cat([p[0] for p in parts]), one[0])
    inputs, targets = one
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    assert not np.array_equal(global_offsets(4500, 16, 12, 3, 7), global_offsets(4500, 16, 12, 3, 8))
    assert int(inputs.max()) < 4500  # training windows never reach the validation part


def test_validation_windows_are_fixed_and_shared_out_once() -> None:
    splits = TokenSplits.split("x", np.arange(5000, dtype=np.uint16), seq_len=16)
    every = torch.cat([x for r in range(3) for x, _ in val_batches(splits, 16, 10, 4, r, 3)])
    assert len(every) == 10 and len({tuple(row.tolist()) for row in every}) == 10
    assert int(every.max()) < 5000 and int(every.min()) >= 4500


@pytest.mark.parametrize(
    ("windows", "batch", "ranks", "rounds"), [(1, 4, 2, 1), (5, 2, 2, 2), (7, 2, 3, 2), (4, 1, 4, 1)]
)
def test_every_rank_runs_as_many_validation_batches_counting_each_window_once(windows, batch, ranks, rounds):
    splits = TokenSplits.split("x", np.arange(5000, dtype=np.uint16), seq_len=16)
    shares = [lockstep_val_batches(splits, 16, windows, batch, r, ranks) for r in range(ranks)]
    assert [len(share) for share in shares] == [rounds] * ranks  # a sharded forward is collective
    for rank, share in enumerate(shares):
        counted = [(x, y) for x, y, keep in share if keep]
        mine = val_batches(splits, 16, windows, batch, rank, ranks)
        assert len(counted) == len(mine)
        pairs = zip(counted, mine, strict=True)
        assert all(torch.equal(x, a) and torch.equal(y, b) for (x, y), (a, b) in pairs)


def test_cosine_schedule_with_warmup() -> None:
    schedule = OptimizerSection(lr=1.0, min_lr=0.1, warmup=4, steps=20)
    rates = [schedule.lr_at(s) for s in range(20)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0] and rates[4] == 1.0
    assert rates[-1] == pytest.approx(0.1) and all(a >= b for a, b in itertools.pairwise(rates[4:]))
    assert OptimizerSection(lr=1.0, min_lr=0.0, warmup=0, steps=1).lr_at(0) == 1.0
