"""A cluster of "nodes" on one Linux machine: network namespaces joined through a bridge.

    with Cluster(nodes=2, rate="100mbit") as c:
        p = c.popen(0, ["python", ...])       # runs inside node 0's namespace
        c.counters()                          # bytes each node sent / received so far

Node ``i`` is the namespace ``ltc<i>`` with one veth, renamed ``IFNAME`` inside and given
``10.213.0.<i+1>/24``; its peer ``ltch<i>`` sits on the bridge ``ltbr0`` in the host namespace.
Every byte between nodes crosses two veths and the bridge; ranks of one node share their
namespace and talk over its loopback (gloo connects to a peer's address, and a peer in the same
namespace owns that address, so the kernel delivers it locally without touching the veth).

Shaping: a token-bucket filter (``tc qdisc ... tbf``) at ``rate`` on both ends of each veth, so
a node sends and receives at ``rate`` (a full-duplex NIC). ``delay`` needs ``netem``, which some
kernels lack; :class:`ClusterError` says so. Counters are read from the host-side veth
(``/sys/class/net/ltch<i>/statistics``): what it receives the node sent; the namespace's
loopback counters show the intra-node traffic.

Everything this module creates carries the ``ltc`` / ``ltbr`` prefixes; :func:`teardown` removes
all of it (and is run first, so a set-up left by a crashed run is cleared).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

BRIDGE = "ltbr0"
NS = "ltc{}"
HOST_VETH = "ltch{}"
IFNAME = "lt0"  # the node's interface inside its namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.213.0.{}"
LOCK = "/run/leantrain-cluster.lock"


class ClusterError(RuntimeError):
    """The cluster cannot be set up here; the message says why in one sentence."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r


def _tc(*args: str) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        msg = r.stderr.strip()
        if "netem" in args and "unknown" in msg.lower():
            raise ClusterError("this kernel has no netem qdisc (sch_netem), so links cannot be given a "
                               "delay; run without --delay")
        raise ClusterError(f"`tc {' '.join(args)}` failed: {msg}")


def check_rights() -> None:
    """Raise :class:`ClusterError` unless this process can make namespaces and shape links."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` is not installed (apt-get install iproute2); the cluster needs it")
    if os.geteuid() != 0:
        raise ClusterError("the namespace cluster needs root (network namespaces and tc); "
                           "run it as root, or use --local for plain torchrun on this host")
    probe = "ltcprobe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        raise ClusterError(f"cannot create network namespaces here ({r.stderr.strip()}); "
                           "run as root on a Linux host, or use --local")
    _ip("netns", "del", probe, check=False)


def rate_bps(rate: str | None) -> float | None:
    """``"100mbit"`` -> 1e8 bits/s; ``None`` / ``"unshaped"`` -> None."""
    if rate in (None, "", "unshaped", "none"):
        return None
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise ClusterError(f"rate {rate!r} is not like 100mbit, 1gbit or 500kbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def teardown() -> None:
    """Remove every namespace, veth and bridge this module may have made (idempotent)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if re.fullmatch(r"ltc\d+|ltcprobe", name):
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"\d+:\s+(ltch\d+|ltbr\d+)[@:]", line)
        if m:
            _ip("link", "del", m.group(1), check=False)


class Cluster:
    """``nodes`` namespaces on a bridge, links shaped to ``rate`` (None: unshaped)."""

    def __init__(self, nodes: int, rate: str | None = None, delay: str | None = None, mtu: int = 1500):
        self.nodes, self.rate, self.delay, self.mtu = nodes, rate, delay, mtu

    def addr(self, node: int) -> str:
        return SUBNET.format(node + 1)

    def __enter__(self) -> Cluster:
        check_rights()
        # one cluster a host: the names are fixed, and set-up clears what another run left
        self._lock = open(LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ClusterError(f"another cluster run holds {LOCK}; wait for it to finish") from None
        teardown()
        try:
            self._setup()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            teardown()
        finally:
            self._lock.close()

    def set_rate(self, rate: str | None) -> None:
        """Shape every link to ``rate`` from now on (None: unshaped), e.g. between two phases of a
        run; packets queued at the change may be dropped (TCP sends them again)."""
        self.rate = rate
        for i in range(self.nodes):
            self._shape(IFNAME, NS.format(i), replace=True)
            self._shape(HOST_VETH.format(i), None, replace=True)

    def _shape(self, dev: str, ns: str | None, replace: bool = False) -> None:
        pre = ["-n", ns] if ns else []
        if rate_bps(self.rate) is None and not self.delay:
            if replace:  # back to the device's default (no qdisc of ours)
                subprocess.run(["tc", *pre, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            return
        if self.delay:
            spec = ["netem", "delay", self.delay] + (["rate", self.rate] if rate_bps(self.rate) else [])
        else:
            bps = rate_bps(self.rate)
            # burst: at least 10 ms of traffic (tbf needs rate/HZ at the very least); queue: 100 ms
            burst = max(64 * 1024, int(bps / 8 * 0.01))
            spec = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        _tc(*pre, "qdisc", "replace", "dev", dev, "root", *spec)

    def _setup(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("link", "set", BRIDGE, "up")
        for i in range(self.nodes):
            ns, host, tmp = NS.format(i), HOST_VETH.format(i), f"ltcn{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", host, "mtu", str(self.mtu), "type", "veth", "peer", "name", tmp, "mtu", str(self.mtu))
            _ip("link", "set", tmp, "netns", ns)
            _ip("-n", ns, "link", "set", tmp, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", host, "master", BRIDGE)
            _ip("link", "set", host, "up")
            self._shape(IFNAME, ns)  # what the node sends
            self._shape(host, None)  # what the node receives

    def popen(self, node: int, argv: list[str], env: dict, **kw) -> subprocess.Popen:
        """``argv`` inside node ``node``'s namespace, in a session of its own (killed as a group)."""
        return subprocess.Popen(["ip", "netns", "exec", NS.format(node), *argv], env=env,
                                start_new_session=True, **kw)

    def counters(self) -> list[dict]:
        """Per node, cumulative: ``tx_bytes`` / ``rx_bytes`` the node sent / received on its link, and
        ``lo_bytes`` its ranks sent one another over the namespace's loopback."""
        out = []
        for i in range(self.nodes):
            d = Path(f"/sys/class/net/{HOST_VETH.format(i)}/statistics")
            lo = json.loads(_ip("-n", NS.format(i), "-j", "-s", "link", "show", "lo").stdout)[0]["stats64"]
            # the host end's rx is the node's tx
            out.append({"tx_bytes": int((d / "rx_bytes").read_text()), "rx_bytes": int((d / "tx_bytes").read_text()),
                        "lo_bytes": int(lo["tx"]["bytes"])})
        return out
