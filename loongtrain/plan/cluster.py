"""Cluster descriptions for the cost model: TOML files, by name (``loongtrain/plan/clusters/<name>.toml``)
or by path (copy one and edit it).

Units in the files: memory in GiB per device (host memory in GiB per node), FLOP rates in TFLOP/s per
device, device-memory, intra-node and host-link bandwidth in GB/s per device (links one direction), NIC
bandwidth in Gbit/s per NIC one direction, latencies in microseconds.

Rates by shape (docs/planner.md): ``attention_rates`` holds measured rows ``[head_dim, head_tokens,
TFLOP/s]`` of one causal kernel call (forward + backward, FLOPs as ``attention_tflops`` counts them),
``head_tokens`` being the call's query tokens times its query heads; :meth:`Cluster.attention_rate` takes
the rows of the nearest head dim and interpolates linearly in ``log(head_tokens)``, flat beyond the
measured range. Without rows every call runs at ``attention_tflops``. ``loongtrain plan --calibrate-from``
writes them from a gpu_check run (:mod:`loongtrain.plan.calibrate`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from loongtrain._options import check_fields, read_toml
from loongtrain.attn.cuda_kernels import SCRATCH_KERNELS

CLUSTER_DIR = Path(__file__).with_name("clusters")


@dataclass(frozen=True)
class Cluster:
    """One homogeneous cluster: ``nodes`` are given at planning time, everything else is per node/device."""

    name: str
    gpus_per_node: int
    memory_gib: float  # per device
    peak_tflops: float  # dense peak of the training dtype: the MFU denominator
    matmul_tflops: float  # achieved by large GEMMs
    attention_tflops: float  # achieved by the attention kernel (backward: 2.5x the FLOPs at this rate)
    intra_node_gbyte_s: float  # per device, one direction (NVLink / NVSwitch)
    nic_gbit_s: float  # per NIC, one direction
    nics_per_node: int
    link_efficiency: float = 0.8  # achieved fraction of the nominal bandwidths above
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    usable_memory_fraction: float = 0.9  # left after the runtime's context and allocator fragmentation
    # False when one connection moves one direction at a time (measured for gloo over TCP): an exchange
    # whose send and receive peer are the same rank, and every all-to-all pair, then take twice as long
    duplex: bool = True
    # host side of the offload modes (docs/planner.md): pinned host memory per node, the achieved fraction
    # of it left to training, the host link per device (PCIe, GB/s one direction, x link_efficiency), and
    # the CPU AdamW rate of a node (billions of parameters per second, shared by its ranks)
    host_memory_gib: float = 1024.0
    usable_host_fraction: float = 0.9
    host_link_gbyte_s: float = 32.0
    cpu_adam_gparams_s: float = 1.0
    # achieved device-memory bandwidth of the memory-bound ops (norms, RoPE, SwiGLU, casts, the loss, the
    # AdamW step: plan/step_bytes.py), GB/s per device
    memory_gbyte_s: float = 2000.0
    # achieved fraction of the link bandwidth (after link_efficiency) that an all-to-all reaches
    a2a_efficiency: float = 1.0
    # measured attention rates by call size: rows [head_dim, head_tokens, TFLOP/s] (module docstring)
    attention_rates: tuple[tuple[float, ...], ...] = ()
    description: str = ""
    # substrings of torch.cuda.get_device_name() of the devices this preset describes: the one table
    # that --plan auto and the trainer's MFU peak (loongtrain.train.metrics) look devices up in
    device_names: tuple[str, ...] = ()
    # the CUDA attention kernels the trainer's kernel choice may pick on this device (loongtrain.attn.kernel_choice:
    # cuDNN on sm90/sm100): the memory model counts the largest of their backward scratches
    attention_kernels: tuple[str, ...] = ("cuda_flash",)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"cluster {self.name!r}: {f.name}={value!r} must be a positive number")
        if (self.link_efficiency > 1 or self.usable_memory_fraction > 1 or self.usable_host_fraction > 1
                or self.a2a_efficiency > 1):
            raise ValueError(f"cluster {self.name!r}: efficiencies and fractions must be <= 1")
        for i, row in enumerate(self.attention_rates):
            if len(row) != 3 or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in row):
                raise ValueError(f"cluster {self.name!r}: attention_rates[{i}]={list(row)!r} must be [head_dim, "
                                 "head_tokens, TFLOP/s] of positive numbers")
        unknown = [k for k in self.attention_kernels if k not in SCRATCH_KERNELS]
        if unknown or not self.attention_kernels:
            raise ValueError(f"cluster {self.name!r}: attention_kernels={list(self.attention_kernels)!r}: each must be "
                             f"one of {list(SCRATCH_KERNELS)} (at least one)")
        object.__setattr__(self, "attention_rates", tuple(sorted(tuple(map(float, r)) for r in self.attention_rates)))

    @property
    def memory_bw(self) -> float:
        """Achieved device-memory bytes/s of the memory-bound ops."""
        return self.memory_gbyte_s * 1e9

    def attention_rate(self, head_dim: int, head_tokens: float) -> float:
        """FLOP/s of one attention call of ``head_tokens`` (query tokens x query heads) at ``head_dim``:
        the measured rows of the nearest head dim, linear in ``log(head_tokens)`` between them, flat
        beyond; ``attention_tflops`` without rows (module docstring)."""
        if not self.attention_rates:
            return self.attention_tflops * 1e12
        dims = sorted({r[0] for r in self.attention_rates})
        dim = min(dims, key=lambda x: (abs(math.log(x / head_dim)), x))
        rows = [(r[1], r[2]) for r in self.attention_rates if r[0] == dim]
        sizes = [n for n, _ in rows]
        i = bisect.bisect_left(sizes, head_tokens)
        if i == 0:
            return rows[0][1] * 1e12
        if i == len(rows):
            return rows[-1][1] * 1e12
        (n0, r0), (n1, r1) = rows[i - 1], rows[i]
        w = math.log(head_tokens / n0) / math.log(n1 / n0)
        return (r0 + w * (r1 - r0)) * 1e12

    @property
    def intra_bw(self) -> float:
        """Achieved intra-node bytes/s per device, one direction."""
        return self.intra_node_gbyte_s * 1e9 * self.link_efficiency

    @property
    def nic_bw(self) -> float:
        """Achieved bytes/s of one NIC, one direction."""
        return self.nic_gbit_s * 1e9 / 8 * self.link_efficiency

    def cross_bw(self, senders_per_node: int) -> float:
        """Per-device cross-node bytes/s when ``senders_per_node`` devices of a node send at once:
        ``min(one NIC, nics_per_node * NIC / senders)``."""
        return min(self.nic_bw, self.nics_per_node * self.nic_bw / max(1, senders_per_node))

    @property
    def usable_memory(self) -> float:
        return self.memory_gib * 2**30 * self.usable_memory_fraction

    @property
    def usable_host_memory(self) -> float:
        """Bytes of host memory per node left to training (the offload modes' pinned buffers)."""
        return self.host_memory_gib * 2**30 * self.usable_host_fraction

    @property
    def host_bw(self) -> float:
        """Achieved bytes/s between one device and the host, one direction."""
        return self.host_link_gbyte_s * 1e9 * self.link_efficiency


def builtin_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.toml"))


def cluster_for_device(device_name: str) -> Cluster | None:
    """The built-in cluster whose ``device_names`` match ``device_name`` (a CUDA device name; the longest
    matching key wins), or None."""
    by_key = {key: c for c in map(load_cluster, builtin_clusters()) for key in c.device_names}
    found = [key for key in by_key if key in device_name]
    return by_key[max(found, key=len)] if found else None


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A built-in cluster by name (``a100``, ``h100``, ``h200``) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = CLUSTER_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(
            f"cluster {str(name_or_path)!r} is neither a built-in cluster {builtin_clusters()} "
            "nor a TOML file"
        )
    data = read_toml(path, "cluster file")
    where = f"cluster file {str(path)!r}"
    if "cluster" in data:
        if not isinstance(data["cluster"], dict) or len(data) > 1:
            raise ValueError(f"{where}: [cluster] must be the file's only table")
        data = data["cluster"]
    data.setdefault("name", path.stem)
    values = check_fields(where, data, Cluster)
    try:
        return Cluster(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def cluster_to_toml(cluster: Cluster) -> str:
    """TOML text that :func:`load_cluster` reads back into an equal :class:`Cluster`."""
    lines = ["[cluster]"]
    for f in dataclasses.fields(cluster):
        value = getattr(cluster, f.name)
        if isinstance(value, bool):
            lines.append(f"{f.name} = {str(value).lower()}")
        elif isinstance(value, tuple) and value and isinstance(value[0], tuple):  # a table of numbers
            rows = ",\n".join(f"  [{', '.join(_number(x) for x in row)}]" for row in value)
            lines.append(f"{f.name} = [\n{rows},\n]")
        elif isinstance(value, tuple):
            lines.append(f"{f.name} = [{', '.join(_toml_string(v) for v in value)}]")
        elif isinstance(value, str):
            lines.append(f"{f.name} = {_toml_string(value)}")
        elif isinstance(value, int):
            lines.append(f"{f.name} = {value}")
        else:
            lines.append(f"{f.name} = {float(value)!r}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
