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
