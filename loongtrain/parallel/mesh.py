"""The validated 2D-Attention topology: one object, passed explicitly to everything that communicates."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongtrain.parallel.layout import Layout


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a ``dp x cp x hp`` grid and the process groups it talks on.

    ``hp_group``: the head group (all-to-all). ``cp_group``: the whole context ring.
    Ring traffic runs on four groups so no transfer queues behind another (NCCL serialises the
    operations of one group): ``inner_group`` / ``outer_group`` carry K/V inside a double-ring window /
    between windows, ``inner_grad_group`` / ``outer_grad_group`` carry dK/dV on the same paths.
    ``sp_group``: the replica's ``hp*cp`` ranks. ``dp_group``: same coordinates across replicas.
    A ring group of one rank is ``None`` (never used); every group is ``None`` on a single-process mesh.
    """

    layout: Layout
    rank: int
    hp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    inner_group: dist.ProcessGroup | None = None
    outer_group: dist.ProcessGroup | None = None
    inner_grad_group: dist.ProcessGroup | None = None
    outer_grad_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None

    @property
    def hp(self) -> int:
        return self.layout.hp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def sp(self) -> int:
        return self.layout.sp

    @property
    def window(self) -> int:
        return self.layout.window

    @property
    def placement(self) -> str:
        return self.layout.placement

    @property
    def interleaved(self) -> bool:
        return self.layout.interleaved

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def cp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def hp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def sp_rank(self) -> int:
        """Index of this rank inside its replica in sequence-shard order (cp_rank * hp + hp_rank)."""
        return self.cp_rank * self.hp + self.hp_rank

    @property
    def ring_ranks(self) -> list[int]:
        """Global ranks of this rank's context ring, in ring order."""
        d, _, h = self.layout.coords(self.rank)
        return [self.layout.grid[d][c][h] for c in range(self.cp)]

    def __repr__(self) -> str:
        return (
            f"Mesh(rank={self.rank}, dp={self.dp}, hp={self.hp}, cp={self.cp}, window={self.window}, "
            f"placement={self.placement!r}, interleaved={self.interleaved}, "
            f"coords(dp,cp,hp)=({self.dp_rank},{self.cp_rank},{self.hp_rank}))"
        )


def single_process_mesh() -> Mesh:
    """A 1x1x1 mesh needing no torch.distributed: every collective is the identity."""
    return Mesh(layout=Layout(world_size=1, hp=1, cp=1), rank=0)


def init_mesh(
    hp: int,
    cp: int,
    *,
    window: int = 1,
    placement: str = "head_first",
    interleaved: bool = False,
) -> Mesh:
    """Validate the grid and create its process groups (collective: every rank must call it).

    Without an initialised process group, only ``hp == cp == 1`` is allowed and a single-process
    mesh is returned. All validation happens before any group is created.
    """
    if not (dist.is_available() and dist.is_initialized()):
        layout = Layout(1, hp, cp, window, placement, interleaved)  # validates
        return Mesh(layout=layout, rank=0)
    layout = Layout(dist.get_world_size(), hp, cp, window, placement, interleaved)
    rank = dist.get_rank()
    # all-to-all concatenates in group-rank order (sorted global ranks): it must be hp_rank order
    assert all(g == sorted(g) for g in layout.head_groups())
    groups = {
        "hp_group": layout.head_groups(),
        "cp_group": layout.context_groups(),
        "inner_group": layout.inner_ring_groups(),
        "outer_group": layout.outer_ring_groups(),
        "inner_grad_group": layout.inner_ring_groups(),
        "outer_grad_group": layout.outer_ring_groups(),
        "sp_group": layout.replica_groups(),
        "dp_group": layout.dp_groups(),
    }
    made = {name: _my_group(rank, ranks, skip_singletons=name.startswith(("inner", "outer")))
            for name, ranks in groups.items()}
    return Mesh(layout=layout, rank=rank, **made)


def _my_group(rank: int, groups: list[list[int]], skip_singletons: bool) -> dist.ProcessGroup | None:
    """Create the group of this partition that holds ``rank`` (its members call this alike, in the same
    order); with ``skip_singletons``, ``None`` when the groups have a single rank (nothing to send)."""
    if skip_singletons and len(groups[0]) == 1:
        return None
    (mine,) = [ranks for ranks in groups if rank in ranks]
    return dist.new_group(ranks=mine, use_local_synchronization=True)


def default_device() -> torch.device:
    """The device this process should compute on: its local CUDA device under torchrun, else CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend() -> str:
    """NCCL when CUDA devices exist, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"
