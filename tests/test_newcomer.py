"""What a newcomer meets first: every ``--model`` preset the examples offer trains on the default
data, and the examples' output reads well on a terminal. (In a log file, where output goes to a
pipe: ``tests/test_examples.py``.)

(That ``pip install -e .`` alone installs what the library and the examples import, and installs
no top-level ``example`` package, is proven by ``.ci/run`` in a fresh virtual environment:
``.ci/check_install.py``.)
"""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
import torch

from example.tokenizer import GPT2_VOCAB_SIZE, ByteTokenizer, get_tokenizer
from example.models import model_names, model_spec
from example.trainer import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--steps", "2", "--seq_len", "16", "--batch_size", "1", "--log_every", "1"]
STEP_LINE = re.compile(r"step\s+\d+ \| loss [0-9.]+ \|")
# Presets up to this size run a real step here; larger ones are only checked for a vocabulary
# that covers the tokenizers the examples can pick (running GPT-2 124M+ would dominate CI).
RUN_MAX_PARAMS = 50_000_000


def test_examples_offer_only_presets_the_default_data_fits():
    offered = model_names()
    assert "gpt2_tiny" not in offered  # vocabulary 67: a unit-test preset, not an example one
    gpt2 = {"gpt2", "gpt2_medium", "gpt2_large", "gpt2_xl", "gpt2_bytes", "gpt2_mini"}
    assert gpt2 | {"hf:gpt2", "hf:llama"} == set(offered)


@pytest.mark.parametrize("name", model_names())
def test_every_offered_preset_trains_on_the_default_data(name):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    spec = model_spec(name)
    vocab = spec.vocab_size
    # "auto" never picks a tokenizer whose ids the model cannot embed, whatever is cached.
    assert get_tokenizer("auto", vocab).vocab_size <= vocab
    assert vocab >= ByteTokenizer.vocab_size
    if vocab < GPT2_VOCAB_SIZE:
        assert get_tokenizer("auto", vocab).name == "byte"
    if spec.num_parameters() > RUN_MAX_PARAMS:
        return
    losses = main("single_device", ["--model", name, "--device", "cpu", "--lr", "1e-3", *SHORT])
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def test_on_a_terminal_the_bar_is_drawn_and_step_lines_stay_whole(corpus_bin):
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100
    cmd = [sys.executable, "example/single_device/train.py", "--model", "gpt2_bytes"]
    proc = subprocess.Popen(
        [*cmd, "--device", "cpu", "--data", corpus_bin, *SHORT],
        cwd=ROOT,
        env=_env(),
        stdout=secondary,
        stderr=secondary,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(primary)
    assert proc.wait(timeout=240) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "\r" in text and "it/s" in text  # tqdm's frames
    # tqdm.write clears the bar before a step line and redraws it after: lines stay whole.
    lines = [line for line in text.replace("\r", "\n").split("\n") if STEP_LINE.search(line)]
    assert len(lines) == 2 and all(STEP_LINE.match(line.strip()) for line in lines), lines
