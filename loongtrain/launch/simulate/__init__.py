"""Memory of one training step at full size without the hardware (docs/planner.md).

:func:`simulate_step` runs the trainer's own step, :class:`~loongtrain.train.trainer.Trainer` (model build,
parallelisation, optimizer), its objective's loss (forward and chunked loss), backward, the dp gradient
all-reduce and the AdamW step, for the real shapes under torch's ``FakeTensorMode`` (tensors with shapes,
dtypes and storages but no data), with torch's fake process-group backend standing in for the other
ranks (``torch.testing._internal.distributed.fake_pg``: every collective returns at once; this process is
one rank of ``world``). torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) follows every
storage the step creates and frees and reports the peak.

What is simulated, exactly:

- **The device is a fake CPU.** This CPU build of torch cannot move tensors to a fake CUDA device
  (``.to("cuda")`` fails), and FSDP2 on a CUDA mesh needs CUDA streams. So the step runs the CPU code
  paths: attention is loongtrain's ring custom op (``loongtrain::ring_attention`` and its backward),
  which under fake tensors runs its registered fake implementation, so its inputs and outputs are counted
  (out, the fp32 log-sum-exp, dQ and the packed dK/dV) but no kernel's own workspace (on CUDA, FA2's
  backward also holds an fp32 dQ accumulator and, with GQA, dK/dV expanded to the query heads:
  docs/planner.md), FSDP2 without its
  all-gather stream (so at most the block in use is gathered, not also the prefetched one: one block's
  compute-dtype weights less than on CUDA), no CUDA caching-allocator rounding (512 B per block) or
  fragmentation, no CUDA context or NCCL buffers. The compute dtype is given (``bf16`` as on an H200).
- **Steady state.** The AdamW states exist before the tracked step (as from the second step on): the
  gradients are set to zeros and one optimizer step runs untracked first.
- **Left out:** gradient clipping (its norm is read back with ``float()``, which fake tensors cannot
  give; it adds one fp32 scalar per parameter) and the skip test on a non-finite loss. Ranks do not
  exchange their arguments (``loongtrain.parallel.agreement``: the fake backend returns no data).
- **Host memory is counted apart from the device's** (:class:`HostAwareTracker`: MemTracker with a second
  key, :data:`HOST`, each key with its own peak). Device and host are both the CPU here, so what is host
  memory is told by the code that puts it there: the activation offloader allocates its host copies
  inside :func:`loongtrain.parallelize.offload.host_allocations`; with ``offload_params`` (FSDP2's
  ``CPUOffloadPolicy``) the sharded parameters and AdamW's states are host memory from the start, each
  gradient shard from the moment FSDP2 hands it to the parameter (on a GPU it is copied to the host and
  the device buffer freed there; on the CPU device the reduce-scatter's output becomes the gradient,
  and is moved to the host's count at that moment), and whatever the AdamW step allocates (it runs on
  the host). The modes as simulated:

  - ``offload_activations``: exact on the device side in backward (the block being recomputed and, late
    in its backward, the one prefetched, as on a GPU); in forward the copy is synchronous, so a block's
    saved input is freed on the device as soon as the next block no longer needs it (a GPU's side stream
    keeps up to two blocks' copies in flight: not more than in backward, where the peak is).
  - ``mlp_tiles``: nothing on the host; the same tiles as on a GPU.
  - ``offload_params``: a GPU also holds, for each block being gathered, its fp32 shard copied to the
    device before the cast to the compute dtype (``4 * P_l / z`` bytes, transient); the CPU device casts
    the host shard in place, so this is not counted.

  ``fake=False`` runs the same step on real CPU tensors counted the same way (tests/unit/test_simulate.py:
  device and host within 5%, measured equal to the byte; host bytes against the offloaded block inputs
  and the 16 bytes per parameter of the offloaded states).

A Hugging Face model directory is simulated as loongtrain's decoder of the same shape (its
:class:`~loongtrain.model.config.ModelConfig`), which is what the planner models.

**By depth** (:func:`simulate_by_depth`, what ``loongtrain plan --simulate`` runs): the blocks are alike, so
each phase of the step (a block's forward or backward, for the first, the last and the blocks between, the
rest of the forward and backward, the optimizer step) peaks at ``a + b * L`` for ``L`` blocks. The step is
simulated at two small depths (:data:`DEPTHS`, past the blocks ``offload_keep`` keeps and the dense first layers of
an MoE model: :func:`~loongtrain.model.config.with_depth`) and each phase's peak
(device and host, and its parts) extended linearly to the model's depth; the largest is the step's. The
loops whose passes are alike (loss chunks, MLP tiles, norm and RoPE chunks) run their first two passes and
their last (:func:`~loongtrain.launch.simulate.fake_step.alike_loops`). Equal to the whole simulation within 1%
(tests/unit/test_simulate.py, every memory mode), at a fraction of its time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.launch.simulate.fake_step import (  # noqa: F401 - fake_ranks and HostAwareTracker are this module's API too
    HOST,
    HostAwareTracker,
    alike_loops,
    attention_workspace,
    fake_ranks,
    noop_to_is_identity,
)
from loongtrain.model.config import ModelConfig, dense_prefix, with_depth
from loongtrain.model.llama import MoEFeedForward
from loongtrain.objectives.registry import objective_spec
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import init_mesh
from loongtrain.parallelize import zero as zero_module
from loongtrain.parallelize.offload import host_allocations
from loongtrain.plan.cluster import load_cluster
from loongtrain.train.batch import Batch
from loongtrain.train.objective import Objective
from loongtrain.train.step_context import StepContext
from loongtrain.train.sync import GradientSync
from loongtrain.train.trainer import Trainer

log = logging.getLogger("loongtrain.train")

#: the two depths :func:`simulate_by_depth` simulates (beyond the blocks ``offload_keep`` keeps on the device)
DEPTHS = (3, 4)


@dataclasses.dataclass
class Simulated:
    """One rank's step: ``peak_bytes`` of the device, ``host_bytes`` (the host's own peak: offload buffers,
    host-resident shards and the host AdamW step), and each peak's parts by MemTracker kind (parameters,
    gradients, activations, temporaries, optimizer states)."""

    peak_bytes: int
    host_bytes: int
    parts: dict[str, int]
    rank: int
    world_size: int
    host_parts: dict[str, int] = dataclasses.field(default_factory=dict)
    #: phase -> (device or host: ``(peak bytes, its parts)``) of :class:`HostAwareTracker`
    phases: dict[tuple[str, bool], tuple[int, dict[str, int]]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"simulated_device_gib": self.peak_bytes / 2**30, "simulated_host_gib": self.host_bytes / 2**30,
                "simulated_parts_gib": {k: v / 2**30 for k, v in self.parts.items()},
                "simulated_host_parts_gib": {k: v / 2**30 for k, v in self.host_parts.items()}, "rank": self.rank,
                "world_size": self.world_size}


@dataclasses.dataclass
class SimulatedStep:
    """What :func:`tracked_step` runs: the step context, its optimizer and gradient sync, the micro-batch's
    ``loss_fn`` (``() -> (loss, value)``, the objective's), the objective's ``phases`` (by name, each a callable:
    DPO's ``reference`` pass, GRPO's ``rollout``), before the step or, ``phases_with_gradients``, after it with its
    gradients still held (phases between steps: GRPO's), and the models it keeps ``resident`` beside the policy
    (GRPO's reference and engine), counted from the start."""

    ctx: StepContext
    optimizer: torch.optim.Optimizer
    grad_sync: GradientSync | None
    loss_fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    phases: dict[str, Callable[[], None]] = dataclasses.field(default_factory=dict)
    resident: tuple[torch.nn.Module, ...] = ()
    phases_with_gradients: bool = False


def _parts(snapshot: dict[Any, dict[Any, int]], key: Any) -> dict[str, int]:
    return {str(getattr(k, "value", k)).lower(): int(v) for k, v in snapshot.get(key, {}).items()}


def tracked_step(step: SimulatedStep, offload_params: bool = False,
                 ) -> tuple[int, dict[str, int], int, dict[str, int], dict[tuple[str, bool], tuple[int, dict]]]:
    """The trainer's step (loss, backward, dp gradient sync, AdamW) under :class:`HostAwareTracker`, with
    the optimizer states already allocated: ``(device peak bytes, its parts, host peak bytes, its parts,
    each phase's peaks)``.

    Host memory: the activation offloader's host copies (allocated inside ``host_allocations``) and, with
    ``offload_params`` (FSDP2's ``CPUOffloadPolicy``), the sharded parameters, AdamW's states, each
    gradient shard once FSDP2 hands it over (on a GPU: copied to the host, the device buffer freed), and
    everything the AdamW step allocates (it runs on the host). The objective's phases are tracked first, each as a
    phase of its name (with the AdamW states already allocated: a resumed run's)."""
    model, optimizer = step.ctx.model, step.optimizer
    for p in model.parameters():  # steady state: AdamW's m and v exist before the step
        if p.requires_grad:  # (--lora: the adapters only)
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracker = HostAwareTracker(step.ctx.model_config.num_layers)
    # the resident models' tensors only: MemTracker's per-module statistics (which nothing here reads) would follow
    # the engine's modules into a backward they have no part in
    tracker.track_external(model, optimizer, *(t for m in step.resident for t in (*m.parameters(), *m.buffers())))
    hooks = []
    if offload_params:
        for p in model.parameters():
            tracker.to_host(p)
            if p.requires_grad:  # (--lora: a frozen base has no gradient)
                hooks.append(p.register_post_accumulate_grad_hook(lambda p: tracker.to_host(p.grad)))
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.to_host(value)
    try:
        with tracker, warnings.catch_warnings():
            # a phase's model is gone before the backward, whose hooks then skip it (one warning each)
            warnings.filterwarnings("ignore", message="Module is None. Skipping")
            if not step.phases_with_gradients:
                _run_phases(tracker, step.phases)
            loss, _ = step.loss_fn()
            with step.grad_sync.overlapped() if step.grad_sync else contextlib.nullcontext():
                loss.backward()
            tracker.stage = "optimizer"
            with host_allocations() if offload_params else contextlib.nullcontext():
                optimizer.step()
            tracker.stage = ""
            if step.phases_with_gradients:
                _run_phases(tracker, step.phases)
            optimizer.zero_grad(set_to_none=True)
    finally:
        for hook in hooks:
            hook.remove()
    snapshot = tracker.get_tracker_snapshot("peak")
    device = next((d for d in snapshot if d != HOST and d.type == step.ctx.device.type), None)
    parts, host = _parts(snapshot, device), _parts(snapshot, HOST)
    phases = {(phase, dev == HOST): (total, _parts({0: snap}, 0)) for (phase, dev), (total, snap)
              in tracker.phases.items() if dev in (HOST, device)}
    for value in phases.values():
        value[1].pop("total", None)
    return parts.pop("total", 0), parts, host.pop("total", 0), host, phases


def _run_phases(tracker: HostAwareTracker, phases: dict[str, Callable[[], None]]) -> None:
    """Each phase under its own name."""
    for name, phase in phases.items():
        tracker.reset_mod_stats()  # a phase's model may have run in the step (GRPO's reference)
        tracker.stage = name
        phase()
        tracker.stage = ""


def objective_step(objective: Objective, ctx: StepContext, batch: Batch, host: bool,
                   ) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], dict[str, Callable[[], None]]]:
    """``(loss_fn, phases)`` of ``objective`` on ``batch`` (:class:`SimulatedStep`'s): a batch whose targets the
    objective counts on the host (``host``: made of real tensors, before the fake mode) is laid on this rank and
    counted outside the fake tensors, with the objective's phases before the step; a pretraining batch is laid on
    this rank inside the step, as the trainer does."""
    if not host:
        def whole() -> tuple[torch.Tensor, torch.Tensor]:
            objective.begin_step([batch], dp_reduce=False)
            return objective.loss(ctx.local(batch))

        return whole, {}
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        local = ctx.local(batch)
        row = ctx.local({k: v[:1] for k, v in batch.items()})
        objective.begin_step([batch], dp_reduce=False)
    return (lambda: objective.loss(local)), objective.phases(row)


def simulate_step(model: ModelConfig, parallel: ParallelConfig, world: int, *, seq_len: int, batch: int = 1,
                  rank: int = 0, fake: bool = True, alike: bool = False, kernels: tuple[str, ...] = (),
                  **options: Any) -> Simulated:
    """One rank's peak device and host memory for one step of ``model`` with ``parallel`` on ``world`` ranks
    (module docstring). ``fake=False`` runs the same step on real CPU tensors, counted the same way (small
    sizes: what the simulation is checked against); ``alike``: only some passes of the alike loops
    (:func:`~loongtrain.launch.simulate.fake_step.alike_loops`); ``kernels``: the CUDA attention kernels of the
    planned device, whose backward scratch each attention backward holds
    (:func:`~loongtrain.launch.simulate.fake_step.attention_workspace`). ``options``: the run's other
    ``loongtrain train`` options by name: ``dtype`` (default bf16), ``lora`` (adapters on a frozen base,
    docs/lora.md), ``objective`` (its registry entry's batch and phases: DPO's step on one pair a row and, before
    it, the reference pass, phase ``reference``)."""
    cfg = TrainConfig.from_dict({"model": "tiny", "seq_len": seq_len, "batch_size": batch, "memory_report": False,
                                 "parallel": parallel, "dtype": "bf16", **options})
    cfg.validate()
    device = torch.device("cpu")
    fsdp = zero_module.zero_applies(parallel, world)  # the fake group below makes uses_zero agree
    spec = cfg.spec()
    with fake_ranks(world, rank) if world > 1 or fsdp else contextlib.nullcontext():
        mesh = init_mesh(parallel.hp, parallel.cp, inner_ring=parallel.inner_ring, placement=parallel.placement,
                         interleaved=parallel.interleaved)
        if fsdp:  # collective set-up outside the fake tensors
            zero_module.zero_device_mesh(device, world, parallel.shard_size(world))
        modes = (torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) if fake
                 else contextlib.nullcontext())
        # an objective that counts its targets on the host: its batch is made of real tensors
        host_batch = spec.sample_batch(model, seq_len, batch) if spec.counts_on_host else None
        with modes, noop_to_is_identity(), attention_workspace(kernels), \
                alike_loops() if alike else contextlib.nullcontext():
            # cfg.model names a preset: the native decoder of `model`; the batches are made here, not read
            trainer = Trainer(run_of(cfg, model), mesh, device, batches=lambda *args: iter(()))
            for module in trainer.model.modules():  # experts: grouped GEMMs, whose shapes need no routing's values
                if isinstance(module, MoEFeedForward):
                    module.grouped = True
            data = host_batch if host_batch is not None else spec.sample_batch(model, seq_len, batch)
            loss_fn, objective_phases = objective_step(trainer.objective, trainer.ctx, data, host_batch is not None)
            step = SimulatedStep(trainer.ctx, trainer.optimizer, trainer.grad_sync, loss_fn, objective_phases,
                                 trainer.objective.resident(), trainer.objective.phases_with_gradients)
            peak, parts, host, host_parts, phases = tracked_step(step, parallel.offload_params)
    return Simulated(peak, host, parts, rank, world, host_parts, phases)


def simulate_by_depth(model: ModelConfig, parallel: ParallelConfig, world: int, *, seq_len: int, batch: int = 1,
                      rank: int = 0, kernels: tuple[str, ...] = (), **options: Any) -> Simulated:
    """:func:`simulate_step` of ``model`` from two small depths, the step's alike loops run in part (module
    docstring, *By depth*): each phase's device and host peak, and its parts, extended linearly to
    ``model.num_layers``; one simulation at the model's depth when it is that shallow."""
    keep = min(parallel.offload_keep, model.num_layers - 1) if parallel.offload_activations else 0
    prefix = dense_prefix(model)  # dense first layers (DeepSeek-V3's) are kept at both depths: the rest are alike
    low, high = (n + keep + prefix for n in DEPTHS)
    kw = dict(seq_len=seq_len, batch=batch, rank=rank, alike=True, kernels=kernels, **options)
    if model.num_layers <= high:
        return simulate_step(model, parallel, world, **kw)
    a, b = (simulate_step(with_depth(model, n), parallel, world, **kw) for n in (low, high))
    scale = model.num_layers - high

    def extend(key: tuple[str, bool]) -> tuple[int, dict[str, int]]:
        (ta, pa), (tb, pb) = a.phases.get(key, (0, {})), b.phases[key]
        return tb + scale * (tb - ta), {k: v + scale * (v - pa.get(k, 0)) for k, v in pb.items()}

    phases = {key: extend(key) for key in b.phases}
    device = max((v for (_, host), v in phases.items() if not host), default=(0, {}), key=lambda v: v[0])
    host = max((v for (_, on_host), v in phases.items() if on_host), default=(0, {}), key=lambda v: v[0])
    return Simulated(device[0], host[0], device[1], rank, world, host[1], phases)


def simulate_candidate(model: ModelConfig, candidate: Any, plan_cfg: Any) -> dict[str, Any]:
    """``loongtrain plan --simulate``: :func:`simulate_by_depth` for a planner candidate at the request's length,
    batch and dtype (``candidate``: :class:`loongtrain.plan.cost.Candidate`, ``plan_cfg``:
    :class:`loongtrain.plan.config.PlanConfig`)."""
    dtypes = {"auto": "bf16", "bf16": "bf16", "fp32": "fp32"}  # auto: the planned GPUs' bf16
    dtype = plan_cfg.model_options.dtype
    if dtype not in dtypes:
        raise ValueError(f"--simulate: dtype={dtype!r} is not one the trainer runs; use {sorted(dtypes)}")
    result = simulate_by_depth(model, candidate.config, candidate.world_size, seq_len=plan_cfg.data.seq_len,
                               batch=plan_cfg.data.batch_size, dtype=dtypes[dtype], lora=plan_cfg.model_options.lora,
                               objective=plan_cfg.objective,
                               **objective_spec(plan_cfg.objective).planned_options(plan_cfg.model_options.lora),
                               kernels=load_cluster(plan_cfg.cluster).attention_kernels)
    return result.to_dict()
