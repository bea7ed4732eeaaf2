"""Activation offload: what recomputed blocks keep for backward lives on the host (docs/memory.md).

``--offload-activations`` moves the tensors a recomputed block keeps between its forward and its
backward to host memory (pinned when the machine supports it), and brings each block's back one block
ahead of its backward:

- **what moves**: the block's checkpointed inputs that require grad (the hidden states entering the
  block; torch's checkpoint saves them through :func:`torch.autograd.graph.saved_tensors_hooks`, which
  :meth:`ActivationOffloader.block` installs around the block) and, under selective recompute, the
  outputs of the attention ops the policy saves (torch keeps those in the selective-checkpoint cache,
  not through the hooks: :meth:`ActivationOffloader.selective_contexts` gives that cache a storage
  whose tensors live on the host). Tensors that need no grad (RoPE tables, masks: shared by every
  block) and parameters stay where they are, by reference.
- **when**: each copy is queued (on CUDA on a side stream that first waits for the compute stream; the
  device tensor is handed to the caching allocator with ``record_stream``) when the tensor is saved, i.e.
  during the block's forward; the device copy is freed as soon as the copy ends and the forward drops it.
  Block ``i``'s forward starts only once block ``i - 2``'s copies have finished (a host-side wait that
  costs nothing while the copies keep up), so at most two blocks' copies are in flight.
- **back**: the backward of block ``i`` starts by unpacking its first saved tensor; that fetches block
  ``i``'s tensors (waiting only if their prefetch has not finished). Block ``i - 1``'s copy starts on the
  side stream late in block ``i``'s backward, once the gradient of block ``i``'s query projection exists
  (a gradient hook on its output, :func:`prefetch_point`): after the MLP's and the attention kernel's
  backward, the two moments of a block's peak, overlapping the q/k/v projections' and the norm's backward.
  A block without a query projection that :data:`~loongtrain.parallelize.norm_linear.NORM_AND_PROJECTIONS`
  names starts the copy when its own tensors are fetched, overlapping its whole recompute and backward.
  Device memory thus holds at most two blocks' offloaded tensors whatever the depth
  (:attr:`ActivationOffloader.peak_device_bytes`), and at a block's peak one.

Without a GPU the same code runs: the host copy is a distinct CPU tensor (no stream), and the "device"
copy brought back is another one, so tests count what stays on the device. Host copies are allocated
inside :func:`host_allocations`, so a memory tracker can tell them from device memory on a CPU (the
full-size simulation, docs/planner.md). On a machine without pinned memory a warning is logged once and
pageable memory is used.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from loongtrain.parallelize.norm_linear import NORM_AND_PROJECTIONS

log = logging.getLogger("loongtrain.train")

Tensor = torch.Tensor


@functools.cache
def pinned_memory_available() -> bool:
    """Whether this machine can allocate pinned host memory; logs a warning (once per process) if not."""
    try:
        torch.empty(1, pin_memory=True)
        return True
    except RuntimeError as exc:
        log.warning("pinned host memory is not available here (%s): offloading to pageable host memory "
                    "(slower host<->device copies on GPUs)", str(exc).splitlines()[0])
        return False


_HOST_ALLOCATIONS = threading.local()


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Marks the tensors allocated inside as host memory: the offload code's host buffers (here), the
    host-side optimizer step of ``--offload-params``. A memory tracker that must tell host from device
    where both are the CPU (the simulation, ``launch/simulate/``) reads :func:`allocating_on_host`."""
    _HOST_ALLOCATIONS.depth = getattr(_HOST_ALLOCATIONS, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST_ALLOCATIONS.depth -= 1


def allocating_on_host() -> bool:
    """Whether this thread is inside :func:`host_allocations`."""
    return getattr(_HOST_ALLOCATIONS, "depth", 0) > 0


class _Saved:
    """One offloaded tensor: its host copy and, between a fetch and its unpack, its device copy."""

    __slots__ = ("__weakref__", "device_copy", "fetched", "host", "stash")

    def __init__(self, host: Tensor, stash: _Stash) -> None:
        self.host, self.stash = host, stash
        self.device_copy: Tensor | None = None
        self.fetched = False  # a device copy was made (it may since have been handed to autograd)


class _Stash:
    """The tensors one block offloaded in one forward, and the stash of the block that ran before it."""

    __slots__ = ("copy_event", "deferred", "event", "index", "items", "prev")

    def __init__(self, index: int, prev: _Stash | None) -> None:
        self.index, self.prev = index, prev
        self.deferred = False  # the previous block's prefetch waits for this block's prefetch point
        self.items: list[weakref.ref[_Saved]] = []  # autograd's handles own them: freed with the graph
        self.event: Any = None  # CUDA event: this stash's fetch has been queued up to here
        self.copy_event: Any = None  # CUDA event: its copies to the host have been queued up to here


class ActivationOffloader:
    """Moves recomputed blocks' saved tensors to the host and back, one block ahead (module docstring).

    Counters (bytes): ``offloaded_bytes`` (copied to the host, total), ``host_bytes`` / ``peak_host_bytes``
    (live host copies) and ``device_bytes`` / ``peak_device_bytes`` (live device copies brought back).
    ``on_kept(t)`` is called for each saved tensor left on the device (by reference).
    """

    def __init__(self, device: torch.device, on_kept: Callable[[Tensor], None] | None = None) -> None:
        self.device = torch.device(device)
        self.on_kept = on_kept  # told of each saved tensor left on the device (the memory report counts it)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pin = pinned_memory_available() and cuda
        self._last: _Stash | None = None
        self._active: _Stash | None = None  # the stash of the block whose (first) forward is running
        self.offloaded_bytes = self.host_bytes = self.peak_host_bytes = 0
        self.device_bytes = self.peak_device_bytes = 0

    # ----------------------------------------------------------------------------------------------
    # forward: to the host

    @contextlib.contextmanager
    def block(self, index: int) -> Iterator[_Stash]:
        """Run block ``index``'s forward with its saved tensors offloaded (blocks enter in forward order)."""
        last = self._last
        stash = _Stash(index, last if last is not None and last.index < index else None)
        self._last = stash
        older = stash.prev.prev if stash.prev is not None else None
        if older is not None and older.copy_event is not None:
            older.copy_event.synchronize()  # at most two blocks' copies in flight: their device memory is bounded
        self._active = stash
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, stash), self._unpack):
                yield stash
        finally:
            self._active = None

    def defer_prefetch(self, output: Any) -> None:
        """Called with the output of the block's prefetch point during its first forward: the previous block's
        prefetch starts when ``output``'s gradient is computed, not when this block's tensors are fetched."""
        stash = self._active
        if stash is None or stash.prev is None or not isinstance(output, Tensor) or not output.requires_grad:
            return  # a recompute, the first block, or nothing to hook
        stash.deferred = True
        prev = stash.prev

        def prefetch(grad: Tensor) -> None:
            self._fetch(prev)

        output.register_hook(prefetch)

    def _pack(self, stash: _Stash, t: Tensor) -> Any:
        if not t.requires_grad or isinstance(t, nn.Parameter):
            if self.on_kept is not None:
                self.on_kept(t)
            return t  # shared inputs that need no grad (RoPE tables, masks) and weights stay
        return self.offload(stash, t)

    def offload(self, stash: _Stash, t: Tensor) -> _Saved:
        """Queue the copy of ``t`` to a new host tensor; the handle that brings it back."""
        with host_allocations():
            host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(self.stream)
            stash.copy_event = self.stream.record_event()
        else:
            host.copy_(t.detach())
        saved = _Saved(host, stash)
        stash.items.append(weakref.ref(saved))
        nbytes = host.numel() * host.element_size()
        self.offloaded_bytes += nbytes
        self._count("host_bytes", host, nbytes)
        return saved

    # ----------------------------------------------------------------------------------------------
    # backward: back to the device, one block ahead

    def _unpack(self, packed: Any) -> Any:
        return self.restore(packed) if isinstance(packed, _Saved) else packed

    def restore(self, saved: _Saved) -> Tensor:
        """The device tensor of ``saved``: fetch its block (if not prefetched), prefetch the previous one."""
        stash = saved.stash
        self._fetch(stash)
        if stash.prev is not None and not stash.deferred:
            self._fetch(stash.prev)
        if saved.device_copy is None:  # unpacked a second time (retain_graph): fetch it again
            self._fetch_one(saved)
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(stash.event)
            saved.device_copy.record_stream(current)
        out, saved.device_copy = saved.device_copy, None
        return out

    def _fetch(self, stash: _Stash) -> None:
        for ref in stash.items:
            saved = ref()
            if saved is not None and not saved.fetched:
                self._fetch_one(saved)

    def _fetch_one(self, saved: _Saved) -> None:
        if self.stream is None:
            dev = saved.host.to(self.device, copy=True)
        else:
            with torch.cuda.stream(self.stream):
                dev = saved.host.to(self.device, non_blocking=True)
            saved.stash.event = self.stream.record_event()
        saved.device_copy, saved.fetched = dev, True
        self._count("device_bytes", dev, dev.numel() * dev.element_size())

    def _count(self, name: str, t: Tensor, nbytes: int) -> None:
        setattr(self, name, getattr(self, name) + nbytes)
        peak = f"peak_{name}"
        setattr(self, peak, max(getattr(self, peak), getattr(self, name)))
        weakref.finalize(t, self._uncount, name, nbytes)

    def _uncount(self, name: str, nbytes: int) -> None:
        setattr(self, name, getattr(self, name) - nbytes)

    def reset_peaks(self) -> None:
        """Start the peak counters afresh (from what is live now)."""
        self.peak_host_bytes, self.peak_device_bytes = self.host_bytes, self.device_bytes

    # ----------------------------------------------------------------------------------------------
    # selective recompute's cache

    def selective_contexts(self, policy: Callable[..., Any]) -> tuple[Any, Any]:
        """``context_fn`` result for ``torch.utils.checkpoint``: selective checkpointing under ``policy``
        whose cached op outputs are offloaded into the current block's stash (call inside :meth:`block`)."""
        caching, cached = create_selective_checkpoint_contexts(policy)
        if not (hasattr(caching, "storage") and hasattr(cached, "storage")):
            raise RuntimeError(f"torch {torch.__version__}: selective checkpointing keeps no 'storage' that "
                               "activation offload can move; run without --offload-activations")
        assert self._last is not None, "selective_contexts() must be called inside block()"
        caching.storage = cached.storage = _OffloadedCache(self, self._last)
        return caching, cached


class _OffloadedCache(defaultdict):
    """Selective checkpointing's cache (op -> {call index -> saved outputs}) with its tensors on the host.

    torch wraps each cached tensor in an object with ``val`` and ``version`` (its mutation check); the
    tensor is replaced by a host handle when cached and restored when the recompute reads it.
    """

    def __init__(self, offloader: ActivationOffloader, stash: _Stash) -> None:
        super().__init__(lambda: _OffloadedEntries(offloader, stash))


class _OffloadedEntries(dict):
    def __init__(self, offloader: ActivationOffloader, stash: _Stash) -> None:
        super().__init__()
        self.offloader, self.stash = offloader, stash

    def _to_host(self, wrapper: Any) -> Any:
        if isinstance(getattr(wrapper, "val", None), Tensor):
            wrapper.val = self.offloader.offload(self.stash, wrapper.val)
        return wrapper

    def _to_device(self, wrapper: Any) -> Any:
        if isinstance(getattr(wrapper, "val", None), _Saved):
            wrapper.val = self.offloader.restore(wrapper.val)
            wrapper.version = wrapper.val._version  # a fresh copy: nothing has mutated it
        return wrapper

    def __setitem__(self, index: int, entry: Any) -> None:
        super().__setitem__(index, tree_map(self._to_host, entry))

    def get(self, index: int, default: Any = None) -> Any:
        entry = super().get(index, default)
        return tree_map(self._to_device, entry)


def offload_blocks(layers: nn.ModuleList, indices: list[int], offloader: ActivationOffloader) -> None:
    """Run the (already checkpointed) blocks ``indices`` of ``layers`` inside ``offloader.block(i)``.

    The block's ``forward`` is replaced on the instance, as checkpointing does (names unchanged).
    """
    for i in indices:
        block = layers[i]
        block.forward = functools.partial(_offloaded_forward, offloader, i, block.forward)
        point = prefetch_point(block)
        if point is not None:
            point.register_forward_hook(lambda module, args, output: offloader.defer_prefetch(output))


def offloaded_blocks(checkpointed: list[int], keep: int) -> list[int]:
    """The recomputed blocks that offload: all but the last ``keep`` (``--offload-keep``: they run backward
    first, so what they keep on the device is freed first). ValueError when ``keep`` leaves none."""
    if keep and keep >= len(checkpointed):
        raise ValueError(f"--offload-keep {keep} keeps every one of the {len(checkpointed)} recomputed blocks on "
                         f"the device: nothing is offloaded; use at most {max(0, len(checkpointed) - 1)}")
    return checkpointed[:len(checkpointed) - keep]


def prefetch_point(block: nn.Module) -> nn.Module | None:
    """The block's query projection (:data:`~loongtrain.parallelize.norm_linear.NORM_AND_PROJECTIONS`), whose
    output's gradient starts the previous block's prefetch (module docstring); None if it has none."""
    for _, attn_name, namings in NORM_AND_PROJECTIONS:
        for names in namings:
            query = getattr(getattr(block, attn_name, None), names[0], None)
            if isinstance(query, nn.Module):
                return query
    return None


def _offloaded_forward(offloader: ActivationOffloader, index: int, forward: Callable[..., Any],
                       *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with offloader.block(index):
        return forward(*args, **kwargs)


OFFLOADER_ATTR = "_loongtrain_activation_offloader"


def activation_offloader(model: nn.Module) -> ActivationOffloader | None:
    """The :class:`ActivationOffloader` that ``parallelize`` attached to ``model`` (None: no offload)."""
    return model.__dict__.get(OFFLOADER_ATTR)
