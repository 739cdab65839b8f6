"""What a run prints without a live bar (stderr not a terminal, --no-progress): the threads it computes on, then
progress lines on a time basis as well as by step count, so a slow stage is never silent for minutes."""

import re

import torch

from helpers.train_helpers import micro_config, write_json_package
from kforcing_kernels.app.training import loop
from kforcing_kernels.app.training.loop import ProgressLines, train


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_slow_run_prints_a_line_at_least_every_period():
    """1000 steps of 12 s each (a default Stage 1 on a busy CPU): a line every 30 s, not every 100 steps (20 min)."""
    clock = FakeClock()
    lines = ProgressLines(0, 1000, seconds=30.0, clock=clock)
    printed = []
    for done in range(1, 1001):
        clock.now += 12.0
        if lines.due(done):
            printed.append((done, clock.now))
    gaps = [b[1] - a[1] for a, b in zip(printed, printed[1:])]
    assert printed[0][0] == 1 and printed[-1][0] == 1000
    assert max(gaps) <= 36.0  # one step past 30 s at most
    assert len(printed) >= 12000 / 36


def test_a_fast_run_prints_about_ten_lines():
    clock = FakeClock()
    lines = ProgressLines(100, 300, seconds=30.0, clock=clock)  # resumed at step 100
    printed = []
    for done in range(101, 301):
        clock.now += 0.01
        if lines.due(done):
            printed.append(done)
    assert printed == [101, *range(120, 301, 20)]


def test_train_without_a_bar_prints_its_threads_and_timed_lines(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KFORCING_CACHE", str(tmp_path / "cache"))
    corpus = write_json_package(tmp_path / "corpus")
    monkeypatch.setattr(loop, "PROGRESS_SECONDS", 0.0)  # every step is past the period
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(micro_config(tmp_path / "run", corpus, steps=25, warmup_steps=1))
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "device cpu, 1 thread (--threads N sets it" in err
    steps = [int(m) for m in re.findall(r"\] step (\d+)/25 loss", err)]
    assert steps == list(range(1, 26))  # the time basis: every step, the step count alone gives 1, 2, 4, ..., 24, 25
