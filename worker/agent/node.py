"""What this node offers: processing units, accelerator, the address peers reach it at."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class NodeResources:
    units: int
    accelerator: str  # "cpu" or "cuda:<gpu name>"
    gpu_ids: tuple[int, ...]  # indexes of the visible GPUs (empty on a CPU node)
    cpus: int

    @property
    def is_cuda(self) -> bool:
        return bool(self.gpu_ids)


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def cuda_devices() -> tuple[int, str]:
    """The CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` applies) and the first
    one's name, asked of the driver library itself: the agent registers without importing torch
    (seconds of CPU), so it is up well under a second after it starts."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, ""  # no NVIDIA driver on this node
    if cuda.cuInit(0) != 0:
        return 0, ""  # a driver without a usable device (or a broken one)
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value <= 0:
        return 0, ""
    device = ctypes.c_int(0)
    name = ctypes.create_string_buffer(256)
    if cuda.cuDeviceGet(ctypes.byref(device), 0) != 0 or cuda.cuDeviceGetName(name, 256, device) != 0:
        return count.value, "GPU"
    return count.value, name.value.decode(errors="replace")


def detect_resources(slots: int, *, force_cpu: bool = False) -> NodeResources:
    """Visible CUDA GPUs as units; on a node without one (or with ``force_cpu``), ``slots`` CPU slots."""
    cpus = usable_cpus()
    if not force_cpu:
        try:
            count, name = cuda_devices()
        except Exception as exc:  # a broken driver means: no usable GPU
            log.warning("CUDA unavailable (%s): registering CPU slots", exc)
            count, name = 0, ""
        if count > 0:
            return NodeResources(count, f"cuda:{name}"[:64], tuple(range(count)), cpus)
    return NodeResources(max(1, slots), "cpu", (), cpus)


def address_towards(api_url: str) -> str:
    """The local address the kernel would use to reach the API host (no packet is sent)."""
    parts = urlsplit(api_url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            address: str = s.getsockname()[0]
            return address
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def interface_for(address: str) -> str | None:
    """The network interface holding the IPv4 ``address``, for GLOO/NCCL_SOCKET_IFNAME."""
    try:
        wanted = socket.inet_aton(socket.gethostbyname(address))
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if raw[20:24] == wanted:
                return name
    return None
