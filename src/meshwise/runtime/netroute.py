"""Which of this machine's addresses and interfaces leads to the master: what gloo and NCCL must use.

gloo binds the address the host name resolves to and falls back to loopback, then advertises it to the
other nodes, which then connect to ``127.0.0.1`` and fail after a long timeout. The cure is to name the
interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); the right one is the interface holding the address
the kernel would use as source towards the master, found without sending a packet by ``connect()`` on a
UDP socket. On node 0 itself that route runs over ``lo`` (the master address is local), which is why the
interface is looked up by the *address*, not taken from the route.

Linux ``ioctl`` calls (SIOCGIFCONF, SIOCGIFFLAGS) list the interfaces, so no ``ip`` binary is needed.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

_SIOCGIFCONF = 0x8912
_SIOCGIFFLAGS = 0x8913
_IFF_LOOPBACK = 0x8
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16-byte name + 24-byte union
_MAX_INTERFACES = 256


@dataclass(frozen=True)
class Interface:
    """A network interface with an IPv4 address."""

    name: str
    address: str
    loopback: bool


def interfaces() -> list[Interface]:
    """Every interface of this machine (network namespace) that holds an IPv4 address, one per address."""
    buffer = array.array("B", bytes(_IFREQ_SIZE * _MAX_INTERFACES))
    pointer, _ = buffer.buffer_info()
    found: list[Interface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("iL", len(buffer), pointer)
        length = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request))[0]
        raw = buffer.tobytes()[:length]
        for offset in range(0, length, _IFREQ_SIZE):
            name = raw[offset : offset + 16].split(b"\0", 1)[0].decode()
            address = socket.inet_ntoa(raw[offset + 20 : offset + 24])
            flags_request = struct.pack("16sH", name.split(":")[0].encode(), 0)
            flags = struct.unpack("16sH", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, flags_request)[:18])[1]
            found.append(Interface(name.split(":")[0], address, bool(flags & _IFF_LOOPBACK)))
    return found


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def source_address(destination: str, port: int = 9) -> str:
    """The local address the kernel uses to reach ``destination`` (no packet is sent).

    Raises OSError (ENETUNREACH) when no route leads there.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((destination, port))
        return str(sock.getsockname()[0])


def interface_of(address: str, known: list[Interface] | None = None) -> Interface | None:
    """The interface holding ``address``, or None."""
    for interface in interfaces() if known is None else known:
        if interface.address == address:
            return interface
    return None


def describe(known: list[Interface]) -> str:
    """``10.231.0.1 on eth0, 127.0.0.1 on lo``: for messages that list what this machine has."""
    return ", ".join(f"{i.address} on {i.name}" for i in known) or "no IPv4 address at all"
