"""Specification of the GPT-2 example's data pipeline: corpus, tokenizers, token files, batches."""

import gc
import os
import string
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from example import tokenizer as tokenizer_mod
from example.data import (
    DataError,
    TokenBatches,
    build_corpus_from_docstrings,
    check_vocab,
    default_corpus_description,
    default_corpus_text,
    load_tokens,
    save_tokens,
)
from example.tokenizer import ByteTokenizer, TokenizerUnavailableError, get_tokenizer

# ----------------------------------------------------------------------------- default corpus


def test_default_corpus_is_mostly_english_text():
    text = default_corpus_text()
    assert len(text.encode("utf-8")) >= 1_000_000
    allowed = set(string.ascii_letters + string.digits + string.punctuation + " \n\t")
    assert sum(c in allowed for c in text) / len(text) > 0.9
    for word in (" the ", " and ", " of ", " is "):
        assert word in text


def test_default_corpus_is_deterministic_and_leaves_gc_enabled():
    first = default_corpus_text()
    default_corpus_text.cache_clear()
    assert default_corpus_text() == first
    assert gc.isenabled()


def test_default_corpus_description_names_python_and_stdlib():
    description = default_corpus_description()
    assert "standard library" in description
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in description


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_corpus_builder_order_skips_and_limit(tmp_path):
    _write(tmp_path / "b.py", '"""B module."""\ndef f():\n    """F func."""\n')
    _write(tmp_path / "a.py", '"""A module."""\nclass C:\n    """C class."""\n')
    _write(tmp_path / "broken.py", '"""never seen"""\ndef (:\n')
    _write(tmp_path / "test" / "t.py", '"""test dir is skipped"""\n')
    _write(tmp_path / "pkg" / "m.py", '"""Pkg module."""\n')
    _write(tmp_path / "z.py", '"""Z module."""\n')
    full = build_corpus_from_docstrings(str(tmp_path), max_bytes=10**6)
    assert full == "A module.\n\nC class.\n\nB module.\n\nF func.\n\nPkg module.\n\nZ module."
    # The file whose docstrings cross the limit is the last one read.
    assert build_corpus_from_docstrings(str(tmp_path), max_bytes=12) == ("A module.\n\nC class.")


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("text", ["", "hello world", "naïve café ß", "日本語 🚀\n\ttabs", "\x00"])
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_unicode(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_rejects_ids_outside_vocab():
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer().decode([65, 256])


def test_get_tokenizer_byte_and_unknown_name():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size) == ("byte", 256)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("sentencepiece")


def test_gpt2_without_offline_cache_raises_and_auto_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache
    with pytest.raises(TokenizerUnavailableError, match="--tokenizer byte"):
        get_tokenizer("gpt2")
    assert get_tokenizer("auto").name == "byte"


def test_corrupt_gpt2_cache_files_are_not_used(tmp_path, monkeypatch):
    # Right file names, wrong contents: tiktoken would delete these and download again.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    for prefix in tokenizer_mod._GPT2_URL_PREFIXES:
        for name in tokenizer_mod._GPT2_FILES:
            key = tokenizer_mod.hashlib.sha1((prefix + name).encode()).hexdigest()
            (tmp_path / key).write_bytes(b"not the real file")
    assert tokenizer_mod.find_cached_gpt2_files() is None


def test_gpt2_loading_fails_closed_instead_of_downloading(tmp_path, monkeypatch):
    """A tiktoken whose cache rule we mis-modelled must hit our refusing reader, not the web."""
    fetched = []

    def real_read_file(blobpath):
        fetched.append(blobpath)
        return b""

    load = types.ModuleType("tiktoken.load")
    load.read_file = real_read_file
    fake = types.ModuleType("tiktoken")
    fake.load = load
    fake.get_encoding = lambda name: fake.load.read_file("https://example.invalid/vocab.bpe")
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setitem(sys.modules, "tiktoken.load", load)
    monkeypatch.setattr(tokenizer_mod, "find_cached_gpt2_files", lambda: str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)

    with pytest.raises(TokenizerUnavailableError, match="refusing to download"):
        get_tokenizer("gpt2")
    assert fetched == []
    assert load.read_file is real_read_file  # restored
    assert "TIKTOKEN_CACHE_DIR" not in os.environ  # restored


# ----------------------------------------------------------------------------- token files


def test_text_file_is_tokenized(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("To be, or not to be.", encoding="utf-8")
    tokens = load_tokens(str(path), ByteTokenizer())
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert tokens.tolist() == list(b"To be, or not to be.")


def test_default_corpus_tokens_match_text():
    tokens = load_tokens(None, ByteTokenizer(), seq_len=64)
    assert tokens.dtype == torch.int64
    assert tokens.numel() == len(default_corpus_text().encode("utf-8"))


@pytest.mark.parametrize("ids", [[0, 1, 255, 256, 50256, 65535], list(range(1000))])
def test_bin_file_round_trip(tmp_path, ids):
    path = str(tmp_path / "tokens.bin")
    save_tokens(path, torch.tensor(ids))
    assert os.path.getsize(path) == 2 * len(ids)
    loaded = load_tokens(path, types.SimpleNamespace(vocab_size=65536))
    assert loaded.dtype == torch.int64
    assert loaded.tolist() == ids


def test_bin_file_reads_raw_little_endian_uint16(tmp_path):
    path = tmp_path / "train.bin"
    np.array([7, 300, 50000], dtype="<u2").tofile(path)  # the nanoGPT prepare.py layout
    assert load_tokens(str(path), types.SimpleNamespace(vocab_size=50304)).tolist() == [
        7,
        300,
        50000,
    ]


def _bad_file(tmp_path, kind):
    """Returns (path, seq_len) for a file that load_tokens must reject."""
    if kind == "missing":
        return tmp_path / "nope.txt", None
    path = tmp_path / {"empty": "e.txt", "odd_bin": "odd.bin", "vocab": "big.bin"}.get(
        kind, "f.txt"
    )
    contents = {
        "empty": b"",
        "too_short": b"abc",
        "odd_bin": b"\x01\x00\x02",
        "latin1": "café".encode("latin-1"),
        "binary": b"ELF\x00\x01\x02text",
        "vocab": np.array([1, 999], dtype="<u2").tobytes(),
    }[kind]
    path.write_bytes(contents)
    return path, (8 if kind == "too_short" else None)


@pytest.mark.parametrize(
    "kind, fix_hint",
    [
        ("missing", "no such file"),
        ("empty", "empty"),
        ("too_short", "smaller seq_len"),
        ("odd_bin", "uint16"),
        ("latin1", "UTF-8"),
        ("binary", "binary"),
        ("vocab", "tokenizer"),
    ],
)
def test_bad_files_raise_data_error_naming_the_path(tmp_path, kind, fix_hint):
    path, seq_len = _bad_file(tmp_path, kind)
    with pytest.raises(DataError, match=fix_hint) as info:
        load_tokens(str(path), ByteTokenizer(), seq_len=seq_len)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("ids, ok", [([0, 255], True), ([0, 256], False), ([-1, 3], False)])
def test_check_vocab(ids, ok):
    if ok:
        check_vocab(torch.tensor(ids), 256)
    else:
        with pytest.raises(DataError, match="256"):
            check_vocab(torch.tensor(ids), 256, source="x.bin")


# ----------------------------------------------------------------------------- batches

N_TOKENS, SEQ_LEN = 5000, 16


def _batches(seed=0, val_fraction=0.1):
    # Token value == position, so every window reveals exactly where it came from.
    return TokenBatches(torch.arange(N_TOKENS), SEQ_LEN, seed, val_fraction=val_fraction)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("step", [0, 1, 17, 10_000])
@pytest.mark.parametrize("split", ["train", "val"])
def test_rank_slices_concatenate_to_the_single_process_batch(world_size, step, split):
    data, b = _batches(), 3
    per_rank = [data.get_batch(step, split, b, rank, world_size) for rank in range(world_size)]
    x_all, y_all = data.get_batch(step, split, world_size * b)
    assert torch.equal(torch.cat([x for x, _ in per_rank]), x_all)
    assert torch.equal(torch.cat([y for _, y in per_rank]), y_all)


@pytest.mark.parametrize("split", ["train", "val"])
def test_batch_shapes_and_shift(split):
    x, y = _batches().get_batch(5, split, batch_size=4)
    assert x.shape == y.shape == (4, SEQ_LEN)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, x + 1)  # positions as tokens: next token == next position
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert x.data_ptr() != y.data_ptr()


def test_same_step_repeats_other_steps_and_seeds_differ():
    data = _batches()
    x0, _ = data.get_batch(0, "train", 8)
    assert torch.equal(x0, data.get_batch(0, "train", 8)[0])
    assert torch.equal(x0, _batches().get_batch(0, "train", 8)[0])
    assert not torch.equal(x0, data.get_batch(1, "train", 8)[0])
    assert not torch.equal(x0, _batches(seed=1).get_batch(0, "train", 8)[0])


def test_val_windows_stay_in_the_last_fraction_and_train_before_it():
    data = _batches(val_fraction=0.1)
    boundary = N_TOKENS - int(N_TOKENS * 0.1)
    for step in range(20):
        x, y = data.get_batch(step, "train", 16)
        assert int(y.max()) < boundary
        xv, yv = data.get_batch(step, "val", 16)
        assert int(xv.min()) >= boundary and int(yv.max()) < N_TOKENS
    assert torch.equal(data.splits["val"], torch.arange(boundary, N_TOKENS))


def test_batches_neither_use_nor_disturb_the_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    x_a, _ = _batches().get_batch(3, "train", 8, rank=1, world_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    x_b, _ = _batches().get_batch(3, "train", 8, rank=1, world_size=2)
    assert torch.equal(x_a, x_b)


@pytest.mark.parametrize("n_tokens, val_fraction", [(16, 0.1), (200, 0.05), (10, 0.0)])
def test_split_shorter_than_one_window_raises(n_tokens, val_fraction):
    with pytest.raises(DataError, match="data.txt.*seq_len \\+ 1 = 17"):
        TokenBatches(torch.arange(n_tokens), 16, 0, val_fraction, source="data.txt")


def test_val_fraction_zero_has_no_val_split():
    data = TokenBatches(torch.arange(100), 8, 0, val_fraction=0.0)
    assert data.get_batch(0, "train", 2)[0].shape == (2, 8)
    with pytest.raises(DataError, match="val_fraction"):
        data.get_batch(0, "val", 2)


@pytest.mark.parametrize(
    "kwargs", [dict(rank=2, world_size=2), dict(batch_size=0), dict(split="test")]
)
def test_get_batch_rejects_bad_arguments(kwargs):
    args = dict(step=0, split="train", batch_size=2, rank=0, world_size=1)
    args.update(kwargs)
    with pytest.raises(ValueError):
        _batches().get_batch(**args)
