"""The validated 2D-Attention topology: one object, passed explicitly to everything that communicates."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from loongtrain.parallel.agreement import check_agreement
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import Layout
from loongtrain.parallel.runtime import is_distributed


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a ``dp x cp x hp`` grid and the process groups it talks on.

    ``hp_group``: the head group (all-to-all). ``cp_group``: the whole context ring.
    Ring traffic runs on four groups so no transfer queues behind another (NCCL serialises the
    operations of one group): ``inner_group`` / ``outer_group`` carry K/V inside a double-ring inner ring /
    between inner rings, ``inner_grad_group`` / ``outer_grad_group`` carry dK/dV on the same paths.
    ``sp_group``: the replica's ``hp*cp`` ranks. ``dp_group``: same coordinates across replicas.
    ``check_group``: under NCCL, a gloo group of the replica's ranks for the per-call agreement digest
    (``parallel/agreement.py``; CPU tensors, no device synchronisation); ``None`` under gloo (the sp group serves).
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
    check_group: dist.ProcessGroup | None = None

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
    def inner_ring(self) -> int:
        return self.layout.inner_ring

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
            f"Mesh(rank={self.rank}, dp={self.dp}, hp={self.hp}, cp={self.cp}, inner_ring={self.inner_ring}, "
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
    inner_ring: int = 1,
    placement: str = "head_first",
    interleaved: bool = False,
    timeout: float | None = None,
) -> Mesh:
    """Validate the grid and create its process groups (collective: every rank must call it).

    Without an initialised process group, only ``hp == cp == 1`` is allowed and a single-process
    mesh is returned. First the ranks exchange their arguments: if any differ, every rank raises the
    same ValueError naming the field and the ranks (:mod:`loongtrain.parallel.agreement`). All
    validation happens before any group is created. ``timeout`` (seconds; default: the default
    group's) bounds each collective of the new groups; a group shared with a live mesh keeps its own.
    Groups are made once per layout: while a mesh is live, the same arguments return the same
    :class:`Mesh`, and a new layout reuses the live groups of a role that splits the ranks alike (e.g.
    the head groups of every layout with the same ``hp`` and placement). :func:`destroy_mesh` frees
    them (docs/launching.md).
    """
    if timeout is not None and not 0 < timeout < float("inf"):
        raise ValueError(f"init_mesh: timeout={timeout} must be a positive, finite number of seconds (or None)")
    check_agreement("init_mesh", dict(hp=hp, cp=cp, inner_ring=inner_ring, placement=placement,
                                      interleaved=interleaved))
    parallel = ParallelConfig(hp=hp, cp=cp, inner_ring=inner_ring, placement=placement, interleaved=interleaved)
    if not is_distributed():
        return Mesh(layout=parallel.layout(1), rank=0)
    layout = parallel.layout(dist.get_world_size())
    # all-to-all concatenates in group-rank order (sorted global ranks): it must be hp_rank order
    assert all(g == sorted(g) for g in layout.head_groups())
    return _registry().mesh(layout, dist.get_rank(), timeout)


def destroy_mesh(mesh: Mesh) -> None:
    """Free ``mesh``'s process groups that no other live mesh uses and forget it (collective: every rank
    calls it for the same mesh, in the same order). Using ``mesh`` afterwards is an error; its groups'
    threads end once the last reference to it is gone. No-op for a mesh that is not live."""
    registry = _registry() if is_distributed() else None
    if registry is not None and registry.meshes.get(mesh.layout) is mesh:
        registry.release(mesh.layout)


def destroy_all_meshes() -> None:
    """:func:`destroy_mesh` for every live mesh of the current process group (collective)."""
    if is_distributed():
        registry = _registry()
        for layout in reversed(list(registry.meshes)):
            registry.release(layout)


# Roles of the mesh's groups, in creation order. Two roles never share a group (NCCL serialises the
# operations of one group); meshes of different layouts share a role's groups when the role partitions
# the ranks alike.
_ROLES = ("hp_group", "cp_group", "inner_group", "outer_group", "inner_grad_group", "outer_grad_group",
          "sp_group", "dp_group", "check_group")
_GLOO_ROLES = ("check_group",)  # made with backend="gloo", and only when the default backend is NCCL


def _partitions(layout: Layout) -> dict[str, list[list[int]]]:
    """Each role's partition of the ranks into groups; ring roles with one-rank groups are left out
    (nothing to send: their field is ``None``)."""
    rings = {"inner": layout.inner_ring_groups(), "outer": layout.outer_ring_groups()}
    parts = {
        "hp_group": layout.head_groups(), "cp_group": layout.context_groups(),
        "inner_group": rings["inner"], "outer_group": rings["outer"],
        "inner_grad_group": rings["inner"], "outer_grad_group": rings["outer"],
        "sp_group": layout.replica_groups(), "dp_group": layout.dp_groups(),
        "check_group": layout.replica_groups(),
    }
    nccl = dist.get_backend() == "nccl"
    return {role: parts[role] for role in _ROLES
            if not (role.startswith(("inner", "outer")) and len(parts[role][0]) == 1)
            and (nccl or role not in _GLOO_ROLES)}


@dataclass
class _Registry:
    """The live meshes and their process groups in one default process group (docs/launching.md).

    Every rank holds the same keys: they change only through collective calls (``init_mesh``,
    ``destroy_mesh``) made in the same order everywhere, and a key is a whole partition of the ranks,
    not this rank's block of it. That is what lets ranks agree, without talking, on whether a group
    must be made. ``groups`` maps ``(role, partition)`` to ``[this rank's group, live meshes using it]``.
    """

    world: dist.ProcessGroup
    meshes: dict[Layout, Mesh] = field(default_factory=dict)
    groups: dict[tuple[str, tuple[tuple[int, ...], ...]], list[Any]] = field(default_factory=dict)

    def mesh(self, layout: Layout, rank: int, timeout: float | None = None) -> Mesh:
        if layout not in self.meshes:
            made = {role: self._acquire(role, partition, rank, timeout)
                    for role, partition in _partitions(layout).items()}
            self.meshes[layout] = Mesh(layout=layout, rank=rank, **made)
        return self.meshes[layout]

    def _acquire(self, role: str, partition: list[list[int]], rank: int, timeout: float | None) -> dist.ProcessGroup:
        key = (role, tuple(map(tuple, partition)))
        if key not in self.groups:
            # every rank creates every group of the partition (members and non-members alike): with
            # new_group's global synchronisation, group names come from a counter that never repeats,
            # so a group made after another was destroyed cannot meet that one's stale store keys;
            # sharing whole partitions keeps every rank's number of groups equal
            extra: dict[str, Any] = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
            if role in _GLOO_ROLES:
                extra["backend"] = "gloo"
            made = [dist.new_group(ranks=ranks, **extra) for ranks in partition]
            (mine,) = [group for group, ranks in zip(made, partition) if rank in ranks]
            self.groups[key] = [mine, 0]
        self.groups[key][1] += 1
        return self.groups[key][0]

    def release(self, layout: Layout) -> None:
        del self.meshes[layout]
        for role, partition in _partitions(layout).items():
            key = (role, tuple(map(tuple, partition)))
            self.groups[key][1] -= 1
            if self.groups[key][1] == 0:
                dist.destroy_process_group(self.groups.pop(key)[0])


_REGISTRIES: list[_Registry] = []  # at most one: the registry of the current default process group


def _registry() -> _Registry:
    """The registry of the current default group; a new, empty one after the group was re-initialised
    (``dist.destroy_process_group()`` already destroyed every subgroup of the old one)."""
    world = dist.group.WORLD
    if not _REGISTRIES or _REGISTRIES[0].world is not world:
        _REGISTRIES[:] = [_Registry(world)]
    return _REGISTRIES[0]
