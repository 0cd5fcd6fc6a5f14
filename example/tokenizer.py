"""Deterministic tokenizers for the GPT-2 example: GPT-2 BPE when it is cached offline, else bytes.

Every tokenizer has ``.name``, ``.vocab_size``, ``encode(str) -> list[int]`` and
``decode(list[int]) -> str``; ids are always in ``[0, vocab_size)``.

[Note: no network]
``tiktoken`` downloads the GPT-2 merge tables on first use. This module must never do that, so
BPE is used only when (a) ``tiktoken`` is importable, (b) both GPT-2 files already sit in the
directory tiktoken reads its cache from, under the sha1-of-URL file names tiktoken uses, and (c)
their sha256 digests match the published ones (a mismatch would make tiktoken re-download). As a
last guard, tiktoken's file reader is swapped for one that raises while the encoding is built, so
a tiktoken version with a different cache rule fails closed instead of reaching the network.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator, List, Optional, Protocol, Sequence

TOKENIZER_NAMES = ("auto", "byte", "gpt2")
GPT2_VOCAB_SIZE = 50257  # ids of GPT-2's BPE are in [0, 50257)

# The two GPT-2 files tiktoken builds its "gpt2" encoding from, with their published sha256.
_GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# tiktoken has named the same blobs with both URL schemes over its releases; the cache file name
# is sha1(URL), so each scheme gives different file names.
_GPT2_URL_PREFIXES = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/",
    "az://openaipublic/gpt-2/encodings/main/",
)


class TokenizerUnavailableError(RuntimeError):
    """The requested tokenizer cannot be built on this machine without a download."""


class Tokenizer(Protocol):
    """What the example needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> List[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte value, vocab 256. Lossless for any ``str`` without lone
    surrogates; ``decode`` replaces invalid UTF-8 (e.g. a window cut mid-character) with U+FFFD."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"byte tokenizer got ids outside [0, 256): {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE (vocab 50257) via ``tiktoken``; special tokens in text are encoded as plain text
    so that a corpus containing ``<|endoftext|>`` cannot make ``encode`` fail."""

    name = "gpt2"

    def __init__(self, encoding) -> None:
        self._encoding = encoding
        self.vocab_size = int(encoding.n_vocab)

    def encode(self, text: str) -> List[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])


def _tiktoken_cache_dirs() -> List[str]:
    """Directories tiktoken may read cached files from, mirroring its lookup order."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            # An empty value disables tiktoken's cache, i.e. it would always download.
            return [os.environ[var]] if os.environ[var] else []
    # Older releases default to <tmp>/data-gym-cache, newer ones to the user cache directory.
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [os.path.join(tempfile.gettempdir(), "data-gym-cache"), os.path.join(xdg, "tiktoken")]


def _sha256_of(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def find_cached_gpt2_files() -> Optional[str]:
    """The cache directory holding both intact GPT-2 files for one URL scheme, or None."""
    for cache_dir in _tiktoken_cache_dirs():
        for prefix in _GPT2_URL_PREFIXES:
            paths = {
                name: os.path.join(cache_dir, hashlib.sha1((prefix + name).encode()).hexdigest())
                for name in _GPT2_FILES
            }
            if all(_sha256_of(paths[n]) == digest for n, digest in _GPT2_FILES.items()):
                return cache_dir
    return None


@contextmanager
def _offline_tiktoken(tiktoken_load, cache_dir: str) -> Iterator[None]:
    """Pin tiktoken to ``cache_dir`` and make any attempt to fetch a file raise."""

    def refuse(blobpath: str) -> bytes:
        raise TokenizerUnavailableError(f"refusing to download {blobpath}")

    saved_env = {v: os.environ.get(v) for v in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")}
    saved_reader = tiktoken_load.read_file
    os.environ["TIKTOKEN_CACHE_DIR"] = os.environ["DATA_GYM_CACHE_DIR"] = cache_dir
    tiktoken_load.read_file = refuse
    try:
        yield
    finally:
        tiktoken_load.read_file = saved_reader
        for var, value in saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _load_gpt2() -> GPT2Tokenizer:
    """Build the BPE tokenizer without network access, or raise TokenizerUnavailableError."""
    how_to_fix = (
        "use --tokenizer byte, or cache the GPT-2 encoding once on a machine with network "
        "(python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\") and point "
        "TIKTOKEN_CACHE_DIR at that cache"
    )
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as e:
        raise TokenizerUnavailableError(f"gpt2 tokenizer needs tiktoken ({how_to_fix})") from e
    cache_dir = find_cached_gpt2_files()
    if cache_dir is None:
        searched = ", ".join(_tiktoken_cache_dirs()) or "(caching disabled by env var)"
        raise TokenizerUnavailableError(
            f"GPT-2 BPE files are not cached offline (searched {searched}); {how_to_fix}"
        )
    try:
        with _offline_tiktoken(tiktoken.load, cache_dir):
            encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:  # any failure here means "not usable offline"; say why
        raise TokenizerUnavailableError(f"tiktoken could not load gpt2 offline: {e}") from e
    return GPT2Tokenizer(encoding)


def get_tokenizer(name: str = "auto", vocab_size: Optional[int] = None) -> Tokenizer:
    """``"byte"``, ``"gpt2"`` (raises TokenizerUnavailableError if not available offline), or
    ``"auto"``: gpt2 when available offline and its ids fit ``vocab_size`` (the model's
    vocabulary; None: no limit), else byte. Never touches the network."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return _load_gpt2()
    if name == "auto":
        if vocab_size is not None and vocab_size < GPT2_VOCAB_SIZE:
            return ByteTokenizer()  # a byte-level model (gpt2_bytes) keeps bytes
        try:
            return _load_gpt2()
        except TokenizerUnavailableError:
            return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; choose one of {TOKENIZER_NAMES}")
