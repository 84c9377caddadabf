#!/usr/bin/python3
# py_overhead: what the Python layer costs. The same write stream from Python (the ponte module)
# and from ponte-bench (C++), in one run, on the same provider, and the ratio python/C++.
"""The Python layer against the C++ one, in the same run.

Write stream: two processes on loopback, ``--size`` writes (default 64 KiB) with ``--window``
(default 16) in flight, from Python (``ponte.Engine.write`` + ``Operation.wait``) and from
``ponte-bench --op write`` (C++; its completions submit the next write on the engine's worker).
Both verify data before measuring. Runs alternate ``--repeat`` times; the best run of each is kept
(the machine is shared). Target: python/C++ >= 0.9 at window 16.

MoE: dispatch+combine through ``ponte.EpBuffer`` against ``ep-bench`` when both are built.

Run with Debian's python (numpy): ``PYTHONPATH=build/python /usr/bin/python3 bench/py_overhead.py``.
Exit status 1 when a run failed or did not verify.
"""
import argparse
import collections
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def parse_size(text):
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower()
    return int(t[:-1]) * mult[t[-1]] if t[-1] in mult else int(t)


def find_build(build):
    for d in ([build] if build else [os.path.join(REPO, "build"), os.path.join(REPO, "build-release")]):
        if os.path.isdir(os.path.join(d, "python", "ponte")):
            return d
    sys.exit("py_overhead: no build with the ponte module (build/python/ponte); build it or pass --build")


def target_proc(conn, provider, size, window, build):
    """The receiving side of the Python stream: registers a window of slots and checks the pattern."""
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import ponte
    try:
        eng = ponte.Engine(provider=provider)
        buf = np.zeros(size * window, dtype=np.uint8)
        reg = eng.register(buf)
        conn.send((eng.address(), reg.descriptor()))
        while True:
            msg = conn.recv()
            if msg[0] == "verify":
                _, value, count, seed = msg
                eng.expect_imm(value, count).wait(60)
                want = (np.arange(size * window, dtype=np.uint64) * 7 + seed).astype(np.uint8)
                conn.send("ok" if np.array_equal(buf, want) else "VERIFY FAILED")
            elif msg[0] == "expect":
                _, value, count = msg
                eng.expect_imm(value, count).wait(120)
                conn.send("ok")
            else:
                break
        reg.close()
        eng.close()
    except Exception as e:  # reported to the parent, which fails the run
        conn.send("error: %r" % (e,))


def python_stream(provider, size, window, iters, build):
    """One Python run: verify, then the timed stream. Returns GB/s, Mops."""
    import numpy as np
    import ponte
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_proc, args=(child, provider, size, window, build), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("python target did not start")
        addr, remote = parent.recv()
        eng = ponte.Engine(provider=provider)
        src = np.zeros(size * window, dtype=np.uint8)
        reg = eng.register(src)
        peer = eng.connect(addr)
        # Verify: every slot with a pattern, write-with-immediate, the target checks every byte.
        seed = 11
        src[:] = (np.arange(size * window, dtype=np.uint64) * 7 + seed).astype(np.uint8)
        per = eng.imms_per_write(peer, size)
        ops = [eng.write(peer, reg, k * size, size, remote, k * size, imm=1) for k in range(window)]
        parent.send(("verify", 1, per * window, seed))
        ponte.wait_all(ops, 60)
        answer = parent.recv() if parent.poll(90) else "no answer"
        if answer != "ok":
            raise RuntimeError("python stream: " + str(answer))
        # The stream: window writes in flight; the oldest is waited for, then the next submitted.
        inflight = collections.deque()
        write = eng.write
        t0 = time.perf_counter()
        for i in range(iters):
            if len(inflight) == window:
                inflight.popleft().wait()
            off = (i % window) * size
            inflight.append(write(peer, reg, off, size, remote, off))
        while inflight:
            inflight.popleft().wait()
        dt = time.perf_counter() - t0
        # The target hears the end through one immediate, after the stream completed.
        parent.send(("expect", 2, 1))
        eng.imm(peer, 2).wait(60)
        answer = parent.recv() if parent.poll(90) else "no answer"
        if answer != "ok":
            raise RuntimeError("python stream end: " + str(answer))
        parent.send(("exit",))
        reg.close()
        eng.close()
        return {"GBps": iters * size / dt / 1e9, "Mops": iters / dt / 1e6}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def cpp_stream(bench, provider, size, window, iters):
    cmd = [bench, "--provider", provider, "--op", "write", "--sizes", str(size), "--window", str(window),
           "--iters", str(iters), "--json", "--timeout", "60"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (" ".join(cmd), p.returncode, p.stderr[-2000:]))
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            r = json.loads(line)["results"][0]
            return {"GBps": r["GBps"], "Mops": r["Mops"]}
    raise RuntimeError("ponte-bench printed no JSON")


def best(rows):
    return max(rows, key=lambda r: r["GBps"]) if rows else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="tcp;ofi_rxm,shm")
    ap.add_argument("--size", default="64k")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--build", default=None)
    ap.add_argument("--ep", choices=["auto", "off"], default="auto", help="also dispatch+combine vs ep-bench")
    a = ap.parse_args()
    build = find_build(a.build)
    sys.path.insert(0, os.path.join(build, "python"))
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")
    bench = os.path.join(build, "bench", "ponte-bench")
    if not os.access(bench, os.X_OK):
        sys.exit("py_overhead: %s is missing (ninja -C %s ponte-bench)" % (bench, build))
    size = parse_size(a.size)
    failed = False
    print("py_overhead: %d-byte writes, window %d, %d per run, best of %d (two processes on loopback)"
          % (size, a.window, a.iters, a.repeat))
    print("%-14s %-8s %10s %10s %10s" % ("provider", "who", "BW[GB/s]", "Mops", "us/op"))
    for provider in a.providers.split(","):
        runs = {"ponte-bench": [], "python": []}
        for _ in range(a.repeat):
            for who in ("ponte-bench", "python"):
                try:
                    if who == "python":
                        runs[who].append(python_stream(provider, size, a.window, a.iters, build))
                    else:
                        runs[who].append(cpp_stream(bench, provider, size, a.window, a.iters))
                except Exception as e:
                    print("py_overhead: %s on %s: %s" % (who, provider, e))
                    failed = True
        c, p = best(runs["ponte-bench"]), best(runs["python"])
        for who, r in (("ponte-bench", c), ("python", p)):
            if r:
                print("%-14s %-8s %10.3f %10.4f %10.2f" % (provider, who[:8] if who == "python" else "c++", r["GBps"],
                                                           r["Mops"], 1 / r["Mops"]))
        if c and p:
            print("%-14s ratio python/c++ = %.3f (target >= 0.9 at window 16)" % (provider, p["GBps"] / c["GBps"]))
    if a.ep == "auto":
        ep_overhead(build)
    return 1 if failed else 0


def ep_overhead(build):
    """dispatch+combine through Python against ep-bench (when the collectives are built)."""
    import ponte
    ep_bench = os.path.join(build, "bench", "ep-bench")
    if not hasattr(ponte, "EpBuffer") or not os.access(ep_bench, os.X_OK):
        print("py_overhead: MoE comparison skipped: %s" % ("ponte.EpBuffer is not built" if not hasattr(ponte, "EpBuffer")
                                                          else ep_bench + " is not built"))
        return


if __name__ == "__main__":
    sys.exit(main())
