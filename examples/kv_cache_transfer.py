#!/usr/bin/python3
"""KV-cache transfer, prefill -> decode, as in disaggregated LLM serving.

A "prefill" process holds a KV cache of layers x blocks pages (one page: the K and V of one block
of tokens for one layer). For every request, the "decode" process (a second process, its own
engine) allocates free pages scattered over its own, larger cache and tells prefill where they
are; prefill moves the request's pages there with one ``paged_write`` carrying the request id as
immediate, and decode learns completion from one immediate count (one per page) and checks every
page. In the same run, the engine's plain write bandwidth (the same bytes as page-sized writes,
16 in flight, each with an immediate that decode counts) is measured for comparison.

Both measurements find decode's cache warm and decode waiting, as in a long-running server:
- Before them every page of decode's cache is written once (zeros, one ``paged_write``). The first
  write into a page through another process's kernel path costs more than later ones (on this
  2-core VM, 32 KiB pages first written by shm or tcp came in 3-8x slower than pages written
  before); a serving cache is written over and over.
- Decode waits for the plain writes' immediates as it waits for a request's. An engine whose
  application waits for nothing leaves incoming data to an idle worker, which on a provider that
  needs the target's progress (``tcp;ofi_rxm``) polls only every ``PONTE_IDLE_SLEEP_US`` (1 ms):
  32 KiB writes into such an engine took 0.96-1.2 ms each here. A decode that cannot post its
  wait first can create its engine with ``idle_wake=True`` (``PONTE_IDLE_WAKE=1``; README).

    PYTHONPATH=build/python /usr/bin/python3 examples/kv_cache_transfer.py
    ... --provider shm --layers 32 --blocks 256 --page-kib 32 --requests 16

Exit status 0 when every page verified.
"""
import argparse
import collections
import multiprocessing as mp
import os
import sys
import time

import numpy as np

try:
    import ponte
except ImportError:  # run from the repository without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "python"))
    import ponte

os.environ.setdefault("FI_TCP_IFACE", "lo")  # the demo stays on loopback
os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")


def page_content(layers, blocks, page_bytes):
    """The bytes prefill computed for (layer, block) pages: [len(layers), page_bytes] uint8."""
    seed = (np.asarray(layers, np.uint64) * np.uint64(7919) + np.asarray(blocks, np.uint64) * np.uint64(104729))
    col = np.arange(page_bytes, dtype=np.uint64)
    return ((col[None, :] * np.uint64(31) + seed[:, None] + (col[None, :] >> np.uint64(8))) & np.uint64(0xFF)).astype(np.uint8)


def decode(conn, args):
    """The decode side: a cache with scattered free pages, filled by prefill, every page checked."""
    rng = np.random.default_rng(1)
    eng = ponte.Engine(provider=args.provider)
    dec_blocks = args.blocks * 2  # a larger cache: prefill's pages land in scattered free slots
    cache = np.zeros((args.layers, dec_blocks, args.page_kib * 1024), dtype=np.uint8)
    reg = eng.register(cache)
    conn.send((eng.address(), reg.descriptor(), dec_blocks))
    await_imms(conn, eng)  # the warm-up: every page written once (zeros)
    free = list(rng.permutation(dec_blocks))
    placed = {}  # decode block -> prefill block
    bad = 0
    t_total = 0.0
    pages_total = 0
    for req in range(args.requests):
        src_blocks = conn.recv()  # the request's blocks at prefill
        dst_blocks = [int(free.pop()) for _ in src_blocks]
        count = args.layers * len(src_blocks)  # one immediate per page
        done = eng.expect_imm(1000 + req, count)
        t0 = time.perf_counter()
        conn.send(dst_blocks)
        done.wait(60)
        t_total += time.perf_counter() - t0
        pages_total += count
        # Every page of the request: the right bytes in the right slot.
        layers = np.repeat(np.arange(args.layers), len(src_blocks))
        want = page_content(layers, np.tile(src_blocks, args.layers), cache.shape[2])
        got = cache[layers, np.tile(dst_blocks, args.layers)]
        bad += int(np.count_nonzero(np.any(got != want, axis=1)))
        for s, d in zip(src_blocks, dst_blocks):
            placed[d] = s
    # Slots never allocated must still be empty.
    untouched = [b for b in range(dec_blocks) if b not in placed]
    bad += int(np.count_nonzero(cache[:, untouched]))
    conn.send((bad, pages_total, t_total))
    await_imms(conn, eng)  # the plain-write reference
    conn.recv()
    reg.close()
    eng.close()


def await_imms(conn, eng):
    """Decode's side of an unmeasured or reference phase: prefill names an immediate value and how
    many to expect; decode waits for them (its engine's worker moves the data at full speed while
    somebody waits) and says when they are in."""
    value, count = conn.recv()
    done = eng.expect_imm(value, count)
    conn.send("ready")
    done.wait(120)
    conn.send("done")



def recv_from(conn, proc, what, timeout_s=300):
    """The next message from a child process, or a clear exit if it died or went silent."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive():
            sys.exit(f"{os.path.basename(sys.argv[0])}: the {what} process died (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            sys.exit(f"{os.path.basename(sys.argv[0])}: no word from the {what} process within {timeout_s} s")
    return conn.recv()

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default="tcp;ofi_rxm", help="libfabric provider (tcp;ofi_rxm, shm, efa, ...)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=128, help="KV blocks in prefill's cache")
    ap.add_argument("--page-kib", type=int, default=32, help="bytes of one (layer, block) page, in KiB")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    page = args.page_kib * 1024
    per_req = args.blocks // args.requests
    if per_req < 1:
        sys.exit("kv_cache_transfer: fewer blocks than requests")

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode, args=(child, args), daemon=True)
    proc.start()
    addr, remote, dec_blocks = recv_from(conn, proc, "decode")

    eng = ponte.Engine(provider=args.provider)
    cache = np.empty((args.layers, args.blocks, page), dtype=np.uint8)
    for layer in range(args.layers):  # "prefill" computes its KV cache
        cache[layer] = page_content(np.full(args.blocks, layer), np.arange(args.blocks), page)
    reg = eng.register(cache)
    peer = eng.connect(addr)
    eng.imm(peer, 1).wait(60)  # the handshake, outside the measurement

    # Warm-up, outside the measurements: zeros into every page of decode's cache, once.
    zero = np.zeros(page, dtype=np.uint8)
    zreg = eng.register(zero)
    dec_pages = args.layers * dec_blocks
    conn.send((999, dec_pages))  # one immediate per page
    recv_from(conn, proc, "decode")
    eng.paged_write(peer, zreg, np.zeros(dec_pages, np.uint32), remote, np.arange(dec_pages, dtype=np.uint32), page,
                    imm=999).wait(120)
    recv_from(conn, proc, "decode")
    zreg.close()

    # Requests: consecutive runs of prefill blocks; each goes out as one paged_write.
    for req in range(args.requests):
        src_blocks = list(range(req * per_req, (req + 1) * per_req))
        conn.send(src_blocks)
        dst_blocks = recv_from(conn, proc, "decode")
        src_pages = np.array([l * args.blocks + b for l in range(args.layers) for b in src_blocks], np.uint32)
        dst_pages = np.array([l * dec_blocks + d for l in range(args.layers) for d in dst_blocks], np.uint32)
        eng.paged_write(peer, reg, src_pages, remote, dst_pages, page, imm=1000 + req).wait(60)
    bad, pages, t_decode = recv_from(conn, proc, "decode")
    nbytes = pages * page

    # The engine's plain write bandwidth in the same run: the same bytes as page-sized writes,
    # 16 in flight, to the start of decode's cache (after the check above), each with an immediate
    # that decode waits for, as it waits for a request's; timed until decode has them all (the
    # local completions can come first: on tcp, once the bytes are in the socket).
    conn.send((998, pages * eng.imms_per_write(peer, page)))
    recv_from(conn, proc, "decode")
    inflight = collections.deque()
    t0 = time.perf_counter()
    for i in range(pages):
        if len(inflight) == 16:
            inflight.popleft().wait(60)
        off = (i % (args.layers * args.blocks)) * page
        inflight.append(eng.write(peer, reg, off, page, remote, off, imm=998))
    ponte.wait_all(inflight, 60)
    recv_from(conn, proc, "decode")
    t_plain = time.perf_counter() - t0
    conn.send("exit")
    proc.join(60)
    reg.close()
    eng.close()

    print("kv_cache_transfer: %s, %d layers x %d blocks, %d KiB pages, %d requests of %d blocks (%d pages each)"
          % (args.provider, args.layers, args.blocks, args.page_kib, args.requests, per_req, per_req * args.layers))
    print("%-30s %10s %12s %10s" % ("", "pages/s", "GB/s", "ms"))
    # paged_write: from decode handing out its free pages to the request's last immediate.
    print("%-30s %10.0f %12.3f %10.1f" % ("paged_write + imm count", pages / t_decode, nbytes / t_decode / 1e9, t_decode * 1e3))
    print("%-30s %10.0f %12.3f %10.1f" % ("plain write, same pages", pages / t_plain, nbytes / t_plain / 1e9, t_plain * 1e3))
    print("paged_write / plain write: %.2f" % (t_plain / t_decode))
    if bad or proc.exitcode != 0:
        print("kv_cache_transfer: VERIFY FAILED: %d bad pages (decode exit %s)" % (bad, proc.exitcode))
        return 1
    print("kv_cache_transfer: all %d pages verified at decode (and every unallocated slot still empty)" % pages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
