"""The gateway's port: one gateway per address, and who else listens there.

Each worker accepts on its own SO_REUSEPORT socket, so the kernel spreads new connections
evenly over them. The same option would let any other process of the same user join the group
(a second Velox started by mistake, a server with `reuseport`): the kernel then hands it a share
of the connections and nothing says so. So, before the gateway's sockets exist, `in_use` binds
the address once WITHOUT SO_REUSEPORT (with SO_REUSEADDR, so connections of a previous run in
TIME_WAIT do not count): that bind fails while anything listens on the address, however it was
bound, and the gateway refuses to start (`listeners` raises SystemExit naming the port).

`listeners` makes one listening socket per worker; the supervisor keeps them for its whole life
and each worker inherits its own (velox.supervisor). That is what lets a reload's new worker
start accepting only when it is ready, on the socket the old worker accepted on: no socket of
its own, so nothing it could take a share with or drop a backlog of. A program that binds the
port with SO_REUSEPORT after the gateway started is not refused by the kernel; `velox doctor`
finds it with `holders`, from /proc (Linux).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from pathlib import Path

# Connections queued per worker socket before the kernel drops SYNs (somaxconn caps it).
BACKLOG = 4096
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def in_use(host: str, port: int) -> OSError | None:
    """Why host:port cannot be bound by a lone socket (None: nothing listens there)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR only: TIME_WAIT leftovers pass, any listener (SO_REUSEPORT or not) fails.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


def _reuseport_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening SO_REUSEPORT sockets on host:port (port 0: one the kernel picks), or
    SystemExit with a message naming the address when it is taken or cannot be bound."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    error = in_use(host, port) if port else None
    if error is not None:
        raise SystemExit(_refusal(where, error))
    made: list[socket.socket] = []
    try:
        for _ in range(count):
            made.append(_reuseport_socket(host, port))
            port = made[0].getsockname()[1]  # VELOX_PORT=0: the rest join the picked port
    except OSError as exc:
        for sock in made:
            sock.close()
        raise SystemExit(_refusal(where, exc)) from None
    return made


def _refusal(where: str, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return (f"velox: cannot listen on {where}: another process is already listening on "
                f"port {where.rpartition(':')[2]} there (another Velox?); it would take a share "
                f"of the connections. Stop it, or set VELOX_PORT (or VELOX_HOST) to a free "
                f"address")
    return (f"velox: cannot listen on {where} (VELOX_HOST/VELOX_PORT): "
            f"{error.strerror or error}")


# --- who listens: /proc (Linux) ---------------------------------------------------------------


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {_plain(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos}


def _plain(ip: ipaddress.IPv4Address | ipaddress.IPv6Address
           ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _proc_address(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(words))


def listening_inodes(host: str, port: int) -> set[int]:
    """Socket inodes listening on `port` at an address that overlaps host's (the same address,
    or either side the wildcard). Empty where /proc/net is not readable."""
    ours = _addresses(host)
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            hexaddr, _, hexport = fields[1].partition(":")
            if int(hexport, 16) != port:
                continue
            addr = _proc_address(hexaddr)
            if addr.is_unspecified or any(a.is_unspecified or a == addr for a in ours):
                found.add(int(fields[9]))
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (empty if it cannot be read)."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rpartition(")")[2].split()[1])


def process_name(pid: int) -> str:
    """The kernel's name of the process (its `comm`: never its arguments, which may hold a
    secret)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


def holders(host: str, port: int) -> list[int]:
    """The processes listening on host:port, one per program: a child holding only sockets its
    parent holds too (a Velox worker: its supervisor keeps every worker's socket) counts as its
    parent. More than one means the connections are being shared between programs. Only
    processes this user may inspect are seen."""
    inodes = listening_inodes(host, port)
    if not inodes:
        return []
    held: dict[int, set[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (mine := socket_inodes(int(name)) & inodes):
            held[int(name)] = mine
    return sorted(pid for pid, mine in held.items()
                  if not mine <= held.get(_parent(pid), set()))
