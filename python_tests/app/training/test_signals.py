"""What a scheduler user sees (issue 56 item 5): SIGTERM of a training run ends it as Ctrl-C does (a line saying what
to do next, the checkpoints kept, the folder's lock released), with exit status 143, not a silent 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO
from helpers.train_helpers import VOCAB, write_json_package

pytest.importorskip("tokenizers")


def _start(out, corpus, cache) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KFORCING_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "kforcing_kernels.app.train", "stage0", "--out", str(out), "--data", str(corpus)]
    cmd += ["--vocab-size", str(VOCAB), "--preset", "micro", "--seq-len", "16", "--batch-size", "4"]
    cmd += ["--steps", "100000", "--ckpt-every", "2", "--log-every", "1", "--no-progress", "--device", "cpu"]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    "sig, status, words", [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signalled_run_says_what_to_do_and_keeps_its_checkpoints(tmp_path, sig, status, words):
    corpus = write_json_package(tmp_path / "corpus")
    out = tmp_path / "run"
    proc = _start(out, corpus, tmp_path / "cache")
    try:
        deadline = time.monotonic() + 240
        while not list((out / "checkpoints").glob("step_*.json")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, err[-2000:]
    assert f"kforcing-train: {words}; the checkpoints written so far are in {out}" in err, err[-2000:]
    assert "--resume" in err and "Traceback" not in err, err[-2000:]
    assert list((out / "checkpoints").glob("step_*.json"))  # kept: --resume continues from them


def test_corpus_encoding_shows_progress_when_verbose(capsys):
    from tokenizers import Tokenizer, models

    from kforcing_kernels.app.data import ENCODE_CHUNK, token_streams

    tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    texts = ["a"] * (2 * ENCODE_CHUNK + 1)
    quiet = token_streams(tok, 1, texts, ["a"], 0.02)
    assert "[data] encoding" not in capsys.readouterr().err
    loud = token_streams(tok, 1, texts, ["a"], 0.02, progress=True)
    err = capsys.readouterr().err
    assert "[data] encoding" in err and f"{len(texts) + 1}/{len(texts) + 1}" in err, err
    assert all((a == b).all() for a, b in zip(quiet, loud))  # the same streams, chunked or not


def test_transformers_loading_bars_are_off_only_while_the_package_loads():
    logging = pytest.importorskip("transformers").utils.logging
    from kforcing_kernels.app.hf_recipe.files import quiet_loading

    logging.enable_progress_bar()
    with quiet_loading():
        assert not logging.is_progress_bar_enabled()
    assert logging.is_progress_bar_enabled()  # a user's own loads keep their bars
    logging.disable_progress_bar()
    with quiet_loading():
        pass
    assert not logging.is_progress_bar_enabled()  # and a user who turned them off keeps them off
    logging.enable_progress_bar()
