"""Build and tear down the emulated two-node cluster (network namespaces, veth "NICs", tc shaping).

Topology (``N`` nodes x ``P`` rank slots, default 2 x 4)::

    lt-node0                      lt-fabric                      lt-node1
    ---------                     ----------                     ---------
    lo  (intra-node, unshaped)    bridge ltsw                    lo  (intra-node, unshaped)
    nic0 10.77.0.1 <-- veth --> n0p0  ...  n1p0 <-- veth --> nic0 10.77.1.1
    nic1 10.77.0.2 <-- veth --> n0p1  ...  n1p1 <-- veth --> nic1 10.77.1.2
    ...                                                          ...

* Every rank slot ``s`` of node ``n`` owns one veth pair, its "NIC": ``nic{s}`` inside the node
  namespace, ``n{n}p{s}`` a port of a plain L2 bridge in the fabric namespace (a non-blocking
  "switch"). The rank's address ``10.77.{n}.{s+1}/32`` sits on its own NIC.
* Intra-node traffic: every address of a node is local to that namespace, so rank-to-rank
  traffic inside a node goes over the namespace's loopback and is never shaped.
* Cross-node traffic leaves through the *sender's* NIC: gloo does not bind its outgoing
  sockets (it only binds the listener), so the kernel picks the route, and a destination-only
  route would send every rank through the same NIC. Each rank therefore runs under its own
  uid and a policy rule ``uidrange <uid> lookup <table>`` selects a table whose only route to
  the other node is ``dev nic{s} src 10.77.{n}.{s+1}``. Accepted sockets inherit the
  listener's uid, so both directions of every connection follow the rule of the process that
  owns that end.
* It arrives through the *receiver's* NIC: the bridge delivers by MAC, and ``arp_ignore=1``
  makes only the NIC that holds an address answer ARP for it.
* Shaping per NIC: transmit = node-side egress, receive = fabric-port egress towards the node,
  each a ``tbf`` at the NIC rate: full duplex, like a real NIC. Optional one-way delay with
  ``netem`` where the kernel has it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

PREFIX = "lt"
FABRIC = f"{PREFIX}-fabric"
BRIDGE = "ltsw"
UID_BASE = 47000  # rank r runs as uid/gid UID_BASE + r
TABLE_BASE = 100  # routing table of slot s: TABLE_BASE + s


@dataclass(frozen=True)
class Topology:
    nodes: int = 2
    per_node: int = 4

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def node_ns(self, node: int) -> str:
        return f"{PREFIX}-node{node}"

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def slot_of(self, rank: int) -> int:
        return rank % self.per_node

    def nic(self, rank: int) -> str:
        return f"nic{self.slot_of(rank)}"

    def port(self, rank: int) -> str:
        return f"n{self.node_of(rank)}p{self.slot_of(rank)}"

    def address(self, rank: int) -> str:
        return f"10.77.{self.node_of(rank)}.{self.slot_of(rank) + 1}"

    def subnet(self, node: int) -> str:
        return f"10.77.{node}.0/24"

    def uid(self, rank: int) -> int:
        return UID_BASE + rank


def sh(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc


def existing_namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def teardown(topo: Topology | None = None) -> list[str]:
    """Delete every namespace this testbed creates (and with them their veths). Idempotent."""
    topo = topo or Topology()
    ours = {FABRIC, *(topo.node_ns(n) for n in range(topo.nodes))}
    removed = []
    for name in existing_namespaces():
        if name in ours or name.startswith(f"{PREFIX}-node"):
            sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _sysctls(ns: str, values: dict[str, str]) -> None:
    for key, value in values.items():
        sh("sysctl", "-q", "-w", f"{key}={value}", ns=ns)


def setup(topo: Topology, rate_bps: float, delay_ms: float = 0.0) -> None:
    """Create namespaces, NICs, bridge, addresses, routes, policy rules and shaping."""
    teardown(topo)
    sh("ip", "netns", "add", FABRIC)
    sh("ip", "link", "set", "lo", "up", ns=FABRIC)
    sh("ip", "link", "add", BRIDGE, "type", "bridge", ns=FABRIC)
    sh("ip", "link", "set", BRIDGE, "up", ns=FABRIC)
    for node in range(topo.nodes):
        ns = topo.node_ns(node)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
        # only the NIC holding an address answers ARP for it; no reverse-path filtering on the
        # asymmetric multi-NIC routes; no TCP slow start after idle periods
        _sysctls(ns, {
            "net.ipv4.conf.all.arp_ignore": "1",
            "net.ipv4.conf.all.arp_announce": "2",
            "net.ipv4.conf.all.rp_filter": "0",
            "net.ipv4.conf.default.rp_filter": "0",
            "net.ipv4.conf.default.arp_ignore": "1",
            "net.ipv4.conf.default.arp_announce": "2",
            # an RDMA NIC does not restart from a small window after each compute phase
            "net.ipv4.tcp_slow_start_after_idle": "0",
        })
    for rank in range(topo.world):
        node, slot = topo.node_of(rank), topo.slot_of(rank)
        ns, nic, port = topo.node_ns(node), topo.nic(rank), topo.port(rank)
        sh("ip", "link", "add", nic, "netns", ns, "type", "veth", "peer", "name", port, "netns", FABRIC)
        sh("ip", "link", "set", port, "master", BRIDGE, ns=FABRIC)
        sh("ip", "link", "set", port, "up", ns=FABRIC)
        sh("ip", "addr", "add", f"{topo.address(rank)}/32", "dev", nic, ns=ns)
        sh("ip", "link", "set", nic, "up", ns=ns)
        table = str(TABLE_BASE + slot)
        for other in range(topo.nodes):
            if other == node:
                continue
            sh("ip", "route", "add", topo.subnet(other), "dev", nic, "src", topo.address(rank),
               "table", table, ns=ns)
            if slot == 0:  # processes without a rule of their own (none in a run) use NIC 0
                sh("ip", "route", "add", topo.subnet(other), "dev", nic, "src", topo.address(rank), ns=ns)
        uid = str(topo.uid(rank))
        sh("ip", "rule", "add", "pref", str(1000 + rank), "uidrange", f"{uid}-{uid}", "lookup", table, ns=ns)
    shape(topo, rate_bps, delay_ms)


def _tbf(rate_bps: float) -> list[str]:
    """A tbf with ~4 ms of burst (at least 16 KiB) and a short queue (~10 ms of data, at least the
    burst plus 4 packets). A long queue delays the ACKs of a transfer coming the other way behind
    queued data. Measured (one TCP connection, 2 MiB each way at once, 20 Mbit/s NIC): per
    direction 69% of the rate with 0.5 s of queue, 73% with 50 ms, 94% with 10 ms; at 4.3 Mbit/s,
    1 MiB each way: 70% / 94% / 92%."""
    rate_bytes = rate_bps / 8
    burst = max(16 * 1024, int(rate_bytes / 250))
    limit = max(burst + 4 * 1514, int(rate_bytes * 0.01))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def shape(topo: Topology, rate_bps: float, delay_ms: float = 0.0) -> None:
    """(Re)apply per-NIC shaping: tx on the node side, rx on the fabric side, ``tbf`` at ``rate_bps``.

    ``delay_ms > 0`` adds a one-way ``netem`` delay on transmit; kernels built without netem (like
    the one this testbed was written on) reject it with a clear error.
    """
    for rank in range(topo.world):
        ns, nic, port = topo.node_ns(topo.node_of(rank)), topo.nic(rank), topo.port(rank)
        sh("tc", "qdisc", "del", "dev", nic, "root", ns=ns, check=False)
        sh("tc", "qdisc", "del", "dev", port, "root", ns=FABRIC, check=False)
        if rate_bps <= 0:
            continue
        if delay_ms > 0:
            proc = sh("tc", "qdisc", "add", "dev", nic, "root", "handle", "1:", "netem", "delay",
                      f"{delay_ms}ms", "limit", "100000", ns=ns, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"--delay-ms needs the netem qdisc, missing in this kernel: {proc.stderr}")
            sh("tc", "qdisc", "add", "dev", nic, "parent", "1:1", "handle", "10:", *_tbf(rate_bps), ns=ns)
        else:
            sh("tc", "qdisc", "add", "dev", nic, "root", "handle", "1:", *_tbf(rate_bps), ns=ns)
        sh("tc", "qdisc", "add", "dev", port, "root", "handle", "1:", *_tbf(rate_bps), ns=FABRIC)


def nic_counters(topo: Topology) -> dict[int, tuple[int, int]]:
    """(tx_bytes, rx_bytes) of every rank's NIC, read from the node namespaces."""
    out = {}
    for rank in range(topo.world):
        ns, nic = topo.node_ns(topo.node_of(rank)), topo.nic(rank)
        text = sh("cat", f"/sys/class/net/{nic}/statistics/tx_bytes",
                  f"/sys/class/net/{nic}/statistics/rx_bytes", ns=ns).stdout.split()
        out[rank] = (int(text[0]), int(text[1]))
    return out
