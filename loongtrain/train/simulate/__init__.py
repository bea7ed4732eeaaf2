"""Memory of one training step at full size without the hardware (docs/planner.md).

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
simulated at two small depths (:data:`DEPTHS`, past the blocks ``offload_keep`` keeps) and each phase's peak
(device and host, and its parts) extended linearly to the model's depth; the largest is the step's. The
loops whose passes are alike (loss chunks, MLP tiles, norm and RoPE chunks) run their first two passes and
their last (:func:`~loongtrain.train.simulate.fake_step.alike_loops`). Equal to the whole simulation within 1%
(tests/unit/test_simulate.py, every memory mode), at a fraction of its time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any

import torch

from loongtrain.model.config import ModelConfig, with_depth
from loongtrain.model.llama import MoEFeedForward
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import init_mesh
from loongtrain.parallelize import zero as zero_module
from loongtrain.parallelize.offload import host_allocations
from loongtrain.plan.cluster import load_cluster
from loongtrain.train.config import Run, TrainConfig
from loongtrain.train.simulate.fake_step import (  # noqa: F401 - fake_ranks and HostAwareTracker are this module's API too
    HOST,
    HostAwareTracker,
    alike_loops,
    attention_workspace,
    fake_ranks,
    noop_to_is_identity,
)
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


def _batch(model: ModelConfig, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, model.vocab_size, (batch, seq_len))
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq_len).expand(batch, seq_len)}


def _dpo_batch(model: ModelConfig, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    """A DPO batch of one pair a row (prompt and completions ``seq_len // 4`` tokens each: the row is full), its
    reference log-probabilities given (what the reference pass caches). Real tensors: made before the fake mode."""
    from loongtrain.data.pipeline import _collate
    from loongtrain.data.whole_packing import build_row

    quarter = seq_len // 4
    completion = torch.arange(2 * quarter) >= quarter
    rows = []
    for b in range(batch):
        prompt, chosen, rejected = torch.randint(0, model.vocab_size, (3, quarter))
        docs = [(torch.cat([prompt, c]).numpy(), completion.numpy()) for c in (chosen, rejected)]
        row = build_row(docs, seq_len, 0, segments=[0, 1])
        row.update(num_pairs=torch.tensor(1), ref_key=torch.tensor(b), ref_logps=torch.zeros(2, dtype=torch.float64))
        rows.append(row)
    return _collate(rows)


def _reference_pass(trainer: Trainer, row: Any) -> None:
    """DPO's reference pass as the run makes it before its first step (loongtrain/train/reference.py): the
    reference built and sharded like the policy, one row (``row``: laid on this rank) forward only, released."""
    from loongtrain.train.reference import build_reference_model

    model = build_reference_model(trainer)
    trainer.objective.reference.local_logps(model, row)
    del model


def _parts(snapshot: dict[Any, dict[Any, int]], key: Any) -> dict[str, int]:
    return {str(getattr(k, "value", k)).lower(): int(v) for k, v in snapshot.get(key, {}).items()}


def tracked_step(trainer: Trainer, batch: dict[str, torch.Tensor], reference_pass: Any = None, loss_fn: Any = None,
                 ) -> tuple[int, dict[str, int], int, dict[str, int], dict[tuple[str, bool], tuple[int, dict]]]:
    """The trainer's step (loss, backward, dp gradient sync, AdamW) under :class:`HostAwareTracker`, with
    the optimizer states already allocated: ``(device peak bytes, its parts, host peak bytes, its parts,
    each phase's peaks)``.

    Host memory: the activation offloader's host copies (allocated inside ``host_allocations``) and, with
    ``offload_params`` (FSDP2's ``CPUOffloadPolicy``), the sharded parameters, AdamW's states, each
    gradient shard once FSDP2 hands it over (on a GPU: copied to the host, the device buffer freed), and
    everything the AdamW step allocates (it runs on the host). ``reference_pass``: a DPO run's, tracked first
    as the phase ``reference`` (with the AdamW states already allocated: a resumed run's pass); ``loss_fn``:
    the micro-batch's ``(loss, value)`` instead of ``trainer.loss(batch)``."""
    offload_params = trainer.cfg.parallel.offload_params
    for p in trainer.model.parameters():  # steady state: AdamW's m and v exist before the step
        if p.requires_grad:  # (--lora: the adapters only)
            p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    tracker = HostAwareTracker(trainer.model_config.num_layers)
    tracker.track_external(trainer.model, trainer.optimizer)
    hooks = []
    if offload_params:
        for p in trainer.model.parameters():
            tracker.to_host(p)
            if p.requires_grad:  # (--lora: a frozen base has no gradient)
                hooks.append(p.register_post_accumulate_grad_hook(lambda p: tracker.to_host(p.grad)))
        for state in trainer.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.to_host(value)
    try:
        with tracker, warnings.catch_warnings():
            # the reference pass's model is gone before the backward, whose hooks then skip it (one warning each)
            warnings.filterwarnings("ignore", message="Module is None. Skipping")
            if reference_pass is not None:
                tracker.stage = "reference"
                reference_pass()
                tracker.stage = ""
            loss, _ = loss_fn() if loss_fn is not None else trainer.loss(batch)
            with trainer.grad_sync.overlapped() if trainer.grad_sync else contextlib.nullcontext():
                loss.backward()
            tracker.stage = "optimizer"
            with host_allocations() if offload_params else contextlib.nullcontext():
                trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
    finally:
        for hook in hooks:
            hook.remove()
    snapshot = tracker.get_tracker_snapshot("peak")
    device = next((d for d in snapshot if d != HOST and d.type == trainer.device.type), None)
    parts, host = _parts(snapshot, device), _parts(snapshot, HOST)
    phases = {(phase, dev == HOST): (total, _parts({0: snap}, 0)) for (phase, dev), (total, snap)
              in tracker.phases.items() if dev in (HOST, device)}
    for value in phases.values():
        value[1].pop("total", None)
    return parts.pop("total", 0), parts, host.pop("total", 0), host, phases


def simulate_step(model: ModelConfig, parallel: ParallelConfig, world: int, *, seq_len: int, batch: int = 1,
                  dtype: str = "bf16", rank: int = 0, fake: bool = True, alike: bool = False,
                  lora: str = "", objective: str = "pretrain", kernels: tuple[str, ...] = ()) -> Simulated:
    """One rank's peak device and host memory for one step of ``model`` with ``parallel`` on ``world`` ranks
    (module docstring). ``fake=False`` runs the same step on real CPU tensors, counted the same way (small
    sizes: what the simulation is checked against); ``alike``: only some passes of the alike loops
    (:func:`~loongtrain.train.simulate.fake_step.alike_loops`); ``lora``: ``--lora``'s adapters on a frozen
    base (docs/lora.md). ``objective="dpo"``: the DPO step (one pair a row) and, before it, the reference pass
    (phase ``reference``: the reference model built and sharded like the policy, a row forward, released).
    ``kernels``: the CUDA attention kernels of the planned device, whose backward scratch each attention
    backward holds (:func:`~loongtrain.train.simulate.fake_step.attention_workspace`)."""
    cfg = TrainConfig(model="tiny", seq_len=seq_len, batch_size=batch, dtype=dtype, parallel=parallel,
                      memory_report=False, lora=lora, objective=objective)
    cfg.validate()
    device = torch.device("cpu")
    fsdp = zero_module.zero_applies(parallel, world)  # the fake group below makes uses_zero agree
    with fake_ranks(world, rank) if world > 1 or fsdp else contextlib.nullcontext():
        mesh = init_mesh(parallel.hp, parallel.cp, inner_ring=parallel.inner_ring, placement=parallel.placement,
                         interleaved=parallel.interleaved)
        if fsdp:  # collective set-up outside the fake tensors
            zero_module.zero_device_mesh(device, world, parallel.shard_size(world))
        modes = (torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) if fake
                 else contextlib.nullcontext())
        # a post-training objective counts its targets on the host: its batch is made of real tensors
        data = {"dpo": _dpo_batch, "sft": _batch}.get(objective, lambda *args: None)(model, seq_len, batch)
        with modes, noop_to_is_identity(), attention_workspace(kernels), \
                alike_loops() if alike else contextlib.nullcontext():
            # cfg.model names a preset: the native decoder of `model`; the batches are made here, not read
            trainer = Trainer(Run(cfg, model), mesh, device, batches=lambda *args: iter(()))
            for module in trainer.model.modules():  # experts: grouped GEMMs, whose shapes need no routing's values
                if isinstance(module, MoEFeedForward):
                    module.grouped = True
            reference = loss_fn = None
            if data is not None:  # host-side work on real tensors: the batch laid on this rank, its targets counted
                with torch._subclasses.fake_tensor.unset_fake_temporarily():
                    local = trainer.sharding.local(data)
                    row = trainer.sharding.local({k: v[:1] for k, v in data.items()})
                    trainer.objective.begin_step([data], dp_reduce=False)
                loss_fn = lambda: trainer.local_loss(local)  # noqa: E731
                reference = (lambda: _reference_pass(trainer, row)) if objective == "dpo" else None
            objective_step = (reference, loss_fn) if data is not None else ()  # pretraining: the plain call
            peak, parts, host, host_parts, phases = tracked_step(
                trainer, data if data is not None else _batch(model, seq_len, batch), *objective_step)
    return Simulated(peak, host, parts, rank, world, host_parts, phases)


def simulate_by_depth(model: ModelConfig, parallel: ParallelConfig, world: int, *, seq_len: int, batch: int = 1,
                      dtype: str = "bf16", rank: int = 0, lora: str = "", objective: str = "pretrain",
                      kernels: tuple[str, ...] = ()) -> Simulated:
    """:func:`simulate_step` of ``model`` from two small depths, the step's alike loops run in part (module
    docstring, *By depth*): each phase's device and host peak, and its parts, extended linearly to
    ``model.num_layers``; one simulation at the model's depth when it is that shallow."""
    keep = min(parallel.offload_keep, model.num_layers - 1) if parallel.offload_activations else 0
    low, high = (n + keep for n in DEPTHS)
    kw = dict(seq_len=seq_len, batch=batch, dtype=dtype, rank=rank, alike=True, lora=lora, objective=objective,
              kernels=kernels)
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
    dtypes = {"bf16": "bf16", "fp32": "fp32"}
    if plan_cfg.dtype not in dtypes:
        raise ValueError(f"--simulate: dtype={plan_cfg.dtype!r} is not one the trainer runs; use {sorted(dtypes)}")
    result = simulate_by_depth(model, candidate.config, candidate.world_size, seq_len=plan_cfg.seq_len,
                               batch=plan_cfg.batch_size, dtype=dtypes[plan_cfg.dtype], lora=plan_cfg.lora,
                               objective=plan_cfg.objective,
                               kernels=load_cluster(plan_cfg.cluster).attention_kernels)
    return result.to_dict()
