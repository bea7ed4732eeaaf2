"""Gradient synchronisation without FSDP (``--zero none``; FSDP2 reduces gradients itself), overlapped
with the backward (docs/memory.md).

Loss convention (``loongtrain.loss.sharded.sharded_cross_entropy``): each rank back-propagates its
local token-loss sum divided by the replica's token count. Parameters are replicated on all
``world = dp * sp`` ranks, so the exact gradient of the dp-averaged loss is

    grad = (1 / dp) * sum over all world ranks of the local gradient

(the sum over the sp ranks of a replica gives that replica's full-sequence gradient; dividing the
sum over replicas by dp averages them). All-reduces over the world do both.

:class:`GradientSync` splits the gradients into the buckets of
:func:`loongtrain.parallel.buckets.gradient_buckets` (the order the backward produces them: the reverse of
the model's parameter order) and all-reduces each bucket asynchronously as soon as all its gradients are
accumulated (``register_post_accumulate_grad_hook``), while the backward goes on. Buckets are launched in
bucket order only, so every rank issues the same collectives in the same order whatever order its own
gradients arrive in; a parameter that got no gradient in this backward waits for :meth:`GradientSync.finish`
(zeros, or the gradient of an earlier micro-batch). A bucket's gradients become views into its flat buffer
(no second copy of the gradients lives while the all-reduces run); a bucket of one gradient is reduced in
place, without a copy.

A failure on one rank inside :meth:`GradientSync.overlapped` (its backward, a hook, a wait) would leave its
peers blocked in the all-reduces it never joins until the process group's timeout. So the failing rank
posts one line naming itself under :data:`FAILURE_KEY` in the process group's store, and every rank waits
for its buckets polling both the work and that key (every :data:`POLL_S`, well inside the launcher's
heartbeat timeout): a peer's failure ends the wait with :class:`PeerFailure` naming that rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.parallel.buckets import BUCKET_BYTES, gradient_buckets
from loongtrain.parallel.failures import one_line
from loongtrain.parallel.runtime import is_distributed

FAILURE_KEY = "loongtrain/gradient_sync_failure"
POLL_S = 0.5  # seconds between looks at the store for a peer's failure while a bucket is in flight


class PeerFailure(RuntimeError):
    """Another rank failed inside the gradient sync; the message names it."""


def needs_grad_sync(model: nn.Module) -> bool:
    """False when gradients are already synchronised by a wrapper (FSDP2 DTensor parameters)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return False
    return not any(type(p).__name__ == "DTensor" for p in model.parameters())


class GradientSync:
    """Bucketed, overlapped all-reduce SUM of ``model``'s gradients over the world, divided by ``dp``.

    ``with sync.overlapped(): loss.backward()`` reduces during that backward (the last micro-batch's; the
    others accumulate untouched) and, on leaving the block, launches what is left and waits for every
    bucket, so the gradients are synchronised when it returns. Collective: every rank enters the block for
    the same backward."""

    def __init__(self, model: nn.Module, dp: int, bucket_bytes: int = BUCKET_BYTES, poll_s: float = POLL_S) -> None:
        self.dp, self.poll_s = dp, poll_s
        # peers to watch while a bucket is in flight: none alone, and none in the simulation's fake group (its
        # works never report completion)
        self._watch_peers = is_distributed() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
        self.params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.buckets = gradient_buckets(sizes, bucket_bytes, [p.dtype for p in self.params])
        self._where = {id(self.params[i]): b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._armed = False
        self._ready: list[int] = []  # per bucket: gradients accumulated in this backward
        self._launched: list[tuple[torch.Tensor, dist.Work | None]] = []  # (flat buffer, work) in bucket order
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    @contextmanager
    def overlapped(self) -> Iterator[None]:
        """Reduce the gradients of the backward run inside the block (class docstring)."""
        assert not self._armed, "GradientSync.overlapped is not reentrant"
        self._armed, self._ready, self._launched = True, [0] * len(self.buckets), []
        try:
            yield
            self.finish()
        except BaseException as exc:
            if not isinstance(exc, PeerFailure):
                _post_failure(exc)
            raise
        finally:
            self._armed = False

    def reduce(self) -> None:
        """Synchronise the gradients already accumulated (no backward to overlap with)."""
        with self.overlapped():
            pass

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._where[id(param)]
        self._ready[bucket] += 1
        assert self._ready[bucket] <= len(self.buckets[bucket]), "a gradient was accumulated twice in one backward"
        while len(self._launched) < len(self.buckets) and \
                self._ready[len(self._launched)] == len(self.buckets[len(self._launched)]):
            self._launch(len(self._launched))

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        """Gradients of bucket ``b`` into one flat buffer (missing ones as zeros), the parameters' ``.grad``
        views of it; its all-reduce started."""
        params = [self.params[i] for i in self.buckets[b]]
        if len(params) == 1 and params[0].grad is not None and params[0].grad.is_contiguous():
            flat = params[0].grad  # reduced in place: no copy
            self._launched.append((flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))
            return
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            n = p.numel()
            view = flat[offset:offset + n].view_as(p)
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view
            offset += n
        self._launched.append((flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))

    @torch.no_grad()
    def finish(self) -> None:
        """Launch the buckets not launched yet (in order), wait for all, divide by ``dp``."""
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        for flat, work in self._launched:
            if work is not None:
                self._wait(work)
            if self.dp > 1:
                flat.div_(self.dp)
        self._launched = []

    def _wait(self, work: dist.Work) -> None:
        """``work.wait()``, raising :class:`PeerFailure` as soon as a peer has posted its failure (looked up
        every ``poll_s`` while the work is in flight; short sleeps in between)."""
        if not self._watch_peers:
            work.wait()
            return
        nap, last_look = 1e-4, time.monotonic()
        while not work.is_completed():
            if time.monotonic() - last_look >= self.poll_s:
                failure = _peer_failure()
                if failure is not None:
                    raise PeerFailure(f"gradient sync stopped: {failure}")
                last_look = time.monotonic()
            time.sleep(nap)
            nap = min(2 * nap, 2e-3, self.poll_s)
        work.wait()

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()  # the process group's own store (no public accessor)


def _post_failure(exc: BaseException) -> None:
    """Tell the peers that this rank failed, in one line naming it (best effort: the store may be gone)."""
    try:
        _store().set(FAILURE_KEY, f"rank {dist.get_rank()} failed: {one_line(exc)}")
    except Exception:  # noqa: BLE001 - the original failure is what this rank raises
        pass


def _peer_failure() -> str | None:
    """The line a failed rank posted, or None (also for a store that cannot be asked: a fake process group's)."""
    try:
        store = _store()
        return store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
    except (RuntimeError, NotImplementedError, ValueError):
        return None
