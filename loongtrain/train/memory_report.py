"""Per-rank memory report: parameters, gradients, optimizer state and saved activations (bytes).

Parameters, gradients and optimizer state are counted from this rank's tensors (the local shard of an
FSDP2 DTensor). Saved activations are measured during one forward: every tensor autograd saves goes
through :func:`torch.autograd.graph.saved_tensors_hooks`, and what checkpointing keeps outside that
mechanism is added explicitly (a recomputed block's inputs are saved through the hook by
``torch.utils.checkpoint`` itself; the outputs selective recompute caches are reported by its policy).
Tensors are counted once per underlying storage, and storages of parameters (weights saved by
matmuls, possibly FSDP's gathered copies) are excluded.

Device and host are reported apart (docs/memory.md#memory-modes): ``params``, ``grads``,
``optimizer_state`` and ``activations`` count only what is on the device, ``host`` what the offload
modes keep on the host: under ``--offload-params`` (FSDP2's ``CPUOffloadPolicy``) the parameter and
gradient shards and AdamW's states (``host_states``), under ``--offload-activations`` the saved tensors
the offloader holds on the host at the end of the forward (``host_activations``; the saved tensors it
moves are not in ``activations``, which counts those left on the device).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.model.memory import MemoryTerm
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.runtime import is_distributed
from loongtrain.parallelize.offload import activation_offloader
from loongtrain.parallelize.recompute import saved_output_sink
from loongtrain.parallelize.zero import uses_zero
from loongtrain.plan.memory_model import memory_per_rank
from loongtrain.plan.memory_terms import feature_terms
from loongtrain.sections.model import compute_dtype
from loongtrain.train.config import TrainSections
from loongtrain.train.step_context import StepContext

log = logging.getLogger("loongtrain.train")

Tensor = torch.Tensor

REPORT_KEYS = ("params", "grads", "optimizer_state", "activations", "total", "host")


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: Tensor) -> int:
    """Bytes of this rank's part of ``t`` (elements x element size)."""
    local = local_tensor(t)
    return local.numel() * local.element_size()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (local shards under FSDP2)."""
    return sum(tensor_bytes(p) for p in model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of this rank's gradients: the existing ``.grad`` of each trainable parameter, or, where none
    exists yet, the size it will have (same shape and dtype as the local parameter shard)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            total += tensor_bytes(p.grad) if p.grad is not None else tensor_bytes(p)
    return total


_ADAM_STATES = 2  # exp_avg, exp_avg_sq per parameter element


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> tuple[int, bool]:
    """``(bytes, estimated)`` of this rank's optimizer state.

    Measured from ``optimizer.state`` once populated (after a step or a load). Before that, Adam/AdamW
    state is estimated as two tensors per parameter (``estimated=True``); other optimizers count 0.
    """
    if optimizer is None:
        return 0, False
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                local = local_tensor(value)
                key = local.untyped_storage().data_ptr()
                if key in seen and key != 0:
                    continue
                seen.add(key)
                total += tensor_bytes(value)
    if optimizer.state:
        return total, False
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        return _ADAM_STATES * sum(tensor_bytes(p) for p in params), True
    return 0, True


class SavedActivations:
    """Context manager counting the unique storages autograd (and checkpointing) keep for backward.

    ``bytes`` and ``tensors`` (number of unique storages) are valid after exit. Storages that belong to
    parameters in use at the time (plain or FSDP-gathered) are not activations and are skipped.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self._storages: dict[int, int] = {}
        self._params: dict[int, Tensor] = {}
        self._modules: dict[int, nn.Module] = {}
        self._stack = contextlib.ExitStack()

    def _note_params(self, module: nn.Module, _args: Any, recurse: bool = False) -> None:
        if not recurse:
            self._modules[id(module)] = module
        for p in module.parameters(recurse=recurse):
            if type(p).__name__ == "DTensor":
                continue
            ptr = p.untyped_storage().data_ptr()
            if ptr:
                self._params[ptr] = p

    def _is_param_storage(self, ptr: int) -> bool:
        p = self._params.get(ptr)
        if p is None:  # a compiled block runs its submodules without hooks: look at their weights now
            for module in self._modules.values():
                self._note_params(module, (), recurse=True)
            p = self._params.get(ptr)
        return p is not None and p.untyped_storage().data_ptr() == ptr

    def _add(self, t: Any) -> None:
        if not isinstance(t, Tensor) or type(t).__name__ == "DTensor":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or self._is_param_storage(ptr):
            return
        self._storages[ptr] = max(self._storages.get(ptr, 0), storage.nbytes())

    def _add_tree(self, output: Any) -> None:
        if isinstance(output, (tuple, list)):
            for item in output:
                self._add_tree(item)
        else:
            self._add(output)

    def _pack(self, t: Tensor) -> Tensor:
        self._add(t)
        return t

    def __enter__(self) -> SavedActivations:
        handle = nn.modules.module.register_module_forward_pre_hook(self._note_params)
        self._stack.callback(handle.remove)
        self._stack.enter_context(saved_output_sink(self._add_tree))
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self.bytes = sum(self._storages.values())
        self.tensors = len(self._storages)
        self._params.clear()
        self._modules.clear()


def memory_report(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[], Tensor] | None = None,
    *,
    states_on_host: bool = False,
) -> dict[str, int]:
    """This rank's memory in bytes: on the device ``params``, ``grads``, ``optimizer_state``,
    ``activations`` and their ``total``; on the host ``host`` = ``host_states + host_activations``.

    ``loss_fn`` runs one forward and returns a scalar loss; the tensors saved for backward during it are
    measured (``activations``, and ``activation_tensors`` = unique storages; with ``model``'s activation
    offloader, the bytes it holds on the host after that forward are ``host_activations``). Its backward
    is then run so that the graph (and FSDP's per-iteration state) is released, and gradients are reset
    to None. Without ``loss_fn``, ``activations`` is 0. ``states_on_host``: the parameters, gradients and
    optimizer state live on the host (``--offload-params``), so they count in ``host_states``, not on
    the device. ``optimizer_state_estimated`` is 1 when the optimizer had no state yet and Adam's two
    moments were estimated (see :func:`optimizer_state_bytes`).
    """
    activations, tensors, host_activations = 0, 0, 0
    if loss_fn is not None:
        counter = SavedActivations()
        offloader = activation_offloader(model)
        with counter:
            loss = loss_fn()
        activations, tensors = counter.bytes, counter.tensors
        if offloader is not None:
            host_activations = offloader.host_bytes
        loss.backward()
        del loss
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    opt_bytes, estimated = optimizer_state_bytes(optimizer)
    report = {
        "params": parameter_bytes(model),
        "grads": gradient_bytes(model),
        "optimizer_state": opt_bytes,
        "activations": activations,
    }
    host_states = 0
    if states_on_host:
        host_states = report["params"] + report["grads"] + report["optimizer_state"]
        report.update(params=0, grads=0, optimizer_state=0)
    report["total"] = sum(report.values())
    report["host_states"], report["host_activations"] = host_states, host_activations
    report["host"] = host_states + host_activations
    report["activation_tensors"] = tensors
    report["optimizer_state_estimated"] = int(estimated)
    return report


@dataclass(frozen=True)
class MemoryPlan:
    """What the planner needs to predict a run's memory (:func:`predicted_memory`): its ``parallel`` config, the
    compute dtype's bytes, the ZeRO shard group (1 without FSDP) and its feature terms
    (:func:`~loongtrain.plan.memory_terms.feature_terms`: its adapters, its device's kernels' scratch, its
    objective's phases)."""

    parallel: ParallelConfig
    dtype_bytes: int
    zero_size: int
    features: Sequence[MemoryTerm] = ()

    @classmethod
    def of(cls, cfg: TrainSections, ctx: StepContext, phases: Sequence[MemoryTerm] = ()) -> MemoryPlan:
        """The plan of the run ``cfg`` on the step context ``ctx`` (its layout, ZeRO shard group, ``recompute``,
        ``reshard_after_forward``, compute dtype and memory modes) with its objective's memory ``phases``."""
        parallel = cfg.parallel
        compute = compute_dtype(cfg.model.dtype, ctx.device)
        kernels = scratch_kernels(ctx.device, compute, ctx.model_config.head_dim)
        return cls(parallel, torch.empty((), dtype=compute).element_size(),
                   parallel.shard_size(ctx.mesh.world_size) if uses_zero(parallel) else 1,
                   feature_terms(cfg.model.lora_config(), kernels, phases, cfg.optim.deterministic,
                                 sm_count(ctx.device)))


def step_memory_report(ctx: StepContext, optimizer: torch.optim.Optimizer | None, loss_fn: Callable[[], Tensor],
                       plan: MemoryPlan) -> dict[str, int]:
    """:func:`memory_report` of the trainer's step on its context (``loss_fn``: one micro-batch's loss, as the step
    computes it; with ``--offload-params``, the states on the host once FSDP2 offloads them)."""

    def train_loss() -> Tensor:
        ctx.model.train()
        return loss_fn()

    states_on_host = plan.parallel.offload_params and uses_zero(plan.parallel)
    return memory_report(ctx.model, optimizer, train_loss, states_on_host=states_on_host)


def startup_memory_report(ctx: StepContext, optimizer: torch.optim.Optimizer | None, loss_fn: Callable[[], Tensor],
                          plan: MemoryPlan, shape: Sequence[int]) -> dict[str, int]:
    """Collective: measure this rank's report (:func:`step_memory_report`) and log every rank's on rank 0 (the
    trainer's start-up call), then the planner's prediction for the run's own configuration (``shape``: the
    batch's ``(batch, seq_len)``) beside rank 0's measurement (:func:`format_prediction`); returns this rank's
    report (see :func:`metrics_fields`)."""
    report = step_memory_report(ctx, optimizer, loss_fn, plan)
    reports = log_memory_report(report)
    rank = dist.get_rank() if is_distributed() else 0
    if rank == 0:
        batch_size, seq_len = shape
        predicted = predicted_memory(ctx, plan, seq_len=seq_len, batch=batch_size)
        log.info("planner's prediction for this configuration (loongtrain.plan.memory_model) beside rank 0's "
                 "measurement:\n%s", format_prediction(predicted, reports[0]))
    return report


def predicted_memory(ctx: StepContext, plan: MemoryPlan, *, seq_len: int, batch: int) -> dict[str, float]:
    """:func:`loongtrain.plan.memory_model.memory_per_rank` for what the step context runs: its model, its layout
    and the run's plan (:class:`MemoryPlan`)."""
    return memory_per_rank(ctx.model_config, ctx.mesh.layout, plan.parallel, seq_len=seq_len, batch=batch,
                           dtype_bytes=plan.dtype_bytes, zero_size=plan.zero_size, features=plan.features)


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (FA2's deterministic backward sizes its dQ accumulators by them);
    the planner's default device's off CUDA."""
    from loongtrain.attn.cuda_kernels import SM_COUNT

    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else SM_COUNT


def scratch_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str, ...]:
    """The CUDA attention kernels the kernel choice may pick here whose backward scratch the memory model
    counts (:mod:`loongtrain.attn.kernel_memory`; none on CPU)."""
    from loongtrain.attn.cuda_kernels import SCRATCH_KERNELS
    from loongtrain.attn.kernel_choice import kernel_candidates

    return tuple(k.name for k in kernel_candidates(device, dtype, head_dim) if k.name in SCRATCH_KERNELS)


#: the planner's parts that the measured report counts: (planner parts, report parts)
COMPARED_PARTS = {
    "params + grads + optimizer state": (("states",), ("params", "grads", "optimizer_state")),
    "saved activations": (("activations",), ("activations",)),
}


#: the planner's parts of the step (:func:`~loongtrain.plan.memory_model.memory_per_rank`); any other is a phase
#: of the run's outside the step (an objective's: DPO's ``reference``), and of them the transient ones
STEP_PARTS = ("states", "working_params", "activations", "recompute", "logits", "workspace", "host_activations",
              "total", "host")
TRANSIENT_PARTS = ("working_params", "recompute", "logits", "workspace")


def compared_totals(predicted: dict[str, float], measured: dict[str, int]) -> tuple[float, float]:
    """``(predicted, measured)`` bytes over :data:`COMPARED_PARTS` (what both count)."""
    pred = sum(predicted[k] for parts, _ in COMPARED_PARTS.values() for k in parts)
    meas = sum(measured[k] for _, parts in COMPARED_PARTS.values() for k in parts)
    return float(pred), float(meas)


def format_prediction(predicted: dict[str, float], measured: dict[str, int]) -> str:
    """A markdown table (MiB): the planner's parts beside the measured ones they correspond to, the
    compared total and their ratio, and the planner's transient parts (not measured by the report)."""
    lines = ["| part | predicted MiB | measured MiB |", "|---|---:|---:|"]
    for label, (pred_parts, meas_parts) in COMPARED_PARTS.items():
        pred = sum(predicted[k] for k in pred_parts)
        meas = sum(measured[k] for k in meas_parts)
        lines.append(f"| {label} | {_mib(int(pred))} | {_mib(meas)} |")
    pred, meas = compared_totals(predicted, measured)
    ratio = pred / meas if meas else float("nan")
    lines.append(f"| compared total | {_mib(int(pred))} | {_mib(int(meas))} (predicted/measured {ratio:.3f}) |")
    if measured.get("host") or predicted.get("host"):  # the offload modes: the planner's host against the report's
        lines.append(f"| host (offload modes) | {_mib(int(predicted.get('host', 0)))} | "
                     f"{_mib(measured.get('host', 0))} |")
    transient = {k: v for k, v in predicted.items() if k in TRANSIENT_PARTS}
    lines.append(f"| transient ({', '.join(transient)}) | {_mib(int(sum(transient.values())))} | - |")
    for name in (k for k in predicted if k not in STEP_PARTS):  # an objective's phases (DPO's reference pass)
        lines.append(f"| {name} phase (before the first step) | {_mib(int(predicted[name]))} | - |")
    lines.append(f"| planner's peak of the step | {_mib(int(predicted['total']))} | - |")
    return "\n".join(lines)


def gather_reports(report: dict[str, int]) -> list[dict[str, int]]:
    """Every rank's report, by rank (collective; just ``[report]`` without torch.distributed)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return [report]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, report)
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def format_memory_table(reports: Iterable[dict[str, int]]) -> str:
    """A markdown table (MiB) with one row per rank."""
    lines = [
        "| rank | params MiB | grads MiB | optimizer MiB | activations MiB | total MiB | host MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(reports):
        est = "*" if r.get("optimizer_state_estimated") else ""
        lines.append(
            f"| {rank} | {_mib(r['params'])} | {_mib(r['grads'])} | {_mib(r['optimizer_state'])}{est} | "
            f"{_mib(r['activations'])} | {_mib(r['total'])} | {_mib(r.get('host', 0))} |"
        )
    if any(r.get("optimizer_state_estimated") for r in reports):
        lines.append("\n\\* optimizer state estimated before the first step (Adam: 2 x parameter bytes)")
    return "\n".join(lines)


def log_memory_report(report: dict[str, int], *, all_ranks: bool = True) -> list[dict[str, int]]:
    """Log the per-rank memory table on rank 0 (gathering every rank's report when ``all_ranks``)."""
    reports = gather_reports(report) if all_ranks else [report]
    rank = dist.get_rank() if is_distributed() else 0
    if rank == 0:
        log.info("memory per rank (bytes counted from tensors; activations saved by one forward):\n%s",
                 format_memory_table(reports))
    return reports


def metrics_fields(report: dict[str, int]) -> dict[str, float]:
    """The report as flat metrics (GiB), e.g. to merge into a step record: ``mem_params_gib`` ... (device),
    ``mem_host_gib`` (the offload modes' host memory)."""
    return {f"mem_{k}_gib": report.get(k, 0) / 2**30 for k in REPORT_KEYS}
