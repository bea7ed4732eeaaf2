"""Memory of one training step at full size without the hardware (docs/design.md §9).

:func:`simulate_step` runs the trainer's own step, :class:`~loongtrain.train.trainer.Trainer` (model build,
parallelisation, optimizer), its ``loss`` (forward and chunked loss), backward, the dp gradient
all-reduce and the AdamW step, for the real shapes under torch's ``FakeTensorMode`` (tensors with shapes,
dtypes and storages but no data), with torch's fake process-group backend standing in for the other
ranks (``torch.testing._internal.distributed.fake_pg``: every collective returns at once; this process is
one rank of ``world``). torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) follows every
storage the step creates and frees and reports the peak.

What is simulated, exactly:

- **The device is a fake CPU.** This CPU build of torch cannot move tensors to a fake CUDA device
  (``.to("cuda")`` fails), and FSDP2 on a CUDA mesh needs CUDA streams. So the step runs the CPU code
  paths: attention through the ``cpu_flash`` kernel (``_scaled_dot_product_flash_attention_for_cpu``,
  which keeps the same output and fp32 log-sum-exp as the CUDA flash kernels), FSDP2 without its
  all-gather stream (so at most the block in use is gathered, not also the prefetched one: one block's
  compute-dtype weights less than on CUDA), no CUDA caching-allocator rounding (512 B per block) or
  fragmentation, no CUDA context or NCCL buffers. The compute dtype is given (``bf16`` as on an H200).
- **Steady state.** The AdamW states exist before the tracked step (as from the second step on): the
  gradients are set to zeros and one optimizer step runs untracked first.
- **Left out:** gradient clipping (its norm is read back with ``float()``, which fake tensors cannot
  give; it adds one fp32 scalar per parameter) and the skip test on a non-finite loss. Ranks do not
  exchange their arguments (``loongtrain.parallel.agreement``: the fake backend returns no data).
- **Host memory** is what lies outside the device: with the offload modes, the trainer's host buffers.
  On a fake CPU both sit on one device type; :func:`simulate_step` reports ``host_bytes`` from the
  trainer's offload buffers once the offload code reports them (the modes are refused until then,
  see :data:`TRAINER_LACKS`).

A Hugging Face model directory is simulated as loongtrain's decoder of the same shape (its
:class:`~loongtrain.model.config.ModelConfig`), which is what the planner models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.model.config import ModelConfig
from loongtrain.parallel import agreement
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import destroy_all_meshes, init_mesh
from loongtrain.train import parallelize as parallelize_module
from loongtrain.train.config import Run, TrainConfig
from loongtrain.train.sync import all_reduce_gradients
from loongtrain.train.trainer import Trainer

log = logging.getLogger("loongtrain.train")

#: ParallelConfig modes the simulation refuses, with their "off" value: on a fake CPU device the trainer's
#: host buffers and its device tensors share one device type, so MemTracker cannot tell them apart (drop an
#: entry once the offload code reports the bytes it holds on the host; nothing else here changes)
TRAINER_LACKS = {"offload_activations": False, "mlp_tiles": "1", "offload_params": False}


@dataclasses.dataclass
class Simulated:
    """One rank's step: ``peak_bytes`` of the device, ``host_bytes`` (offload buffers), and the peak's
    parts by MemTracker kind (parameters, gradients, activations, temporaries, optimizer states)."""

    peak_bytes: int
    host_bytes: int
    parts: dict[str, int]
    rank: int
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"simulated_device_gib": self.peak_bytes / 2**30, "simulated_host_gib": self.host_bytes / 2**30,
                "simulated_parts_gib": {k: v / 2**30 for k, v in self.parts.items()}, "rank": self.rank,
                "world_size": self.world_size}


def check_simulable(parallel: ParallelConfig) -> None:
    """ValueError naming the first mode of ``parallel`` the trainer cannot run yet (:data:`TRAINER_LACKS`)."""
    for name, off in TRAINER_LACKS.items():
        if getattr(parallel, name) != off:
            raise ValueError(f"--simulate: {name}={getattr(parallel, name)!r} cannot be simulated yet (device and "
                             f"host memory are one fake CPU device); plan with --modes off, or without that mode")


@contextlib.contextmanager
def _noop_to_is_identity() -> Iterator[None]:
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
    meshes = dict(parallelize_module._DEVICE_MESHES)
    try:
        yield
    finally:
        agreement.check_agreement = check
        parallelize_module._DEVICE_MESHES.clear()
        parallelize_module._DEVICE_MESHES.update(meshes)
        destroy_all_meshes()
        dist.destroy_process_group()


def _batch(model: ModelConfig, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.vocab_size, (batch, seq_len))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq_len).expand(batch, seq_len)}


def tracked_step(trainer: Trainer, batch: dict[str, torch.Tensor]) -> tuple[int, dict[str, int]]:
    """The trainer's step (loss, backward, dp gradient sync, AdamW) under MemTracker, with the optimizer
    states already allocated: ``(peak bytes, parts at the peak)`` on the trainer's device."""
    from torch.distributed._tools.mem_tracker import MemTracker

    for p in trainer.model.parameters():  # steady state: AdamW's m and v exist before the step
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    with tracker:
        loss, _ = trainer.loss(batch)
        loss.backward()
        if trainer.grad_sync:
            all_reduce_gradients(trainer.params, trainer.mesh.dp)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    snapshot = tracker.get_tracker_snapshot("peak")
    device = next(d for d in snapshot if d.type == trainer.device.type)
    parts = {str(getattr(k, "value", k)).lower(): int(v) for k, v in snapshot[device].items()}
    return parts.pop("total"), parts


def simulate_step(model: ModelConfig, parallel: ParallelConfig, world: int, *, seq_len: int, batch: int = 1,
                  dtype: str = "bf16", rank: int = 0, fake: bool = True) -> Simulated:
    """One rank's peak device memory for one step of ``model`` with ``parallel`` on ``world`` ranks
    (module docstring). ``fake=False`` runs the same step on real CPU tensors (small sizes: what the
    simulation is checked against)."""
    check_simulable(parallel)
    cfg = TrainConfig(model="tiny", seq_len=seq_len, batch_size=batch, dtype=dtype, parallel=parallel,
                      memory_report=False)
    cfg.validate()
    device = torch.device("cpu")
    with fake_ranks(world, rank) if world > 1 else contextlib.nullcontext():
        mesh = init_mesh(parallel.hp, parallel.cp, window=parallel.window, placement=parallel.placement,
                         interleaved=parallel.interleaved)
        if world > 1 and parallel.zero != "none":  # collective set-up outside the fake tensors
            parallelize_module.fsdp_device_mesh(device, world, parallel.shard_size(world))
        modes = (torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) if fake
                 else contextlib.nullcontext())
        with modes, _noop_to_is_identity():
            # cfg.model names a preset: the native decoder of `model`; the batches are made here, not read
            trainer = Trainer(Run(cfg, model), mesh, device, batches=lambda *args: iter(()))
            peak, parts = tracked_step(trainer, _batch(model, seq_len, batch))
    return Simulated(peak, 0, parts, rank, world)


def simulate_candidate(model: ModelConfig, candidate: Any, plan_cfg: Any) -> dict[str, Any]:
    """``loongtrain plan --simulate``: :func:`simulate_step` for a planner candidate at the request's length,
    batch and dtype (``candidate``: :class:`loongtrain.plan.cost.Candidate`, ``plan_cfg``:
    :class:`loongtrain.plan.options.PlanConfig`)."""
    dtypes = {"bf16": "bf16", "fp32": "fp32"}
    if plan_cfg.dtype not in dtypes:
        raise ValueError(f"--simulate: dtype={plan_cfg.dtype!r} is not one the trainer runs; use {sorted(dtypes)}")
    result = simulate_step(model, candidate.config, candidate.world_size, seq_len=plan_cfg.seq_len,
                           batch=plan_cfg.batch_size, dtype=dtypes[plan_cfg.dtype])
    return result.to_dict()
