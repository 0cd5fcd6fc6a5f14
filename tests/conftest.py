"""Shared pytest configuration for the tiny_fsdp test suite."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.harness import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _shutdown_distributed_worker_pools() -> Iterator[None]:
    """Stop the persistent worker pools of ``tests.harness`` when the test session ends."""
    yield
    shutdown_pools()


@pytest.fixture(scope="session")
def corpus_bin(tmp_path_factory) -> str:
    """The examples' default corpus, byte-tokenized, as a ``.bin`` token file.

    Example runs started as subprocesses read it with ``--data`` instead of each rebuilding the
    corpus from the standard library (about a second of parsing per process): the same tokens,
    so the same losses as the default. The default path itself runs in ``tests/test_newcomer.py``.
    """
    from example.data import load_tokens, save_tokens
    from example.tokenizer import ByteTokenizer

    path = str(tmp_path_factory.mktemp("corpus") / "default_corpus_bytes.bin")
    save_tokens(path, load_tokens(None, ByteTokenizer()))
    return path
