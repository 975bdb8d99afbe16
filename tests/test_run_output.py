"""``meshwise run`` output: every rank's lines in the order they were written, promptly, intact.

The launcher is frozen (SIGSTOP) while the ranks take turns, the harshest load there is: it gets no CPU
at all until the round is over, so every line of the round is waiting somewhere when it resumes. Per-rank
pipes then give the lines back a pipe at a time (rank 0's two lines, then rank 1's); the shared channel
gives them back in write order. Lines are written with print, sys.stdout.write, os.write and by a
subprocess, to stdout and stderr.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from pathlib import Path

from meshwise.runtime.output_channel import OutputChannel
from meshwise.runtime.output_pump import OutputPump, PrefixedOutput

ROUNDS = 24
TURNS = 2  # per rank and round: rank 0, rank 1, rank 0, rank 1 while the launcher is frozen

# Ranks pass a token through two FIFOs (rank r reads to<r>): a strict turn order between processes.
TURN_TAKING = """
    import os, select, signal, subprocess, sys, threading, time
    rank, directory = int(os.environ["RANK"]), sys.argv[1]
    rounds, turns = int(sys.argv[2]), int(sys.argv[3])
    launcher = os.getppid()
    inbox = os.open(f"{directory}/to{rank}", os.O_RDWR)
    outbox = os.open(f"{directory}/to{1 - rank}", os.O_RDWR)

    def wait_turn():
        if not select.select([inbox], [], [], 30)[0]:
            raise TimeoutError(f"rank {rank}: no turn within 30 s")
        os.read(inbox, 1)

    def write(text, how):
        if how == "print":
            print(text)
        elif how == "write":
            sys.stdout.write(text + "\\n")
        elif how == "os.write":
            os.write(1, (text + "\\n").encode())
        elif how == "subprocess":
            subprocess.run(["echo", text], check=True)
        else:
            print(text, file=sys.stderr)

    ways = ["print", "write", "os.write", "subprocess", "stderr"]
    for round in range(rounds):
        how = ways[round % len(ways)]
        if rank == 0:
            os.kill(launcher, signal.SIGSTOP)  # resumed below, or by this watchdog if a write blocks
            watchdog = threading.Timer(5, os.kill, (launcher, signal.SIGCONT))
            watchdog.start()
        for turn in range(turns):
            if rank == 1:
                wait_turn()
            write(f"round {round} turn {turn} rank {rank} {how}", how)
            os.write(outbox, b"t")
            if rank == 0:
                wait_turn()
        if rank == 0:
            watchdog.cancel()
            os.kill(launcher, signal.SIGCONT)
            time.sleep(0.01)

    if rank == 0:
        os.write(1, b"caf\\xc3")  # a UTF-8 character split over two writes, then an invalid byte
        os.write(1, b"\\xa9 half")
        os.write(1, b" \\xff end\\n")
        print("waiting for the test to see this line")
        for _ in range(300):
            if os.path.exists(f"{directory}/seen"):
                break
            time.sleep(0.1)
        else:
            raise TimeoutError("the launcher did not forward a printed line within 30 s")
    sys.stdout.write(f"no newline from {rank}")
"""


def _ordered(lines: list[str], hows: set[str]) -> list[str]:
    return [line for line in lines if " round " in line and line.rsplit(" ", 1)[1] in hows]


def test_ranks_taking_turns_under_a_frozen_launcher_come_out_in_turn(tmp_path):
    script = tmp_path / "turns.py"
    script.write_text(textwrap.dedent(TURN_TAKING))
    for rank in (0, 1):
        os.mkfifo(tmp_path / f"to{rank}")
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshwise", "run", "-n", "2", str(script), str(tmp_path), str(ROUNDS),
             str(TURNS)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    out: list[str] = []
    timer = threading.Timer(90, proc.kill)  # never hang the suite
    timer.start()
    try:
        for line in proc.stdout:
            out.append(line.rstrip("\n"))
            if "waiting for the test" in line:
                (tmp_path / "seen").touch()
        code = proc.wait()
    finally:
        timer.cancel()
    err_lines = (tmp_path / "err").read_text().splitlines()
    assert code == 0, "\n".join(out + err_lines)
    ways = ["print", "write", "os.write", "subprocess", "stderr"]
    expected = [
        f"[rank {r}] round {n} turn {t} rank {r} {ways[n % 5]}" for n in range(ROUNDS) for t in range(TURNS)
        for r in range(2)
    ]
    assert _ordered(out, set(ways) - {"stderr"}) == [e for e in expected if not e.endswith("stderr")]
    assert _ordered(err_lines, {"stderr"}) == [e for e in expected if e.endswith("stderr")]
    assert "[rank 0] caf\u00e9 half \ufffd end" in out
    assert "[rank 0] no newline from 0" in out and "[rank 1] no newline from 1" in out


def _pump() -> tuple[OutputPump, io.StringIO, io.StringIO, deque[str]]:
    out, err = io.StringIO(), io.StringIO()
    pump = OutputPump(PrefixedOutput(out, err))
    tail: deque[str] = deque(maxlen=3)
    return pump, out, err, tail


def test_partial_lines_of_two_ranks_never_mix_and_invalid_bytes_are_replaced():
    pump, out, err, tail = _pump()
    senders = {rank: pump.add(rank, f"[{rank}] ", tail if rank == 1 else deque()) for rank in (0, 1)}
    senders[0][0].send(b"half of rank 0, ")
    senders[1][0].send(b"rank 1 whole\n")
    senders[0][0].send(b"other half\r\n\xfe\n")
    for line in ("e1", "e2", "e3", "e4"):
        senders[1][1].send(line.encode() + b"\n")
    senders[1][0].send(b"unterminated")
    pump.finish(1, 10)
    # a line is ordered by the write that completes it: rank 1's whole line came before rank 0's end
    expected = "[1] rank 1 whole\n[0] half of rank 0, other half\n[0] \ufffd\n[1] unterminated\n"
    assert out.getvalue() == expected
    assert err.getvalue() == "[1] e1\n[1] e2\n[1] e3\n[1] e4\n"
    assert list(tail) == ["e2", "e3", "e4"]
    senders[0][0].send(b"last words")
    pump.close(10)
    assert out.getvalue().endswith("[0] last words\n")
    for pair in senders.values():
        for sender in pair:
            sender.close()


def test_a_write_larger_than_a_pipe_arrives_whole():
    pump, out, _, tail = _pump()
    stdout, stderr = pump.add(0, "", tail)
    stderr.close()
    line = "x" * 150_000
    stdout.send(line.encode() + b"\n")
    stdout.close()
    pump.close(10)
    assert out.getvalue() == line + "\n"


def test_datagrams_from_strangers_are_ignored():
    channel = OutputChannel()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stranger.sendto(b"not a worker\n", channel._address("launcher"))
    time.sleep(0.05)
    assert channel.receive() == []
    stranger.close()
    channel.close()
    assert not Path(channel._address("launcher")).exists() or sys.platform.startswith("linux")
