"""Random streams and data position in GPT checkpoints: with ``--dropout`` a run resumed on the layout
that wrote its checkpoint equals the uninterrupted run exactly — the same batches, the same masks, the
same losses and weights bit for bit (same ops on the same numbers: no tolerance) — on one process, dp2,
pp2 and tp2 (whose attention dropout draws from each rank's own stream, saved too). Under tp the replicated
activations' masks are equal on every tp rank, or replicated weights would drift apart (tested, with a
desynchronised control).

On another layout (or from a ``meshwise-gpt/1`` checkpoint, which holds no streams) the streams are
re-derived from (seed, step): resuming twice gives the same run, and — the control that shows the exact
test above can fail — not the uninterrupted one's masks.
"""

from __future__ import annotations

import json

import pytest
import torch

from gpt_reference import RESUME_AT, RESUME_STEPS, resume_run
from meshwise.runtime.spawn import spawn
from meshwise.train.checkpoint import GPT_READS, next_step, read_run
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.resolve import resolve
from meshwise.train.random_state import capture, derived_seed, rank_key, rederive, restore


def _config(data: str, **flags) -> GPTTrainConfig:
    settings = {
        "config": "gpt-tiny",
        "data": data,
        "seq_len": 32,
        "global_batch": 8,
        "steps": 20,
        "warmup": 1,
        "lr": 1e-3,
        "dropout": 0.1,
        "backend": "gloo",
    }
    return GPTTrainConfig.from_flags(**(settings | flags))


def _train(data: str, directory: str, flags: dict, resume: bool) -> dict:
    return resume_run(_config(data, checkpoint=directory, resume=resume, **flags))


def _assert_same_run(a: dict, b: dict) -> None:
    for step in range(RESUME_AT, RESUME_STEPS):
        assert b["losses"][step] == a["losses"][step], step
        assert b["batches"][step] == a["batches"][step], step
    for name, value in a["params"].items():
        assert torch.equal(torch.from_numpy(b["params"][name]), torch.from_numpy(value)), name


LAYOUTS = {
    "one process": {"nproc": 1},
    "dp2": {"nproc": 2},
    "tp2": {"nproc": 2, "tp": 2},
    "pp2": {"nproc": 2, "pp": 2},
}


@pytest.mark.parametrize("flags", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_dropout_resumes_exactly_on_the_layout_that_wrote_it(text: str, tmp_path, flags: dict) -> None:
    directory, ranks = str(tmp_path / "ckpt"), flags["nproc"]
    a = spawn(_train, ranks, args=(text, directory, flags, False), timeout=110)
    run = json.loads((tmp_path / "ckpt" / "run.json").read_text())
    assert run["format"] == "meshwise-gpt/2" and run["data"]["next_step"] == RESUME_AT
    b = spawn(_train, ranks, args=(text, directory, flags, True), timeout=110)
    for rank in range(ranks):  # every rank's batches and (dp: its own) masks
        _assert_same_run(a[rank], b[rank])
        assert b[rank]["note"] is None
    if ranks > 1:  # each rank wrote its own streams, under its coordinates
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(f"{directory}/step-{RESUME_AT:06d}").read_metadata()
        keys = {key.rsplit(".", 1)[0] for key in metadata.state_dict_metadata if key.startswith("rng.")}
        shape = _config("", **flags).mesh_shape(ranks)
        assert keys == {f"rng.{rank_key(shape.coordinates(rank))}" for rank in range(ranks)}


def test_a_checkpoint_without_streams_resumes_deterministically(text: str, tmp_path) -> None:
    """A meshwise-gpt/1 run.json (no mesh, data or streams): the data position is its step, the streams
    re-derived — the same on two resumes, and other masks than the uninterrupted run's."""
    directory = tmp_path / "ckpt"
    a = spawn(_train, 1, args=(text, str(directory), {"nproc": 1}, False), timeout=110)[0]
    run = json.loads((directory / "run.json").read_text())
    old = {key: value for key, value in run.items() if key not in ("mesh", "data")}
    old["format"] = "meshwise-gpt/1"
    (directory / "run.json").write_text(json.dumps(old))
    b = spawn(_train, 1, args=(text, str(directory), {"nproc": 1}, True), timeout=110)[0]
    c = spawn(_train, 1, args=(text, str(directory), {"nproc": 1}, True), timeout=110)[0]
    _assert_same_run(b, c)
    assert all(b["batches"][step] == a["batches"][step] for step in range(RESUME_AT, RESUME_STEPS))
    assert b["losses"][RESUME_AT] != a["losses"][RESUME_AT]  # the streams matter: the exact test can fail
    assert "(format meshwise-gpt/1) holds no random streams" in b["note"] and "re-derived" in b["note"]


def test_an_unknown_format_is_one_line(tmp_path) -> None:
    (tmp_path / "step-000003").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"format": "meshwise-gpt/9", "step": 3}))
    expected = r"has format 'meshwise-gpt/9', which this meshwise does not read \(it reads meshwise-gpt/2, "
    with pytest.raises(ValueError, match=expected + r"meshwise-gpt/1\)"):
        read_run(tmp_path, GPT_READS, "GPT ")
    assert next_step({"step": 3}) == 3 and next_step({"step": 3, "data": {"next_step": 3}}) == 3


def test_streams_are_captured_restored_and_rederived_as_pure_functions() -> None:
    from meshwise.parallel.tensor_parallel.rng import ShardDropout

    class Own:  # a module stream, as tensor parallelism's RankRandomState
        def __init__(self) -> None:
            self.state = torch.Generator().manual_seed(7).get_state()

        def get_state(self) -> torch.Tensor:
            return self.state.clone()

        def set_state(self, state: torch.Tensor) -> None:
            self.state = state.clone()

    model = torch.nn.Sequential(ShardDropout(0.5, Own()))  # type: ignore[arg-type]
    saved = capture([model], torch.device("cpu"))
    assert sorted(saved) == ["cpu", "module0"]
    first = torch.rand(4)
    restore(saved, [model], torch.device("cpu"))
    assert torch.equal(torch.rand(4), first)
    rederive(1, 5, {"pp": 0, "dp": 1}, [model])
    again, own = torch.rand(4), model[0].random.get_state()
    rederive(1, 5, {"pp": 0, "dp": 1}, [model])
    assert torch.equal(torch.rand(4), again) and torch.equal(model[0].random.get_state(), own)
    assert rank_key({"pp": 1, "dp": 0, "tp": 1}) == "pp1.dp0.tp1"
    assert derived_seed(1, 5) != derived_seed(1, 6) and 0 <= derived_seed(2**62, 10**9, "x") < 2**63
    with pytest.raises(ValueError, match="holds 0 module random streams"):
        restore({"cpu": saved["cpu"]}, [model], torch.device("cpu"))


def _replicated_after_steps(data: str) -> list[dict[str, list]]:
    """tp2's replicated weights after 3 steps with dropout; then again with rank 1's CPU stream advanced
    by one draw (the control: masks that differ must show)."""
    import os

    import meshwise
    from meshwise.parallel.tensor_parallel import shard_dim
    from meshwise.train.gpt.loop import GPTTrainer

    config = _config(data, nproc=2, tp=2)
    world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(int(os.environ["WORLD_SIZE"])))
    try:
        found = []
        for desynchronised in (False, True):
            trainer = GPTTrainer(world, resolve(config))
            if desynchronised and world.rank == 1:
                torch.rand(1)
            for step in range(3):
                trainer.train_step(step)
            named = trainer.step_runner.local.named_parameters()
            found.append({n: p.detach().reshape(-1).tolist() for n, p in named if shard_dim(p) is None})
        return found
    finally:
        meshwise.shutdown()


def test_dropout_under_tp_keeps_the_replicated_weights_equal(text: str) -> None:
    """Without --sp the residual stream is replicated over tp: its dropout must draw the same masks on both
    ranks, or the LayerNorm gains (whose gradients each rank computes alone) drift apart."""
    (first, first_control), (second, second_control) = spawn(_replicated_after_steps, 2, (text,), timeout=110)
    assert first.keys() == second.keys() and len(first) > 10
    assert all(first[name] == second[name] for name in first)
    assert any(first_control[name] != second_control[name] for name in first)
