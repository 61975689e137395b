"""Which addresses are this machine's own, and which network interface carries an address.

Libraries that listen for peers (gloo's pair sockets, Mooncake's transfer engine) take an interface
or bind every one; kvbaton binds to the host the operator chose, so it asks here which interface
that host's address is on.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`); a name is not: it may resolve to anything."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_of(host: str) -> str | None:
    """The name of the interface whose IPv4 address `host` is (or resolves to), or None if no interface has it.

    A loopback address other than an interface's own (127.0.0.2) is on the loopback interface."""
    try:
        address = ipaddress.IPv4Address("127.0.0.1" if host == "localhost" else socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            own = ipaddress.IPv4Address(raw[20:24])
            if own == address or (address.is_loopback and own.is_loopback):
                return name
    return None
