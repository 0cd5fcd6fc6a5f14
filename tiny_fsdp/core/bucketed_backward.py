"""The backward engine of DDP and ZeRO-1/2: hooks, bucket order, end of backward.

[Note: bucketed backward]
DDP, ZeRO-1 and ZeRO-2 reduce gradients in the same way and differ only in where a gradient is
kept and what a bucket's reduction leaves behind. ``BucketedBackward`` is the shared part; a
*gradient store* (``GradStore``) is the strategy's part: ``AllReduceBuckets`` (DDP, [Note: DDP
backward]), ``FullGradBuffer`` (ZeRO-1) and ``StagedGradShard`` (ZeRO-2) ([Note: ZeRO gradient
stores]).

The store lists its trainable parameters (``params``; a tied parameter once, a frozen one never)
and groups their indices into buckets (``bucket_members``), in launch order, the same on every
rank. Each of those parameters gets a ``register_post_accumulate_grad_hook``: autograd calls it
once per backward, after the parameter's gradient is fully accumulated into ``param.grad`` (a
tied parameter is one leaf: once, after both uses). Hooks hold the engine weakly and the engine
holds the wrapper weakly, so a discarded wrapper does not live on through its parameters.

1. The first hook of a backward reads ``require_backward_grad_sync`` and
   ``enable_async_communication`` for the whole backward and calls ``store.begin`` (which may
   refuse: ZeRO raises on gradients already reduced). ``_end_of_backward`` runs once the
   backward is over, queued on the autograd engine's *outermost* backward: a reentrant
   ``torch.utils.checkpoint`` runs its part of backward as a nested one, whose end is not the
   end (with every trainable parameter inside checkpoints, a first hook fires in a nested
   backward). So the wrapper's forward puts a ``register_multi_grad_hook`` on its output, which
   fires first in any backward through it and queues the end there; it ends nothing if no
   gradient hook fired (``torch.autograd.grad`` on inputs). A backward that does not run through
   the wrapper's output (``model.module(...)``) has the end queued by its first hook.
2. Inside ``no_sync()`` a hook only calls ``store.keep_local``: nothing is communicated and the
   gradients accumulate locally; the next synchronised backward reduces the accumulated total.
3. In a synchronised backward a hook calls ``store.add`` (the gradient, divided by the world size,
   into its bucket: a SUM reduction then leaves the average) and counts the arrival in the bucket.
   With ``enable_async_communication``, or with a store that ``reduces_eagerly`` (ZeRO-2: that is
   what frees the full gradients), every complete bucket whose predecessors are all launched is
   launched now: asynchronously with ``enable_async_communication`` (the reductions overlap the
   rest of backward; those already done are finished at each hook), else synchronously. Launching
   strictly in bucket order makes the collectives of all ranks pair up whatever order their
   gradients arrive in. A store whose reductions hold memory until finished (ZeRO-2's staging
   buffers) sets ``max_in_flight``: launching one more first waits for the oldest, so at most
   that many buckets' buffers are in flight besides the one being filled.
4. ``_end_of_backward`` runs at the end of every backward. In a synchronised one it adds the
   parameters whose hook never fired (unused in this forward: the store sends the ``param.grad``
   kept from ``no_sync`` micro-steps, else zeros), so every rank issues the same collectives;
   launches the buckets not launched yet, in order; finishes every bucket. Then it calls
   ``store.end(sync)`` (DDP's mixed precision gives the parameters back their fp32 masters
   there, [Note: DDP mixed precision]).

Results are bitwise identical with asynchronous communication on and off: same buckets, same
data, same collectives in the same order; only when they run changes. If a backward raises before
its end callback runs, the wrapper's next forward drops the half state (``store.reset``).

Limits: every rank must run backward through at least one trainable parameter in a synchronised
step (otherwise its end callback is never queued and the other ranks wait); the set of trainable
parameters is the store's (DDP builds a new store and engine when it changes: [Note: trainable
set after wrapping] in ``replicated.py``).
"""

import weakref
from typing import Any, Collection, List, Optional, Protocol, Sequence

import torch
from torch import nn

from tiny_fsdp.core.module.generic import output_tensors
from tiny_fsdp.core.sparse_grads import densify_grad
from tiny_fsdp.core.utils.weak_hooks import remove_when_gone, weak_hook


class GradStore(Protocol):
    """Where a strategy keeps gradients and how it reduces a bucket ([Note: bucketed backward]).

    Attributes:
        params: the trainable parameters; a parameter's index is its position here.
        bucket_members: the parameter indices of each bucket, in launch order.
        reduces_eagerly: reduce a complete bucket during backward even without asynchronous
            communication (synchronously then).
        max_in_flight: at most this many asynchronous reductions unfinished (None: no limit).
        sparse_indices: the parameters whose sparse gradients the store takes as they are; any
            other sparse gradient is made dense before the store sees it ([Note: sparse
            gradients]).
    """

    params: Sequence[nn.Parameter]
    bucket_members: Sequence[Sequence[int]]
    reduces_eagerly: bool
    max_in_flight: Optional[int]
    sparse_indices: Collection[int]

    def begin(self, sync: bool) -> None:
        """The first hook of a backward fired (``sync``: it is a synchronised one)."""

    def keep_local(self, index: int, param: nn.Parameter) -> None:
        """``no_sync`` hook: the gradient stays on this rank, accumulating."""

    def add(self, index: int, param: nn.Parameter) -> None:
        """Take ``param.grad / world_size`` into the bucket (``param.grad`` None: zeros)."""

    def launch(self, bucket: int, async_op: bool) -> None:
        """Start the reduction of ``bucket`` (all its parameters added)."""

    def is_done(self, bucket: int) -> bool:
        """The launched reduction of ``bucket`` has completed (never blocks)."""

    def finish(self, bucket: int) -> None:
        """Wait for the reduction of ``bucket`` and put its result in place."""

    def end(self, sync: bool) -> None:
        """The backward is over (every backward, ``no_sync`` ones included); with ``sync`` every
        bucket is finished."""

    def reset(self) -> None:
        """Forget the progress of the current backward (also after a failed one)."""


class BucketedBackward:
    """Drive ``store`` through every backward of ``owner``'s model ([Note: bucketed backward]).

    ``owner``: the wrapper, read for ``require_backward_grad_sync`` and
    ``enable_async_communication``; its forward drops the state of a backward that raised.
    """

    def __init__(self, owner: nn.Module, store: GradStore) -> None:
        self.store = store
        self._owner = weakref.ref(owner)
        self._bucket_of = [0] * len(store.params)  # parameter index -> bucket
        for b, members in enumerate(store.bucket_members):
            for index in members:
                self._bucket_of[index] = b
        self._sizes = [len(members) for members in store.bucket_members]
        self._reset()
        self._hook_handles = [  # [Note: tensor hooks hold their owner weakly]
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready, index))
            for index, p in enumerate(store.params)
        ]
        # Hooks on the wrapper hold the engine: the collector sees through a module's hooks.
        self._hook_handles.append(owner.register_forward_pre_hook(self._drop_stale_state))
        self._hook_handles.append(owner.register_forward_hook(self._watch_output))
        remove_when_gone(self, self._hook_handles)

    def remove(self) -> None:
        """Unhook from the parameters and the wrapper (the wrapper builds a new engine)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _reset(self) -> None:
        self._outer_end_queued = False  # a backward through the output queued the end
        self._active = False  # a backward's first hook fired, its end callback has not run
        self._sync = True  # this backward is synchronised
        self._async = False  # this backward launches asynchronously
        self._fired = [False] * len(self.store.params)
        self._arrived = [0] * len(self._sizes)  # parameters added, per bucket
        self._next_launch = 0  # buckets before this index are launched
        self._in_flight: List[int] = []  # launched asynchronously, not finished yet
        self.store.reset()

    def _drop_stale_state(self, module: nn.Module, args: Any) -> None:
        if self._active or self._outer_end_queued:  # a backward raised before its end ran
            self._reset()

    def _on_grad_ready(self, index: int, param: nn.Parameter) -> None:
        if not self._active:
            owner = self._owner()
            if owner is None:
                return
            self._begin(owner.require_backward_grad_sync, owner.enable_async_communication)
            if not self._outer_end_queued:  # a backward not through the wrapper's output
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if torch.is_grad_enabled():  # a backward with create_graph=True: record nothing
            with torch.no_grad():
                self._take(index, param)
        else:  # the usual backward, already without grad: no context to enter per parameter
            self._take(index, param)

    def _take(self, index: int, param: nn.Parameter) -> None:
        """Hand parameter ``index``'s new gradient to the store; launch what is complete."""
        self._densify(index, param)
        if not self._sync:
            self.store.keep_local(index, param)
            return
        self._add(index, param)
        if self._async or self.store.reduces_eagerly:
            self._launch_complete_buckets()
            self._finish_completed()

    def reduce_without_gradients(self) -> None:
        """The collectives of a synchronised backward in which no gradient arrived, as a rank
        that ran out of data issues them for the others ([Note: DDP join]): every bucket in
        launch order, with zeros; afterwards ``.grad`` holds what the other ranks reduced."""
        for param in self.store.params:
            param.grad = None  # a rank without data contributes nothing
        self._begin(sync=True, async_op=False)
        self._end_of_backward()

    def _begin(self, sync: bool, async_op: bool) -> None:
        """A backward starts: ``store.begin`` (which may refuse) and its settings."""
        self.store.begin(sync)
        self._active, self._sync, self._async = True, sync, async_op

    def _densify(self, index: int, param: nn.Parameter) -> None:
        """A sparse ``.grad`` the store does not take sparse is made dense ([Note: sparse
        gradients])."""
        if index not in self.store.sparse_indices:
            densify_grad(param)

    def _watch_output(self, module: nn.Module, args: Any, output: Any) -> None:
        needing = [t for t in output_tensors(output) if t.requires_grad]
        if needing and torch.is_grad_enabled():
            register = torch.autograd.graph.register_multi_grad_hook
            register(needing, self._outer_backward_starts, mode="any")

    def _outer_backward_starts(self, grad: Optional[torch.Tensor]) -> None:
        if not self._outer_end_queued:
            self._outer_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_outer_backward)

    def _end_of_outer_backward(self) -> None:
        self._outer_end_queued = False
        if self._active:
            self._end_of_backward()

    def _add(self, index: int, param: nn.Parameter) -> None:
        if self._fired[index]:
            raise RuntimeError(
                f"the gradient of trainable parameter {index} became ready twice in one backward"
            )
        self.store.add(index, param)
        self._fired[index] = True
        self._arrived[self._bucket_of[index]] += 1

    def _launch_complete_buckets(self) -> None:
        """Launch, in order, the complete buckets that follow the last launched one."""
        while (
            self._next_launch < len(self._sizes)
            and self._arrived[self._next_launch] == self._sizes[self._next_launch]
        ):
            b = self._next_launch
            self.store.launch(b, async_op=self._async)
            if self._async:
                self._in_flight.append(b)
                limit = self.store.max_in_flight
                if limit is not None and len(self._in_flight) > limit:
                    self.store.finish(self._in_flight.pop(0))  # bounds the buffers in flight
            else:
                self.store.finish(b)
            self._next_launch += 1

    def _finish_completed(self) -> None:
        """Finish the asynchronous reductions that are done, without waiting for the others."""
        running = []
        for b in self._in_flight:
            if self.store.is_done(b):
                self.store.finish(b)
            else:
                running.append(b)
        self._in_flight = running

    def _end_of_backward(self) -> None:
        if not self._active:  # ended already (the end queued for the output came first)
            return
        try:
            with torch.no_grad():
                if self._sync:
                    for index, p in enumerate(self.store.params):
                        if not self._fired[index]:  # unused in this forward: zeros or kept grads
                            self._densify(index, p)  # a .grad set by hand may be sparse
                            self._add(index, p)
                    self._launch_complete_buckets()  # all complete now
                    for b in self._in_flight:
                        self.store.finish(b)
                self.store.end(self._sync)
        finally:
            self._reset()


def divide_into(out: torch.Tensor, grad: torch.Tensor, divisor: int, in_place: bool) -> None:
    """``out`` := ``grad / divisor``, a store's pre-division before its SUM ([Note: bucketed
    backward]); ``in_place``: ``grad`` is ``out``. x / 1 is x bit for bit, so a divisor of 1
    copies (in place: nothing), an op cheaper to issue than a division."""
    if in_place:
        if divisor != 1:
            out.div_(divisor)
    elif divisor == 1:
        out.copy_(grad)
    else:
        torch.div(grad, divisor, out=out)  # copy and divide in one pass
