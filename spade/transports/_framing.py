"""Helpers shared by the cross-node transports (``ucx``, ``nixl``).

Nothing here imports an optional package. What lives here:

* ``tag_id``: a stable 32-bit id per tag name (the same in every process, unlike
  ``hash(str)``, which Python salts per process).
* A binary message header (tag id, sequence number, tensor layout) for
  transports that must tell the receiver what follows (``ucx``).
* Length-prefixed JSON frames for the TCP side channel of ``nixl``.
* ``Poller``/``wait_event``: polling integrated with asyncio that spins only
  briefly, then sleeps, so an idle link does not burn a core.
* Layout checks with one-line ``TransportError`` messages.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import time
import zlib
from typing import Any, Callable, Sequence

import torch

from spade.errors import PeerTimeout, TransportError

# --------------------------------------------------------------------------- dtypes
#: Wire codes of the dtypes a transport carries. Append only (codes are on the wire).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
}
for _name, _code in (("float8_e4m3fn", 11), ("float8_e5m2", 12)):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}

Layout = list[tuple[tuple[int, ...], torch.dtype]]


def tag_id(tag: str) -> int:
    """Stable 32-bit id of a tag name (CRC-32 of its UTF-8 bytes)."""
    return zlib.crc32(tag.encode("utf-8")) & 0xFFFFFFFF


def layout_of(tensors: Sequence[torch.Tensor]) -> Layout:
    return [(tuple(int(s) for s in t.shape), t.dtype) for t in tensors]


def layout_str(layout: Layout) -> str:
    return "[" + ", ".join(f"{list(s)} {str(d).removeprefix('torch.')}" for s, d in layout) + "]"


def layout_to_json(layout: Layout) -> list:
    return [[list(s), str(d).removeprefix("torch.")] for s, d in layout]


def layout_from_json(obj: list) -> Layout:
    out: Layout = []
    for shape, dtype in obj:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise TransportError(f"peer sent unknown dtype {dtype!r}")
        out.append((tuple(int(s) for s in shape), dt))
    return out


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def check_layout(tag: str, expected: Layout, tensors: Sequence[torch.Tensor], what: str) -> None:
    """Raise ``TransportError`` unless ``tensors`` match ``expected`` exactly."""
    got = layout_of(tensors)
    if got != expected:
        raise TransportError(
            f"tag {tag!r}: {what} {layout_str(got)} do not match the message {layout_str(expected)}"
        )


def check_sendable(tag: str, tensors: Sequence[torch.Tensor]) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TransportError(f"tag {tag!r}: send takes a list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TransportError(f"tag {tag!r}: item {i} is a {type(t).__name__}, not a tensor")
        if t.dtype not in DTYPE_CODES:
            raise TransportError(f"tag {tag!r}: tensor {i} has dtype {t.dtype}, which no transport carries")


def alloc(layout: Layout, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in layout]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (bf16/fp8 have no numpy dtype)."""
    if not t.is_contiguous():
        raise TransportError("transports need contiguous tensors (call .contiguous() first)")
    return t.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- header
_MAGIC = b"SPDT"
_HEAD = struct.Struct("<4sHHIQIH")  # magic, version, flags, tag id, seq, payload bytes, n tensors
_DIM = struct.Struct("<BB")  # dtype code, ndim
#: Largest header (bytes); layouts that need more are refused with a clear error.
HEADER_CAP = 4096
#: Flag: the payload of every tensor follows the header in the same message.
FLAG_INLINE = 1


def pack_header(version: int, tid: int, seq: int, tensors: Sequence[torch.Tensor], flags: int = 0,
                payload: int = 0) -> bytearray:
    parts = [_HEAD.pack(_MAGIC, version, flags, tid, seq, payload, len(tensors))]
    for t in tensors:
        parts.append(_DIM.pack(DTYPE_CODES[t.dtype], t.dim()))
        parts.append(struct.pack(f"<{t.dim()}q", *t.shape))
    out = bytearray(b"".join(parts))
    if len(out) > HEADER_CAP:
        raise TransportError(f"message layout needs a {len(out)}-byte header (cap {HEADER_CAP}); "
                             "send fewer or lower-rank tensors per message")
    return out


def unpack_header(buf: memoryview | bytes) -> tuple[int, int, int, int, int, Layout, int]:
    """-> (version, flags, tag id, seq, payload bytes, layout, header length)."""
    magic, version, flags, tid, seq, payload, n = _HEAD.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise TransportError("corrupt message header from peer (bad magic); is the peer a spade transport?")
    off = _HEAD.size
    layout: Layout = []
    for _ in range(n):
        code, ndim = _DIM.unpack_from(buf, off)
        off += _DIM.size
        shape = struct.unpack_from(f"<{ndim}q", buf, off)
        off += 8 * ndim
        if code not in CODE_DTYPES:
            raise TransportError(f"peer sent unknown dtype code {code}")
        layout.append((tuple(shape), CODE_DTYPES[code]))
    return version, flags, tid, seq, payload, layout, off


# --------------------------------------------------------------------------- side channel frames
_FRAME = struct.Struct(">II")  # json bytes, blob bytes
MAX_FRAME = 1 << 30


def encode_frame(obj: dict, blob: bytes = b"") -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _FRAME.pack(len(body), len(blob)) + body + bytes(blob)


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict, bytes]:
    """Read one frame; raises ``asyncio.IncompleteReadError`` on EOF."""
    head = await reader.readexactly(_FRAME.size)
    n, m = _FRAME.unpack(head)
    if n > MAX_FRAME or m > MAX_FRAME:
        raise TransportError("corrupt side-channel frame from peer")
    body = await reader.readexactly(n)
    blob = await reader.readexactly(m) if m else b""
    return json.loads(body), blob


# --------------------------------------------------------------------------- polling
class Backoff:
    """Polling cadence: spin (``sleep(0)``) for ``spin_s`` after the last progress,
    then sleep ``min_sleep_s`` doubling up to ``max_sleep_s``.

    asyncio cannot sleep less than about 1 ms when nothing else is runnable (the
    selector timeout has ms resolution), so the spin phase is what keeps latency
    low while a message is expected; the sleep phase keeps an idle link cheap.
    """

    def __init__(self, spin_s: float = 2e-3, min_sleep_s: float = 1e-3, max_sleep_s: float = 8e-3):
        self.spin_s, self.min_sleep_s, self.max_sleep_s = spin_s, min_sleep_s, max_sleep_s
        self._last = time.perf_counter()
        self._sleep = min_sleep_s

    def progressed(self) -> None:
        self._last = time.perf_counter()
        self._sleep = self.min_sleep_s

    def next_delay(self, busy: bool, hot: bool = False) -> float:
        """0 to spin, else how long to sleep. ``hot``: a transfer of ours is in
        flight (spin until it is done); ``busy``: a caller waits (spin ``spin_s``
        after the last progress, then poll every ``min_sleep_s``); neither: idle
        (sleep, doubling up to ``max_sleep_s``)."""
        if hot:
            return 0.0
        if busy:
            return 0.0 if time.perf_counter() - self._last < self.spin_s else self.min_sleep_s
        d = self._sleep
        self._sleep = min(self._sleep * 2, self.max_sleep_s)
        return d


async def wait_cuda_event(ev: "torch.cuda.Event", deadline: float | None = None) -> None:
    """Wait for a CUDA event without blocking the event loop (poll + back off)."""
    bo = Backoff(spin_s=5e-4)
    while not ev.query():
        if deadline is not None and time.monotonic() > deadline:
            raise PeerTimeout("timed out waiting for the GPU to finish producing a tensor")
        await asyncio.sleep(bo.next_delay(busy=True))


def record_event(device: torch.device) -> "torch.cuda.Event | None":
    """An event on ``device``'s current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


async def stream_ready(tensors: Sequence[torch.Tensor], deadline: float | None = None) -> None:
    """Wait (without blocking the loop) until the current stream of every CUDA device
    among ``tensors`` has finished the work queued so far: what a transport reading or
    writing those tensors behind the stream's back must wait for."""
    devs = {t.device for t in tensors if t.is_cuda}
    for d in devs:
        ev = record_event(d)
        if ev is not None:
            await wait_cuda_event(ev, deadline)


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# --------------------------------------------------------------------------- sockets
async def wait_port_open(host: str, port: int, deadline: float | None, what: str) -> None:
    """Poll until a TCP connection to host:port succeeds (the listener is up).

    Used before handing the address to a library that logs loudly on refusal."""
    delay = 0.02
    while True:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=2.0)
            w.close()
            try:
                await w.wait_closed()
            except OSError:
                pass
            return
        except (OSError, asyncio.TimeoutError):
            if deadline is not None and time.monotonic() + delay > deadline:
                raise PeerTimeout(f"{what}: nothing listens on {host}:{port} (is the peer rank running?)") from None
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)


def port_in_use(port: int) -> str | None:
    """Bind probe: the OS's reason when TCP ``port`` cannot be listened on here (another
    socket holds it), else None. Binds every interface with SO_REUSEADDR, as the ucx and
    nixl listeners do, so a closed link's TIME_WAIT does not count as in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", int(port)))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise ``TransportError`` when ``port`` is taken, before anything connects to it:
    a peer that connects to whatever holds the port gets resets and garbage frames."""
    why = port_in_use(port)
    if why is not None:
        raise TransportError(f"{what}: port {port} in use on {host}: pick another with runtime.transport.port "
                             f"({why})")


EPHEMERAL_DEFAULT = (32768, 60999)
"""Linux's default range of outgoing connections' source ports (when /proc does not say)."""
PORT_FLOOR = 20000
"""``free_port`` draws from ``[PORT_FLOOR, 65536)`` minus the ephemeral range."""


def ephemeral_range() -> tuple[int, int]:
    """The OS's range of source ports for outgoing connections, inclusive."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return port_in_use(port) is None


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A TCP port ``p`` with ``p .. p + span - 1`` free right now (tests, examples, a healed
    link's new ports). Drawn at random outside the OS's ephemeral range where there is room:
    a port from that range can become an outgoing connection's source port before its
    listener binds it, on loopback even through the peer's own early connect to it (a TCP
    self-connect, which then holds the port). Falls back to a port the OS picks."""
    lo, hi = ephemeral_range()
    pools = [(a, b - span + 1) for a, b in ((PORT_FLOOR, lo), (hi + 1, 65536)) if b - span + 1 > a]
    sizes = [b - a for a, b in pools]
    rng = random.SystemRandom()  # not the tests' seeded ``random``: two processes must not draw alike
    for attempt in range(128):
        if pools and attempt < 64:
            a, b = rng.choices(pools, weights=sizes)[0]
            p = rng.randrange(a, b)
        else:  # no room outside the range, or nothing free there: a port the OS picks
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                p = s.getsockname()[1]
        if p + span <= 65536 and all(_bindable(host, p + i) for i in range(span)):
            return p
    raise OSError(f"no {span} free consecutive TCP ports found on {host}")


def call_quietly(fn: Callable[[], Any]) -> None:
    """Run a best-effort cleanup step; errors there must not mask the real one."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - cleanup is best effort by design
        pass
