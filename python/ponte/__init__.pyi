"""Type stubs for the ponte module (python/src/*.cc binds them; docstrings there and in README)."""
from enum import IntEnum
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple, Union

import numpy as np

BytesLike = Union[bytes, bytearray, memoryview]
Pages = Union[Sequence[int], np.ndarray]
# numpy arrays, bytearray, memoryview, or a contiguous CPU torch.Tensor (not a lazily negated or
# conjugated view: call .resolve_neg() / .resolve_conj() first). Memory a call writes (out, recv_x,
# recv_count, recv) must not require grad while autograd records: the write is outside autograd.
# The call bumps such a tensor's version counter, as torch's in-place ops do, so a backward pass
# through values it overwrote raises instead of using them. Registered memory (Engine.register:
# what peers write, and what Engine.read fills) is not tracked that way.
Memory = Any

class Code(IntEnum):
    """The engine's error codes, as ``ponte.Error.code``."""
    OK: int
    INVALID_ARGUMENT: int
    NOT_FOUND: int
    UNAVAILABLE: int
    AGAIN: int
    PEER_DEAD: int
    TIMEOUT: int
    TRANSPORT: int
    RESOURCE: int
    CANCELLED: int
    INTERNAL: int

class Error(RuntimeError):
    """An engine failure: ``code`` (a Code) and the engine's ``message``."""
    code: Code
    message: str

class Operation:
    """One asynchronous engine operation; it ends exactly once, within the engine's timeout."""
    def done(self) -> bool:
        """Whether it has ended (successfully or not); never blocks."""
    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Waits with the GIL released; raises Error on failure, TimeoutError when timeout_s passed first."""

def wait_all(ops: Iterable[Operation], timeout_s: Optional[float] = None) -> None:
    """Waits for every operation; raises the first failure (Error) once all ended, or TimeoutError."""

class Region:
    """Memory registered with an engine; keeps the registered object alive until closed."""
    @property
    def nbytes(self) -> int:
        """Size in bytes."""
    @property
    def obj(self) -> Optional[Memory]:
        """The registered object (None once closed)."""
    @property
    def closed(self) -> bool:
        """Whether close() ran."""
    def descriptor(self) -> bytes:
        """Versioned bytes a peer passes as ``remote``."""
    def close(self) -> None:
        """Waits for operations using it, deregisters, releases the object."""
    def __enter__(self) -> "Region": ...
    def __exit__(self, *args: Any) -> None: ...
    def __len__(self) -> int: ...

ScatterTarget = Tuple[int, int, int, BytesLike, int]  # (peer, src_offset, nbytes, remote, remote_offset)

class Engine:
    """ponte's RDMA engine (one host-memory NIC group), configured by PONTE_* variables.

    idle_wake=True (PONTE_IDLE_WAKE=1): an idle engine's worker also wakes for data arriving, so
    that peers' writes into an engine that waits for nothing move at once on a provider that needs
    the target's progress (tcp;ofi_rxm), at some cost to small messages' latency there.

    progress_cores=[c] (PONTE_PROGRESS_CORES=c): the engine's worker runs on core c ([] unpinned).
    On shm the worker posts every operation, and a thread that submits and waits on core c takes
    turns with it: keep such threads off it (os.sched_setaffinity) where cores are few. Elsewhere a
    waiting thread polls and posts itself. README, "Python".

    An engine belongs to the process that created it: in a fork() child (its threads stayed in the
    parent) every call raises ponte.Error with Code.UNAVAILABLE, and closing it there leaves the
    parent's engine alone. A child that needs RDMA creates its own.
    """
    def __init__(self, *, backend: str = ..., provider: str = ..., nics: int = ..., timeout_ms: int = ...,
                 stripe_min: int = ..., spin_us: int = ..., ctrl_addr: str = ..., idle_wake: bool = ...,
                 progress_cores: Sequence[int] = ...) -> None: ...
    @property
    def backend(self) -> str:
        """'fabric' or 'verbs'."""
    @property
    def nics(self) -> int:
        """NICs in the group."""
    @property
    def timeout_ms(self) -> int:
        """The engine's operation timeout."""
    @property
    def closed(self) -> bool:
        """Whether close() ran."""
    def address(self) -> bytes:
        """This engine's address, for a peer's connect()."""
    def connect(self, addr: BytesLike) -> int:
        """Starts connecting; returns the peer id at once."""
    def peers(self) -> list[int]:
        """Peers that connected to this engine."""
    def peer_ready(self, peer: int) -> bool:
        """Whether the handshake with peer completed."""
    def peer_dead(self, peer: int) -> bool:
        """Whether nothing more will come from peer."""
    def register(self, buf: Memory) -> Region:
        """Registers writable contiguous memory (numpy, bytearray, CPU torch tensor)."""
    def write(self, peer: int, region: Region, offset: int, nbytes: int, remote: BytesLike, remote_offset: int,
              imm: Optional[int] = None) -> Operation:
        """One-sided write; with imm the target counts imms_per_write(peer, nbytes) immediates.

        The Operation ends when region's bytes may be reused. That they are visible at the target is
        what its immediates say: on tcp;ofi_rxm the writer's completion can come first."""
    def read(self, peer: int, region: Region, offset: int, nbytes: int, remote: BytesLike,
             remote_offset: int) -> Operation:
        """RDMA read of remote bytes into region."""
    def paged_write(self, peer: int, region: Region, src_pages: Pages, remote: BytesLike, dst_pages: Pages,
                    page_size: int, imm: Optional[int] = None) -> Operation:
        """Page src_pages[i] to page dst_pages[i]; with imm one immediate per page."""
    def scatter(self, region: Region, targets: Iterable[ScatterTarget], imm: Optional[int] = None) -> Operation:
        """One write per target, each carrying imm when given."""
    def imm(self, peer: int, value: int) -> Operation:
        """An immediate alone."""
    def barrier(self, peers: Iterable[int], value: int) -> Operation:
        """The immediate value to every peer listed."""
    def expect_imm(self, value: int, count: int, peer: Optional[int] = None,
                   timeout_s: Optional[float] = None) -> Operation:
        """Ends when count immediates carrying value arrived (earlier arrivals count)."""
    def imms_per_write(self, peer: int, nbytes: int) -> int:
        """Immediates one write of nbytes to peer produces at the target."""
    def imm_arrived(self, value: int) -> int:
        """Poller view: arrived, unconsumed immediates carrying value."""
    def consume_imm(self, value: int, n: int) -> None:
        """Poller view: consumes n immediates carrying value."""
    def close(self) -> None:
        """Orderly shutdown; later calls raise Error(CANCELLED)."""
    def __enter__(self) -> "Engine": ...
    def __exit__(self, *args: Any) -> None: ...

class Communicator:
    """W ranks over one engine of their own, bootstrapped through allgather(bytes) -> list[bytes].

    Ctrl-C during a call that waits for other ranks raises KeyboardInterrupt at once; every later
    call of this communicator (and its EpBuffers) then raises ponte.Error(CANCELLED)."""
    def __init__(self, rank: int, world: int, allgather: Callable[[bytes], Sequence[BytesLike]], *,
                 backend: str = ..., provider: str = ..., nics: int = ..., timeout_ms: int = ...,
                 stripe_min: int = ..., spin_us: int = ..., ctrl_addr: str = ..., idle_wake: bool = ...) -> None: ...
    @classmethod
    def from_torch(cls, group: Any = None, **engine_kwargs: Any) -> "Communicator":
        """Over an initialised torch.distributed group (gloo works on CPU)."""
    @property
    def rank(self) -> int:
        """This rank."""
    @property
    def world(self) -> int:
        """Number of ranks."""
    @property
    def closed(self) -> bool:
        """Whether close() ran."""
    def barrier(self) -> None:
        """Returns once every rank entered it."""
    def all_to_all_v(self, send: Memory, send_counts: Sequence[int], recv: Memory, recv_counts: Sequence[int]) -> None:
        """Counts in elements of each buffer's dtype, blocks back to back in rank order."""
    def close(self) -> None:
        """Closes its EpBuffers, then its engine."""
    def __enter__(self) -> "Communicator": ...
    def __exit__(self, *args: Any) -> None: ...

class EpHandle:
    """One dispatch/combine in flight."""
    @property
    def num_tokens(self) -> int:
        """T of the dispatch."""
    @property
    def src_info(self) -> Memory:
        """int32 [L, W * max_tokens, 2]: (source rank, token) per received row."""
    @property
    def layout_range(self) -> Memory:
        """int32 [L, W, 2]: (begin, count) per local expert and source rank."""
    def valid(self) -> bool:
        """Whether dispatched and not yet combined."""

class EpBuffer:
    """MoE dispatch and combine over a Communicator (collective)."""
    def __init__(self, comm: Communicator, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dtype: str = "float32") -> None: ...
    @property
    def num_experts(self) -> int:
        """E."""
    @property
    def local_experts(self) -> int:
        """L = E / W."""
    @property
    def hidden(self) -> int:
        """H."""
    @property
    def max_tokens(self) -> int:
        """Most tokens per dispatch."""
    @property
    def topk(self) -> int:
        """K."""
    @property
    def dtype(self) -> str:
        """'float32' or 'bfloat16'."""
    @property
    def recv_rows_per_expert(self) -> int:
        """W * max_tokens."""
    def dispatch(self, x: Memory, topk_idx: Memory, recv_x: Optional[Memory] = None,
                 recv_count: Optional[Memory] = None) -> Tuple[Memory, Memory, EpHandle]:
        """Returns (recv_x [L, W*max_tokens, H], recv_count [L], handle)."""
    def dispatch_send(self, x: Memory, topk_idx: Memory) -> EpHandle:
        """Posts the rows; returns at once."""
    def dispatch_recv(self, handle: EpHandle, recv_x: Optional[Memory] = None,
                      recv_count: Optional[Memory] = None) -> Tuple[Memory, Memory]:
        """Waits; returns (recv_x, recv_count)."""
    def combine(self, y: Memory, topk_weights: Memory, handle: EpHandle, out: Optional[Memory] = None,
                accumulate: bool = False) -> Memory:
        """Returns out [T, H] = sum_k w[t, k] * y_row(t, k)."""
    def combine_send(self, y: Memory, handle: EpHandle) -> None:
        """Sends y back to the sources; returns at once."""
    def combine_recv(self, handle: EpHandle, topk_weights: Memory, out: Optional[Memory] = None,
                     accumulate: bool = False) -> Memory:
        """Waits and reduces; releases the handle."""
    def live_handles(self) -> int:
        """Handles dispatched and not yet combined."""
    def close(self) -> None:
        """Frees the arena."""
