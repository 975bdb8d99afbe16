"""``train gpt`` says what ran (issue 30.7): the strategy and output files in the JSON and summary, a batch
line that reads right under a pipeline, advice in its own flags, a note for a re-planned schedule, and an
MFU peak that does not grow with ranks sharing cores."""

from __future__ import annotations

import json
import re

from gpt_cli import gpt_argv
from meshwise.cli import build_parser, main
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.peak import shared_cores_peak, thread_hint
from meshwise.train.gpt.report import GPT_KNOBS, gpt_knobs
from meshwise.train.notes import schedule_note


def test_the_json_and_summary_record_the_strategy_and_output_files(text, tmp_path, capsys):
    summary, metrics = tmp_path / "s.json", tmp_path / "m.jsonl"
    argv = gpt_argv(
        text, "-np", "2", "--pp", "2", "--global-batch", "8", "--micro-batches", "4", "--steps", "2"
    )
    assert main([*argv, "--json", str(summary), "--metrics", str(metrics)]) == 0
    result = json.loads(summary.read_text())
    assert result["strategy"] == {
        "dp": 1, "tp": 1, "pp": 2, "cp": 1, "ep": 1, "zero": 0, "sp": False, "schedule": "1f1b",
        "virtual_stages": 1, "micro_batches": 4, "micro_batch_size": 2,
    }  # fmt: skip
    assert result["outputs"] == {"Metrics": str(metrics)}
    out = capsys.readouterr().out
    assert (
        "Batch               = 8 sequences × 32 tokens per step; 8 per data-parallel rank in 4 "
        "micro-batches of 2" in out
    )
    assert "Strategy            = dp 1, pp 2 (1f1b, 4 micro-batches)" in out
    assert f"Metrics             = {metrics}" in out


def test_the_profile_advice_names_only_flags_train_gpt_has():
    parser = build_parser("train")
    gpt = parser._subparsers._group_actions[0].choices["train"]._subparsers._group_actions[0].choices["gpt"]
    flags = {option for action in gpt._actions for option in action.option_strings}
    runs = [None, {"schedule": "zb"}, {"schedule": "interleaved", "virtual_stages": 2}]
    knobs = [knob for strategy in runs for knob in gpt_knobs(strategy).values()]
    named = {flag for knob in knobs for flag in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", knob)}
    assert named and named <= flags, named - flags


def test_the_bubble_advice_names_only_schedules_the_run_does_not_use():
    assert gpt_knobs(None) is GPT_KNOBS and "--schedule zb" in GPT_KNOBS["bubble"]
    zb = gpt_knobs({"schedule": "zb", "virtual_stages": 1})["bubble"]
    assert "--schedule zb" not in zb and "--schedule interleaved" in zb
    interleaved = gpt_knobs({"schedule": "interleaved", "virtual_stages": 2})["bubble"]
    assert (
        "--schedule interleaved" not in interleaved
        and "now 2" in interleaved
        and "--schedule zb" in interleaved
    )


def test_a_resume_with_more_steps_notes_the_replanned_schedule():
    saved = {"step": 4, "run": {"steps": 4}}
    note = schedule_note(GPTTrainConfig.from_flags(steps=8, warmup=1).optimizer, saved)
    assert note is not None and "--steps 8 differs from the checkpoint's 4" in note and "re-planned" in note
    assert "steps 5 on" in note
    assert schedule_note(GPTTrainConfig.from_flags(steps=4).optimizer, saved) is None
    assert schedule_note(GPTTrainConfig.from_flags(steps=8).optimizer, None) is None


def test_the_peak_of_ranks_sharing_cores_is_capped_at_the_cores():
    # 4 one-thread ranks on 2 cores each reach a whole core's rate in their time slices: 4 × 100
    peak, note = shared_cores_peak(400.0, 100.0, threads=4, cores=2)
    assert peak == 200.0 and note is not None and "oversubscribed" in note
    assert shared_cores_peak(190.0, 100.0, threads=2, cores=2) == (190.0, None)


def test_one_rank_gets_a_hint_when_its_threads_outnumber_the_free_cores():
    hint = thread_hint(threads=8, cores=8, load=6.5)
    assert hint is not None and "OMP_NUM_THREADS=1" in hint
    assert thread_hint(threads=4, cores=8, load=2.0) is None
