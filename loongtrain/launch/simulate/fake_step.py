"""What a simulated training step runs under (docs/planner.md, :mod:`loongtrain.launch.simulate`): torch's fake
process group as the other ranks (:func:`fake_ranks`), the attention op's own workspace held around each ring
backward (:func:`attention_workspace`), the alike passes of its loops (:func:`alike_loops`), module
moves that change nothing (:func:`noop_to_is_identity`), and the memory tracker that counts host memory apart
and keeps each phase's peak (:class:`HostAwareTracker`)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from loongtrain.parallel import agreement
from loongtrain.parallel.mesh import destroy_all_meshes
from loongtrain.parallelize import zero as zero_module
from loongtrain.parallelize.offload import allocating_on_host

#: MemTracker's key for host memory (the offload modes' host buffers, beside the fake CPU "device")
HOST = "host"
_BLOCK = re.compile(r"\.layers\.(\d+)$")


class _NoHook:
    """The handle of a hook that was never registered."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class HostAwareTracker(MemTracker):
    """torch's MemTracker with host memory under its own key (:data:`HOST`) beside the (CPU) device's:
    storages allocated inside :func:`loongtrain.parallelize.offload.host_allocations`, and those moved with
    :meth:`to_host` (FSDP2's host shards and their gradients under ``CPUOffloadPolicy``). Each key has its
    own peak, so the device's peak is not inflated by what lives on the host, nor the host's by the device.
    ``phases`` keeps each phase's peaks too (:meth:`phase`), keyed ``(phase, device)``."""

    def __init__(self, num_layers: int = 0) -> None:
        super().__init__()
        self.num_layers, self.stage = num_layers, ""
        self.phases: dict[tuple[str, Any], tuple[int, dict[Any, int]]] = {}

    def __enter__(self) -> HostAwareTracker:
        super().__enter__()  # the peaks start afresh here (what to_host counted before is not a phase's)
        self.phases = {}
        return self

    def phase(self) -> str:
        """``stage`` when set (the optimizer step), else forward or backward (``fw``/``bw``) of the first block,
        the last, one between or none (``first``, ``last``, ``mid``, ``out``)."""
        if self.stage:
            return self.stage
        blocks = [int(m.group(1)) for name in self._mod_tracker.parents if (m := _BLOCK.search(name))]
        block = max(blocks, default=-1)
        where = ("out" if block < 0 else "first" if block == 0 else "last" if block == self.num_layers - 1
                 else "mid")
        return ("bw-" if self._mod_tracker.is_bw else "fw-") + where

    def _update_peak_stats(self, peak_state: Any) -> None:
        """The per-device and per-phase peaks only: MemTracker also keeps each active module's peak, a walk over
        every tracked module after every op (most of a full-size step's time), which nothing here reads."""
        phase = self.phase()
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap[_TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)
            key = (phase, dev)
            if self.phases.get(key, (-1,))[0] < total:
                self.phases[key] = (total, dict(dev_snap))

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        """MemTracker's, for frozen parameters too (``--lora``'s base): they get no gradient, and torch refuses
        gradient hooks on them, so they are marked as hooked already (with handles that remove nothing)."""
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        if module is None or module in self.memory_tracking:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        """MemTracker's, skipping a module whose statistics were reset after a phase of its own: ModTracker calls
        the post-backward hook, at the next backward, of every module whose forward ran without a graph (an
        engine's in phase ``rollout``), and only the device's and the phases' peaks are read here."""
        if module is None or module in self.memory_tracking:
            super()._post_bw_hook(module, args)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        super()._track(reftype, t)
        if allocating_on_host():
            self.to_host(t)

    def to_host(self, t: torch.Tensor) -> None:
        """Count ``t``'s storages as host memory from now on (created, if not yet tracked)."""
        from torch.distributed._tools.common_utils import get_untyped_storages
        from torch.distributed._tools.mem_tracker import _ModState, _UpdateType

        for st in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(st, (None, None))
            if winfo is None:
                self._update_and_maybe_create_winfos(t, _MemRefType.OTH)
                winfo, _ = self._WINFO[st]
            if winfo.device == HOST:
                continue
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.DEL, winfo)
            winfo.device = HOST
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.ADD, winfo)
        self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)


@contextlib.contextmanager
def noop_to_is_identity() -> Iterator[None]:
    """``module.to(device, dtype)`` returns the module when every parameter already has that device and
    dtype. Under FakeTensorMode a no-op move would otherwise swap each fake parameter, which torch refuses."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or p.device == device) and (dtype is None or p.dtype == dtype)
               for p in self.parameters()):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_ranks(world: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on torch's fake backend (collectives return at once),
    without the cross-rank argument checks (the fake backend returns no data); everything undone after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("simulate: a torch.distributed process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    check = agreement.check_agreement
    agreement.check_agreement = lambda *args, **kwargs: None
    meshes = dict(zero_module._DEVICE_MESHES)
    try:
        yield
    finally:
        agreement.check_agreement = check
        zero_module._DEVICE_MESHES.clear()
        zero_module._DEVICE_MESHES.update(meshes)
        destroy_all_meshes()
        dist.destroy_process_group()


@contextlib.contextmanager
def attention_workspace(kernels: tuple[str, ...] = ()) -> Iterator[None]:
    """Count the attention op's own workspace. MemTracker sees a custom op's inputs and results, not what its
    implementation allocates inside (the ring's K/V blocks and fp32 accumulators), and under fake tensors the
    op runs its fake implementation anyway; so each ring backward call holds, while it runs, one buffer of
    :func:`loongtrain.attn.ring.backward_workspace_bytes` (that description is measured against the ring
    code itself: tests/unit/test_ring_workspace.py) and of the largest backward scratch of the CUDA
    ``kernels`` the planned device may pick (:func:`loongtrain.attn.cuda_kernels.backward_scratch_bytes` of
    the call's heads-layout shape; the simulated device is a fake CPU, which runs none of them)."""
    from loongtrain.attn import ops
    from loongtrain.attn.cuda_kernels import largest_backward_scratch
    from loongtrain.attn.ring import backward_workspace_bytes

    original = ops.ring_attention_backward

    def with_workspace(dout, q, k, v, out, lse, ring, *args):
        b, s, h, d = q.shape
        nbytes = backward_workspace_bytes(b * s, h, k.shape[2], d, q.element_size(), len(ops._RINGS[ring].ranks),
                                          v_head_dim=v.shape[3])
        # a V head dim of its own (MLA) runs the kernels on the wider one, padded
        nbytes += largest_backward_scratch(kernels, b, h, k.shape[2], s, s, max(d, v.shape[3]), q.element_size())
        workspace = torch.empty(int(nbytes), dtype=torch.uint8, device=q.device)
        try:
            return original(dout, q, k, v, out, lse, ring, *args)
        finally:
            del workspace

    ops.ring_attention_backward = with_workspace
    try:
        yield
    finally:
        ops.ring_attention_backward = original


@contextlib.contextmanager
def alike_loops() -> Iterator[None]:
    """Run only the first two and the last pass of the step's loops whose passes are alike: the chunked loss's
    chunks (``loss/chunked.py``), a tiled MLP's tiles (``parallelize/mlp_tiles.py``) and the norms' and RoPE's
    row chunks
    (``model/rms_norm.py``, ``model/rope.py``). Each pass frees its working set before the next and writes its
    result into a tensor allocated for all passes first (the gradients of weights are sums), so the peak is the
    same with a fraction of the ops (at the Llama-3-8B shape and 2M tokens: 3 of 3943 loss chunks, of 504 tiles
    and of 252 norm chunks)."""
    from loongtrain.loss import chunked
    from loongtrain.model import rms_norm, rope
    from loongtrain.parallelize import mlp_tiles

    def alike(spans: list) -> list:
        return spans if len(spans) <= 3 else spans[:2] + spans[-1:]

    patches = [(chunked, "_chunks", lambda original: lambda *a: iter(alike(list(original(*a))))),
               (mlp_tiles, "tile_bounds", lambda original: lambda *a: alike(original(*a))),
               (rms_norm, "_row_chunks", lambda original: lambda *a: alike(original(*a))),
               (rope, "row_chunks", lambda original: lambda *a: alike(original(*a)))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, make in patches:
        setattr(module, name, make(getattr(module, name)))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
