"""Base of the wrappers whose layers fetch full parameters to compute: FSDP and ZeRO-3.

[Note: fetching strategies]
Between steps a rank of FSDP or ZeRO-3 holds only its local parts ([Note: glossary]); each
layer's handler fetches the full parameters just before the layer computes and releases them
after ([Note: param handler]), in an order the strategy's ``Prefetcher`` records and runs
ahead of ([Note: prefetch]). What the two wrappers share is written here: the forward brackets
the model call with the prefetcher's ``pre_forward`` / ``post_forward`` and watches parameters
read outside their layer ([Note: outside reads]).
"""

from typing import Any

import torch

from tiny_fsdp.core.module.outside_reads import OutsideReadWatch
from tiny_fsdp.core.prefetch import Prefetcher
from tiny_fsdp.core.wrapper import DataParallelWrapper


class FetchingWrapper(DataParallelWrapper):
    """A wrapper whose layers fetch through a ``Prefetcher`` ([Note: fetching strategies])."""

    def fetch_through(self, prefetcher: Prefetcher) -> None:
        """The last step of a subclass's ``__init__``, once the layers have their handlers."""
        self._prefetcher = prefetcher
        self._reads = OutsideReadWatch(self.module)

    @property
    def prefetch_limit(self) -> int:
        """At most this many prefetched units unconsumed at once ([Note: prefetch])."""
        return self._prefetcher.prefetch_limit

    def before_load(self) -> None:
        self._prefetcher.drop_transients()  # full / prefetched parameters would go stale

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._prefetcher.pre_forward(self.enable_async_communication, torch.is_grad_enabled())
        try:
            return self._reads(lambda: self.module(*args, **kwargs))  # [Note: outside reads]
        finally:
            self._prefetcher.post_forward()
