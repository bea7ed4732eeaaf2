"""One rank of the testbed: runs inside its node's namespace, under its own uid (see netns.py).

Started by run.py as ``ip netns exec <node> python worker.py '<json spec>'``. Talks to the parent
through stdout (one JSON object per line) and, on rank 0, stdin (the parent answers ``go`` once
it has (re)shaped the NICs for the next phase).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from datetime import timedelta


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def check_identity(uid: int, iface: str) -> None:
    """run.py starts each rank under its own uid (setpriv) so the node's ``uidrange`` policy rule
    routes the rank's cross-node sockets over its own NIC; refuse to run otherwise."""
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit(f"worker must run as uid {uid}, runs as {os.getuid()}/{os.geteuid()}")
    if not os.path.exists(f"/sys/class/net/{iface}"):
        raise SystemExit(f"no interface {iface}: not inside a testbed node namespace")


def nic_bytes(iface: str) -> tuple[int, int]:
    base = f"/sys/class/net/{iface}/statistics"
    with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


POST: list = []  # the post_exchange the instrumented ring calls: the library's, or split_post


def _split_directions(layouts, rank: int):
    """Experiment (``--split-directions``), not library behaviour: when a ring member's next and
    previous peer are the same rank (2-member inner ring, or 2 windows in the outer ring), send on
    one process group and receive on a twin group, so each TCP connection carries one direction.
    Creates the twin groups (collective) and returns a post_exchange replacement."""
    import torch
    import torch.distributed as dist

    comm = importlib.import_module("loongtrain.parallel.comm")
    twins = {}
    for layout in layouts:
        # whichever groups this library version passes to post_exchange (one context group, or
        # separate inner/outer ring groups)
        candidates = [*layout.context_groups()]
        for method in ("inner_ring_groups", "outer_ring_groups"):
            if hasattr(layout, method):
                candidates += getattr(layout, method)()
        for ranks in candidates:
            for kind in ("kv", "dkv"):
                key = (tuple(ranks), kind)
                if len(ranks) > 1 and key not in twins:
                    twins[key] = dist.new_group(list(ranks))
    library_post = comm.post_exchange

    def split_post(send, dst, src, group, kind):
        if dst != src:
            return library_post(send, dst, src, group, kind)
        twin = twins[(tuple(dist.get_process_group_ranks(group)), kind)]
        send_group, recv_group = (group, twin) if rank < dst else (twin, group)
        send = send.contiguous()
        received = torch.empty_like(send)
        comm._record(kind, {dst: send.numel() * send.element_size()})
        works = [dist.isend(send, dst, group=send_group), dist.irecv(received, src, group=recv_group)]
        return comm.Exchange(works, received)

    return split_post


def _instrument_waits(rank: int, per_node: int) -> Counter:
    """Accumulate the wall time this rank spends blocked on communication, by category: waiting
    for ring exchanges (``Exchange.wait``; ``kv``/``dkv``, to a peer on this node or the other)
    and inside head all-to-alls (synchronous). Timing wrappers only; ``total`` sums them."""
    from loongtrain.attn import ops, ring
    from loongtrain.parallel import comm

    blocked: Counter = Counter()

    def tagged_post(send, dst, src, group, kind):
        exchange = POST[0](send, dst, src, group, kind)
        where = "cross" if dst // per_node != rank // per_node else "intra"
        exchange.testbed_tag = f"{kind}-{where}"
        return exchange

    def timed_wait(self, _wait=comm.Exchange.wait):
        start = time.perf_counter()
        try:
            return _wait(self)
        finally:
            spent = time.perf_counter() - start
            blocked[getattr(self, "testbed_tag", "other")] += spent
            blocked["total"] += spent

    def timed_a2a(*args, _a2a=ops.all_to_all, **kwargs):
        start = time.perf_counter()
        try:
            return _a2a(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            blocked["a2a"] += spent
            blocked["total"] += spent

    POST[:] = [comm.post_exchange]
    ring.post_exchange = tagged_post
    comm.Exchange.wait = timed_wait
    ops.all_to_all = timed_a2a
    return blocked


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = spec["rank"], spec["world"]
    check_identity(spec["uid"], spec["iface"])
    os.environ["GLOO_SOCKET_IFNAME"] = spec["iface"]  # gloo's listener binds to this NIC's address
    sys.path.insert(0, spec["repo"])

    import torch
    import torch.distributed as dist

    from loongtrain.attn.api import attention
    from loongtrain.attn.kernel_choice import select_kernel
    from loongtrain.parallel.comm import CommCounter
    from loongtrain.parallel.mesh import init_mesh

    torch.set_num_threads(1)
    blocked = _instrument_waits(rank, spec["per_node"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec['master']}:{spec['port']}", rank=rank, world_size=world,
        timeout=timedelta(minutes=30),
    )
    per_node = spec["per_node"]
    seq, heads, kv_heads, head_dim = spec["seq_len"], spec["heads"], spec["kv_heads"], spec["head_dim"]
    dtype = getattr(torch, spec["dtype"])

    def calibrate(when: str) -> None:
        """Attention FLOP/s of one rank while all ranks compute at once (1 thread each)."""
        s_c = seq // world
        gen = torch.Generator().manual_seed(rank)
        q = torch.randn(1, heads, s_c, head_dim, generator=gen, dtype=dtype)
        k = torch.randn(1, kv_heads, s_c, head_dim, generator=gen, dtype=dtype)
        v = torch.randn_like(k)
        kernel = select_kernel(q.device, dtype, head_dim)
        scale = head_dim ** -0.5
        flops_per_call = 4 * s_c * s_c * heads * head_dim * 3.5  # forward + backward (2.5x)
        dist.barrier()
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < spec["calib_seconds"] or calls < 2:
            out, lse = kernel.forward(q, k, v, False, scale)
            kernel.backward(out, q, k, v, out, lse, False, scale)
            calls += 1
        flops = calls * flops_per_call / (time.perf_counter() - start)
        gathered = [None] * world
        dist.all_gather_object(gathered, flops)
        if rank == 0:
            emit(event="calibration", when=when, flops=gathered, kernel=kernel.name)

    calibrate("start")

    meshes = {  # collective: every rank builds every config's groups, once
        cfg["name"]: init_mesh(cfg["hp"], cfg["cp"], inner_ring=cfg["inner_ring"], placement=cfg["placement"])
        for cfg in spec["configs"]
    }
    split_post = None
    if any(phase.endswith("split") for phase in spec["phases"]):
        split_post = _split_directions([m.layout for m in meshes.values()], rank)
    library_post = POST[0]
    for phase in spec["phases"]:
        POST[0] = split_post if phase.endswith("split") else library_post
        if rank == 0:
            emit(event="ready", phase=phase)
            if sys.stdin.readline().strip() != "go":
                raise SystemExit("parent did not answer 'go'")
        dist.barrier()
        for cfg in spec["configs"]:
            if phase.startswith("shaped") and spec["recalibrate"]:
                # the machine's speed drifts with other load: measure again and let the parent
                # re-derive and re-apply the NIC rate before this config
                calibrate(f"config:{cfg['name']}")
                if rank == 0 and sys.stdin.readline().strip() != "go":
                    raise SystemExit("parent did not answer 'go'")
                dist.barrier()
            mesh = meshes[cfg["name"]]
            gen = torch.Generator().manual_seed(1234 + rank)
            local = seq // world
            q = torch.randn(1, local, heads, head_dim, generator=gen, dtype=dtype, requires_grad=True)
            k = torch.randn(1, local, kv_heads, head_dim, generator=gen, dtype=dtype, requires_grad=True)
            v = torch.randn(1, local, kv_heads, head_dim, generator=gen, dtype=dtype, requires_grad=True)
            grad = torch.randn(1, local, heads, head_dim, generator=gen, dtype=dtype)

            def step(q=q, k=k, v=v, grad=grad, mesh=mesh) -> None:
                out = attention(q, k, v, mesh)
                out.backward(grad)
                q.grad = k.grad = v.grad = None

            counter = CommCounter()
            with counter:
                step()  # warm-up 1, counted
            for _ in range(spec["warmup"] - 1):
                step()
            times, cpu_fracs, waits = [], [], []
            nic0 = nic_bytes(spec["iface"])
            for _ in range(spec["iters"]):
                dist.barrier()
                t0, c0, w0 = time.perf_counter(), time.process_time(), Counter(blocked)
                step()
                elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                waits.append({key: blocked[key] - w0[key] for key in blocked})
                slowest = torch.tensor([elapsed])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times.append(slowest.item())
                cpu_fracs.append(cpu / elapsed)
            nic1 = nic_bytes(spec["iface"])
            mine = rank // per_node
            by_peer = counter.bytes_by_peer
            emit(
                event="result", phase=phase, config=cfg["name"], rank=rank,
                median_s=statistics.median(times), times_s=times,
                cpu_frac=statistics.median(cpu_fracs),
                blocked_s=statistics.median(w.get("total", 0.0) for w in waits),
                blocked_by={key: statistics.median(w.get(key, 0.0) for w in waits) for key in blocked},
                intra_bytes=sum(b for p, b in by_peer.items() if p // per_node == mine),
                cross_bytes=sum(b for p, b in by_peer.items() if p // per_node != mine),
                kinds=dict(counter.bytes),
                nic_tx_per_iter=(nic1[0] - nic0[0]) / spec["iters"],
                nic_rx_per_iter=(nic1[1] - nic0[1]) / spec["iters"],
            )
    calibrate("end")  # how much the machine's speed drifted during the run
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
