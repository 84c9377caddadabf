"""Peer processes for the ponte Python tests: a command server run in a spawned process.

A test starts a peer with ``PeerProcess(provider)``; the peer opens its own ``ponte.Engine`` and
answers commands (``peer.call("name", *args)``) that run the methods of ``Peer`` below; an exception
in the peer comes back as ``PeerError`` with the text of the original (and ``code`` for ponte.Error).
"""
import multiprocessing as mp
import os
import signal
import time

import numpy as np

SPAWN = mp.get_context("spawn")


def engine_workers(pid):
    """The engine workers (thread name ponte-g<group>) of process pid: {tid: allowed cores}."""
    out = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                if f.read().startswith("ponte-g"):
                    out[int(tid)] = os.sched_getaffinity(int(tid))
        except (FileNotFoundError, ProcessLookupError):
            pass  # ended meanwhile
    return out


def pattern(n, seed, start=0):
    """The test pattern: n bytes for a seed, from byte `start` of the stream."""
    i = np.arange(start, start + n, dtype=np.uint64)
    return ((i * np.uint64(7) + (i >> np.uint64(9)) + np.uint64(seed * 131)) & np.uint64(0xFF)).astype(np.uint8)


class PeerError(RuntimeError):
    def __init__(self, text, code=None):
        super().__init__(text)
        self.code = code


class Peer:
    """What runs inside the peer process: one engine, one registered buffer."""

    def __init__(self, engine_kwargs):
        import ponte
        self.ponte = ponte
        self.eng = ponte.Engine(**engine_kwargs)
        self.buf = None
        self.reg = None
        self.ops = {}

    def address(self):
        return self.eng.address()

    def register(self, nbytes):
        if self.reg is not None:
            self.reg.close()
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.reg = self.eng.register(self.buf)
        return self.reg.descriptor()

    def connect(self, addr):
        return self.eng.connect(addr)

    def peers(self):
        return self.eng.peers()

    def fill(self, off, n, seed, start=0):
        self.buf[off:off + n] = pattern(n, seed, start)

    def zero(self):
        self.buf[:] = 0

    def check(self, off, n, seed, start=0, timeout_s=10.0):
        """Index of the first byte that differs from the pattern (polls until the deadline: plain
        writes land without a notification), or -1."""
        want = pattern(n, seed, start)
        deadline = time.time() + timeout_s
        while True:
            diff = np.flatnonzero(self.buf[off:off + n] != want)
            if diff.size == 0:
                return -1
            if time.time() > deadline:
                return int(diff[0])
            time.sleep(0.01)

    def checksum(self, off, n):
        return int(self.buf[off:off + n].astype(np.uint64).sum())

    def expect(self, value, count, peer=None, timeout_s=20.0):
        self.eng.expect_imm(value, count, peer).wait(timeout_s)

    def arm(self, key, value, count, peer=None):
        """Starts an expect_imm and keeps it; `wait` returns its verdict."""
        self.ops[key] = self.eng.expect_imm(value, count, peer)

    def wait(self, key, timeout_s=20.0):
        self.ops.pop(key).wait(timeout_s)

    def imms_per_write(self, peer, nbytes):
        return self.eng.imms_per_write(peer, nbytes)

    def write(self, peer, off, n, remote, roff, imm=None):
        self.eng.write(peer, self.reg, off, n, remote, roff, imm=imm).wait(20)

    def imm(self, peer, value):
        self.eng.imm(peer, value).wait(20)

    def close(self):
        if self.reg is not None:
            self.reg.close()
        self.eng.close()


def serve(conn, engine_kwargs):
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")
    try:
        peer = Peer(engine_kwargs)
    except Exception as e:  # reported to the test
        conn.send(("err", "Peer(): %r" % (e,), None))
        return
    conn.send(("ok", None))
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            break
        if name == "exit":
            peer.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(peer, name)(*args)))
        except Exception as e:
            code = getattr(e, "code", None)
            conn.send(("err", "%s: %s" % (type(e).__name__, e), None if code is None else int(code)))


class PeerProcess:
    """A spawned peer process with its own engine; commands run there one at a time."""

    def __init__(self, **engine_kwargs):
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=serve, args=(child, engine_kwargs), daemon=True)
        self.proc.start()
        child.close()
        self._answer(60)
        self.addr = self.call("address")

    def _answer(self, timeout_s):
        if not self.conn.poll(timeout_s):
            raise PeerError("peer gave no answer within %s s" % timeout_s)
        msg = self.conn.recv()
        if msg[0] != "ok":
            raise PeerError(msg[1], msg[2])
        return msg[1]

    def call(self, name, *args, timeout_s=60):
        self.conn.send((name, args))
        return self._answer(timeout_s)

    def send(self, name, *args):
        """Starts a command without waiting for its answer (collect it with answer())."""
        self.conn.send((name, args))

    def answer(self, timeout_s=60):
        return self._answer(timeout_s)

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=30)
            except (PeerError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
