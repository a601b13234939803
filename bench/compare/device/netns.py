"""Two network namespaces joined by a veth pair, without iproute2 (pyroute2)."""
from pyroute2 import IPRoute, NetNS, netns
for n in ("mcb-a", "mcb-b"):
    netns.create(n)
ip = IPRoute()
ip.link("add", ifname="mcba", kind="veth", peer="mcbb")
for ifn, ns in (("mcba", "mcb-a"), ("mcbb", "mcb-b")):
    ip.link("set", index=ip.link_lookup(ifname=ifn)[0], net_ns_fd=ns)
for name, ifn, addr in (("mcb-a", "mcba", "10.77.0.1"), ("mcb-b", "mcbb", "10.77.0.2")):
    ns = NetNS(name)
    i = ns.link_lookup(ifname=ifn)[0]
    ns.addr("add", index=i, address=addr, prefixlen=24)
    ns.link("set", index=i, state="up")
    ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
    ns.close()
print("netns ok")
