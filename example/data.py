"""Training data for the GPT-2 example: a built-in corpus, token files, and per-rank batches.

Tokens are always a 1-D ``torch.int64`` tensor holding the whole stream in memory (8 bytes per
token; fine for the corpora this example is meant for, up to a few hundred million tokens).

[Note: the default corpus]
The repository ships no prose, and training must work offline on a fresh machine, so the default
corpus is built at run time from the docstrings of the Python standard library that came with the
interpreter: real English, ~1.5 MB, identical on every machine with the same Python build.

[Note: deterministic per-rank batches]
The global batch of a step is ``world_size * batch_size`` windows whose start offsets depend only
on ``(seed, step, split)``; rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)``. So
N ranks with batch ``b`` see exactly the rows of one process with batch ``N * b``, which is what
lets every strategy be checked against single-device training step by step.
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import os
import sys
import sysconfig
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from example.tokenizer import Tokenizer

DEFAULT_CORPUS_BYTES = 1_500_000
DEFAULT_CORPUS_SOURCE = "docstrings of the installed Python standard library (read at run time)"
# Directories whose docstrings are tests, GUI, vendored packages or (lib2to3) Python 2 era code.
_SKIP_DIRS = frozenset(
    (
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "site-packages",
        "ensurepip",
        "turtledemo",
        "__pycache__",
    )
)
SPLITS = ("train", "val")


class DataError(ValueError):
    """Unusable training data. The message names the source and says how to fix it."""


# --------------------------------------------------------------------------- default corpus


def _stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def default_corpus_description() -> str:
    """One line for logs and the README: where the default corpus comes from."""
    version = ".".join(map(str, sys.version_info[:3]))
    return (
        f"first ~{DEFAULT_CORPUS_BYTES / 1e6:.1f} MB of module/class/function docstrings of the "
        f"Python {version} standard library at {_stdlib_dir()} (read at run time, no download)"
    )


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of ``node`` and of the classes/functions nested in it, in source order."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
    # Only statement lists can hold definitions; skipping expressions keeps this ~5x faster
    # than ast.walk, which matters because the corpus is rebuilt on every run.
    for field in ("body", "orelse", "finalbody", "handlers"):
        children = getattr(node, field, None)
        if isinstance(children, list):
            for child in children:
                yield from _docstrings(child)


def _stdlib_sources(root: str) -> List[str]:
    """``.py`` files under ``root`` outside the skipped directories, sorted by relative path."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    # Sort on the relative, '/'-separated path so the order does not depend on os.walk or the OS.
    return sorted(paths, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def build_corpus_from_docstrings(root: str, max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """Docstrings of the ``.py`` files under ``root`` (sorted order) joined by blank lines,
    stopping after the docstring that brings the UTF-8 size to ``max_bytes`` or more."""
    parts: List[str] = []
    size = 0
    # ast.parse allocates millions of objects, which triggers the cyclic GC over and over
    # (~half the build time). AST trees hold no reference cycles, so reference counting alone
    # frees them; the collector is paused only for this loop and restored as it was.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for path in _stdlib_sources(root):
            try:
                with open(path, "rb") as f:
                    source = f.read()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # e.g. SyntaxWarning on old escapes
                    tree = ast.parse(source, filename=path)
            except (OSError, SyntaxError, ValueError, RecursionError):
                continue  # unreadable or not parseable by this Python: not in the corpus
            for doc in _docstrings(tree):
                parts.append(doc)
                size += len(doc.encode("utf-8")) + 2
            if size >= max_bytes:
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return "\n\n".join(parts)


@functools.lru_cache(maxsize=1)
def default_corpus_text() -> str:
    """The built-in corpus (see the note at the top); cached, call ``.cache_clear()`` to rebuild.
    Deterministic for a given Python installation."""
    text = build_corpus_from_docstrings(_stdlib_dir())
    if not text:
        raise DataError(
            f"no docstrings found under {_stdlib_dir()} to build the default corpus; "
            "pass a text file or a .bin token file instead"
        )
    return text


# --------------------------------------------------------------------------- token files


def check_vocab(tokens: torch.Tensor, vocab_size: int, source: str = "tokens") -> None:
    """Raise DataError unless every id in ``tokens`` is in ``[0, vocab_size)``."""
    if tokens.numel() == 0:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise DataError(
            f"{source}: token ids span [{lo}, {hi}] but the vocabulary has {vocab_size} entries; "
            "tokenize the data with the same tokenizer as the model (e.g. --tokenizer gpt2) or "
            "build the model with a larger vocab_size"
        )


def save_tokens(path: str, tokens: torch.Tensor) -> None:
    """Write ``tokens`` as raw little-endian uint16 (the ``.bin`` format ``load_tokens`` reads)."""
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise DataError(f"{path}: token ids must fit in uint16 to be saved as .bin")
    tokens.to(torch.int64).numpy().astype("<u2").tofile(path)


def _read_bin(path: str) -> torch.Tensor:
    nbytes = os.path.getsize(path)
    if nbytes % 2:
        raise DataError(
            f"{path}: {nbytes} bytes is not a whole number of uint16 tokens; a .bin file must be "
            "raw little-endian uint16 token ids (write one with example.data.save_tokens), and a "
            "text file must not end in .bin"
        )
    return torch.from_numpy(np.fromfile(path, dtype="<u2").astype(np.int64))


def _read_text(path: str, tokenizer: Tokenizer) -> torch.Tensor:
    with open(path, "rb") as f:
        raw = f.read()
    # A NUL byte is valid UTF-8 but never appears in prose: this is a binary file.
    if b"\x00" in raw:
        raise DataError(
            f"{path}: looks like a binary file (contains NUL bytes); pass a UTF-8 text file, or "
            "name a raw uint16 token file *.bin"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}); convert it, e.g. "
            f"`iconv -t UTF-8 {path} > out.txt`"
        ) from e
    return torch.tensor(tokenizer.encode(text), dtype=torch.int64)


def load_tokens(
    path: Optional[str], tokenizer: Tokenizer, seq_len: Optional[int] = None
) -> torch.Tensor:
    """Token stream as a 1-D int64 tensor.

    ``path`` None: the default corpus, tokenized. ``*.bin``: raw little-endian uint16 token ids
    (nanoGPT layout), already tokenized. Anything else: a UTF-8 text file, tokenized. Every
    problem raises DataError naming the path: missing/unreadable/empty file, odd-sized .bin,
    binary or non-UTF-8 text, ids outside the tokenizer's vocab, and, if ``seq_len`` is given,
    fewer than ``seq_len + 1`` tokens (one input/target window).
    """
    if path is None:
        source = "default corpus"
        tokens = torch.tensor(tokenizer.encode(default_corpus_text()), dtype=torch.int64)
    else:
        source = path
        if not os.path.isfile(path):
            raise DataError(
                f"{path}: no such file; pass an existing UTF-8 text file or .bin token file, or "
                "no path to use the built-in corpus"
            )
        if os.path.getsize(path) == 0:
            raise DataError(f"{path}: file is empty; pass a file with some text or tokens")
        try:
            tokens = _read_bin(path) if path.endswith(".bin") else _read_text(path, tokenizer)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror}); check the permissions") from e
        if tokens.numel() == 0:
            raise DataError(f"{path}: contains no tokens; pass a file with some text or tokens")
    check_vocab(tokens, tokenizer.vocab_size, source)
    if seq_len is not None and tokens.numel() < seq_len + 1:
        raise DataError(
            f"{source}: {tokens.numel()} tokens, too short for one window of seq_len + 1 = "
            f"{seq_len + 1}; use more data or a smaller seq_len"
        )
    return tokens


# --------------------------------------------------------------------------- batches


def _generator_seed(seed: int, step: int, split: str) -> int:
    """A 63-bit seed that is a pure function of its arguments (unlike ``hash()`` of a str)."""
    digest = hashlib.sha256(f"{seed}/{step}/{split}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TokenBatches:
    """Deterministic (x, y) windows from a token stream, split into train and val.

    The first ``1 - val_fraction`` of the stream is ``"train"``, the rest ``"val"``; a window
    never crosses that boundary. Batches depend only on ``(tokens, seq_len, seed, step, split,
    batch_size * world_size)`` and never touch the global torch RNG.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        seed: int,
        val_fraction: float = 0.1,
        source: str = "tokens",
    ) -> None:
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise DataError(f"{source}: tokens must be a 1-D integer tensor, got {tokens.dtype}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.seq_len = seq_len
        self.seed = seed
        self.source = source
        tokens = tokens.to(torch.int64)
        n_val = int(tokens.numel() * val_fraction)
        n_train = tokens.numel() - n_val
        self.splits: Dict[str, torch.Tensor] = {"train": tokens[:n_train]}
        if val_fraction > 0:
            self.splits["val"] = tokens[n_train:]
        for split, data in self.splits.items():
            if data.numel() < seq_len + 1:
                raise DataError(
                    f"{source}: the {split} split has {data.numel()} tokens, fewer than "
                    f"seq_len + 1 = {seq_len + 1}; use more data, a smaller seq_len or a "
                    f"different val_fraction (now {val_fraction})"
                )

    def _split(self, split: str) -> torch.Tensor:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split not in self.splits:
            raise DataError(f"{self.source}: no val split because val_fraction is 0")
        return self.splits[split]

    def global_offsets(self, step: int, split: str, global_batch_size: int) -> torch.Tensor:
        """Start offsets (global_batch_size,) int64 into the split, from (seed, step, split)."""
        data = self._split(split)
        generator = torch.Generator().manual_seed(_generator_seed(self.seed, step, split))
        # Last valid start s has its target window end at s + seq_len == len(data) - 1.
        n_starts = data.numel() - self.seq_len
        return torch.randint(n_starts, (global_batch_size,), generator=generator)

    def get_batch(
        self, step: int, split: str, batch_size: int, rank: int = 0, world_size: int = 1
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)``, each (batch_size, seq_len) int64 and contiguous, with
        ``y[:, t] == x[:, t + 1]`` for ``t < seq_len - 1`` (y is x shifted one token on)."""
        if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world_size, got batch_size={batch_size}, "
                f"rank={rank}, world_size={world_size}"
            )
        data = self._split(split)
        starts = self.global_offsets(step, split, world_size * batch_size)
        starts = starts[rank * batch_size : (rank + 1) * batch_size]
        index = starts[:, None] + torch.arange(self.seq_len)  # (batch_size, seq_len)
        # Two gathers rather than slicing one (seq_len + 1) window, so x and y never alias.
        return data[index], data[index + 1]
