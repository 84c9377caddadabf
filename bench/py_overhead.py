#!/usr/bin/python3
# py_overhead: what the Python layer costs. The same write stream from Python (the ponte module)
# and from ponte-bench (C++), in one run, on the same provider, and the ratio python/C++.
"""The Python layer against the C++ one, in the same run.

Write stream: two processes on loopback, ``--size`` writes (default 64 KiB) with ``--window``
(default 16) in flight, from Python (``ponte.Engine.write`` + ``Operation.wait``) and from
``ponte-bench --op write --slots WINDOW`` (C++; its completions submit the next write on the engine's
worker). Both streams write slot k % window of the same-sized buffers, so both walk the same memory.
A third row (``--batch B``, default 4; 0 leaves it out) writes the same stream from Python with
``paged_write``, B writes per call and window / B calls in flight.
Both verify data before measuring. Runs alternate ``--repeat`` times, the order of the rows rotated by
one each round (so every row runs first in some round); the best run of each is kept
(the machine is shared), and a second line gives each round's own ratio (python and C++ runs side by
side) with their median and range, which show how far the rounds disagree.
``--pin S,R`` places both streams alike on two cores: the sending engine's worker on core S, the
target's on R (``ponte-bench --worker-cores S,R``; ``Engine(progress_cores=...)``), and the Python
sender's own thread (it submits and waits; ponte-bench submits from its worker) off the core of
whichever thread moves the data. On shm the sending worker posts every write (a wait only
reaps): the Python thread goes on R, beside the target's worker. Elsewhere (tcp;ofi_rxm) a waiting
Python thread polls and posts itself while its worker stands back (Engine::progress): it goes on S.
Unpinned (default), the scheduler puts the Python thread where it likes, often on the sending
worker's core.
Target: python/C++ >= 0.9 at window 16. ``proc_us/op``: CPU time of the
sending process per write over the timed loop: Python's counts every thread (its waits included);
ponte-bench's (``proc_ns_per_op``) every thread but its main one, plus that thread's submit calls.

MoE: dispatch+combine through ``ponte.EpBuffer`` against ``ep-bench`` (C++), the same shape (default
ep-bench's small one: W 2, 128 tokens per rank, H 128, top-2, 16 experts, bf16), timed alike (a barrier,
then dispatch_send+dispatch_recv and combine_send+combine_recv; per iteration the slowest rank;
p50 over ``--ep-iters`` rounds, default 1,000: 50 rounds are about 4 ms of work on tcp, and their
ratio moved between 0.70 and 1.25 from run to run). Python reuses its recv_x/recv_count/out arrays,
as a real loop would. Target: C++/Python time >= 0.9. ``--ep-tensors`` picks what Python passes:
numpy arrays (the ``python`` row), CPU torch tensors over the same memory (the ``py-torch`` row, what
a PyTorch MoE layer passes), or both (default, when torch imports).

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


def target_proc(conn, provider, size, window, build, pin=None):
    """The receiving side of the Python stream: registers a window of slots and checks the pattern."""
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import ponte
    try:
        # Unpinned: PONTE_PROGRESS_CORES, if set, places it, as it does ponte-bench's.
        eng = ponte.Engine(provider=provider, **({"progress_cores": [pin[1]]} if pin else {}))
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
                # Armed before the stream starts, as ponte-bench's target arms its counter before
                # it answers 'R': a counter that waits keeps the worker polling (tcp;ofi_rxm is a
                # manual-progress provider; an idle target would poll only every 50 us).
                _, value, count = msg
                op = eng.expect_imm(value, count)
                conn.send("armed")
                op.wait(120)
                conn.send("ok")
            else:
                break
        reg.close()
        eng.close()
    except Exception as e:  # reported to the parent, which fails the run
        conn.send("error: %r" % (e,))


def python_stream(provider, size, window, iters, build, batch=1, pin=None):
    """One Python run: verify, then the timed stream. Returns GB/s, Mops.

    batch 1: one ``write`` per write; when window writes are in flight, the oldest is waited for.
    batch B > 1: ``paged_write`` of B slots per call (B writes, one Operation), window // B calls in
    flight: what a Python user moving many equal pieces (KV-cache pages) writes.
    pin (S, R): the sending worker on S, the target's on R, this thread on R for shm, else on S
    (module doc)."""
    import numpy as np
    import ponte
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_proc, args=(child, provider, size, window, build, pin), daemon=True)
    proc.start()
    cores = os.sched_getaffinity(0)
    try:
        if not parent.poll(60):
            raise RuntimeError("python target did not start")
        addr, remote = parent.recv()
        eng = ponte.Engine(provider=provider, **({"progress_cores": [pin[0]]} if pin else {}))
        if pin:  # this thread only (the engine's worker has its own)
            os.sched_setaffinity(0, {pin[1] if provider == "shm" else pin[0]})
        src = np.zeros(size * window, dtype=np.uint8)
        reg = eng.register(src)
        peer = eng.connect(addr)
        # Verify: every slot with a pattern, write-with-immediate, the target checks every byte.
        seed = 11
        src[:] = (np.arange(size * window, dtype=np.uint64) * 7 + seed).astype(np.uint8)
        pages = [np.arange(k, k + batch, dtype=np.uint32) for k in range(0, window, batch)] if batch > 1 else []
        if batch == 1:
            ops = [eng.write(peer, reg, k * size, size, remote, k * size, imm=1) for k in range(window)]
            imms = eng.imms_per_write(peer, size) * window
        else:  # the path the timed loop takes, each batch's pages landing where they will; one immediate a page
            ops = [eng.paged_write(peer, reg, pg, remote, pg, size, imm=1) for pg in pages]
            imms = window
        parent.send(("verify", 1, imms, seed))
        ponte.wait_all(ops, 60)
        answer = parent.recv() if parent.poll(90) else "no answer"
        if answer != "ok":
            raise RuntimeError("python stream: " + str(answer))
        # The target arms its counter for the closing immediate first (as ponte-bench's does).
        parent.send(("expect", 2, 1))
        armed = parent.recv() if parent.poll(60) else "no answer"
        if armed != "armed":
            raise RuntimeError("python stream: target: " + str(armed))
        # The stream: window writes in flight; the oldest is waited for, then the next submitted.
        inflight = collections.deque()
        t0, p0 = time.perf_counter(), time.process_time()
        if batch == 1:
            write = eng.write
            for i in range(iters):
                if len(inflight) == window:
                    inflight.popleft().wait()
                off = (i % window) * size
                inflight.append(write(peer, reg, off, size, remote, off))
        else:
            paged = eng.paged_write
            calls = len(pages)
            for i in range(iters // batch):
                if len(inflight) == calls:
                    inflight.popleft().wait()
                pg = pages[i % calls]
                inflight.append(paged(peer, reg, pg, remote, pg, size))
            iters = iters // batch * batch
        while inflight:
            inflight.popleft().wait()
        dt, cpu = time.perf_counter() - t0, time.process_time() - p0
        # The target hears the end through one immediate, after the stream completed.
        eng.imm(peer, 2).wait(60)
        answer = parent.recv() if parent.poll(90) else "no answer"
        if answer != "ok":
            raise RuntimeError("python stream end: " + str(answer))
        parent.send(("exit",))
        reg.close()
        eng.close()
        return {"GBps": iters * size / dt / 1e9, "Mops": iters / dt / 1e6, "proc_us": cpu / iters * 1e6}
    finally:
        os.sched_setaffinity(0, cores)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def cpp_stream(bench, provider, size, window, iters, pin=None):
    # --slots window: write k moves slot k % window of both buffers, as the Python stream does (one
    # slot for every write would keep 64 KiB of each buffer in cache where Python's stream walks 1 MiB).
    cmd = [bench, "--provider", provider, "--op", "write", "--sizes", str(size), "--window", str(window),
           "--slots", str(window), "--iters", str(iters), "--json", "--timeout", "60"]
    if pin:
        cmd += ["--worker-cores", "%d,%d" % pin]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (" ".join(cmd), p.returncode, p.stderr[-2000:]))
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            r = json.loads(line)["results"][0]
            return {"GBps": r["GBps"], "Mops": r["Mops"], "proc_us": r["proc_ns_per_op"] / 1e3}
    raise RuntimeError("ponte-bench printed no JSON")


def best(rows):
    rows = [r for r in rows if r]
    return max(rows, key=lambda r: r["GBps"]) if rows else None


def rotated(whos, i):
    """Round i's order: the rows rotated by i, so each row runs first, second, ... in turn, and no
    row's figures carry the cost of one place in the round (right after another row's processes,
    say). Stop 46 put the torch MoE row's gap down to its place (always third); with rotation the
    gap stayed (bench/README.md)."""
    i %= len(whos)
    return list(whos[i:]) + list(whos[:i])


def per_round(ratios):
    """Each alternating round's own ratio, then their median and spread: on a shared 2-core host one
    round's pair can land in different speeds, so best-of-each alone hides how far rounds disagree."""
    rs = sorted(r for r in ratios if r is not None)
    if not rs:
        return "no round completed both"
    med = rs[len(rs) // 2] if len(rs) % 2 else (rs[len(rs) // 2 - 1] + rs[len(rs) // 2]) / 2
    each = " ".join("%.3f" % r if r is not None else "-" for r in ratios)
    return "per round %s; median %.3f, range %.3f-%.3f" % (each, med, rs[0], rs[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="tcp;ofi_rxm,shm")
    ap.add_argument("--size", default="64k")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4,
                    help="also a Python row with paged_write of this many writes per call (0: no such row)")
    ap.add_argument("--build", default=None)
    ap.add_argument("--pin", default=None, metavar="S,R",
                    help="write streams: sending worker on core S, target's on R; the Python sender's thread on R "
                         "for shm, on S elsewhere (see above)")
    ap.add_argument("--ep", choices=["auto", "off"], default="auto", help="also dispatch+combine vs ep-bench")
    ap.add_argument("--ep-world", type=int, default=2)
    ap.add_argument("--ep-tokens", type=int, default=128)
    ap.add_argument("--ep-hidden", type=int, default=128)
    ap.add_argument("--ep-topk", type=int, default=2)
    ap.add_argument("--ep-experts", type=int, default=16)
    ap.add_argument("--ep-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--ep-tensors", choices=["numpy", "torch", "both"], default=None,
                    help="what the Python MoE rows pass (default both when torch imports, else numpy)")
    ap.add_argument("--ep-iters", type=int, default=1000,
                    help="measured dispatch+combine rounds per run (default 1000; 50, about 4 ms of work on tcp, "
                         "gave ratios from 0.70 to 1.25 between runs)")
    a = ap.parse_args()
    build = find_build(a.build)
    sys.path.insert(0, os.path.join(build, "python"))
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    os.environ.setdefault("PONTE_CTRL_ADDR", "127.0.0.1")
    bench = os.path.join(build, "bench", "ponte-bench")
    if not os.access(bench, os.X_OK):
        sys.exit("py_overhead: %s is missing (ninja -C %s ponte-bench)" % (bench, build))
    size = parse_size(a.size)
    if a.batch < 0 or a.batch == 1 or (a.batch and a.window % a.batch):
        sys.exit("py_overhead: --batch must be 0 or a divisor of --window larger than 1")
    pin = None
    if a.pin:
        try:
            pin = tuple(int(x) for x in a.pin.split(","))
        except ValueError:
            pin = ()
        if len(pin) != 2 or not set(pin) <= os.sched_getaffinity(0) or pin[0] == pin[1]:
            sys.exit("py_overhead: --pin wants two different cores this process may use, as S,R (got %s)" % a.pin)
    failed = False
    print("py_overhead: %d-byte writes, window %d, %d per run, best of %d, rows rotated each round"
          " (two processes on loopback)%s" % (size, a.window, a.iters, a.repeat,
                                              "; pinned: sending worker on core %d, target's on core %d, the Python"
                                              " sender's thread on %d for shm (the worker posts) and on %d elsewhere"
                                              " (its waits post)" % (pin + (pin[1], pin[0])) if pin else ""))
    print("%-14s %-8s %10s %10s %10s %12s" % ("provider", "who", "BW[GB/s]", "Mops", "us/op", "proc_us/op"))
    for provider in a.providers.split(","):
        pyb = "py-b%d" % a.batch
        whos = ("ponte-bench", "python", pyb) if a.batch else ("ponte-bench", "python")
        runs = {who: [] for who in whos}
        for i in range(a.repeat):
            for who in rotated(whos, i):
                try:
                    if who == "python":
                        runs[who].append(python_stream(provider, size, a.window, a.iters, build, pin=pin))
                    elif who == pyb:
                        runs[who].append(python_stream(provider, size, a.window, a.iters, build, a.batch, pin))
                    else:
                        runs[who].append(cpp_stream(bench, provider, size, a.window, a.iters, pin))
                except Exception as e:
                    print("py_overhead: %s on %s: %s" % (who, provider, e))
                    runs[who].append(None)  # keeps the rounds aligned for the per-round ratios
                    failed = True
        c = best(runs["ponte-bench"])
        for who in whos:
            r = best(runs[who])
            if r:
                print("%-14s %-8s %10.3f %10.4f %10.2f %12.2f" % (provider, "c++" if who == "ponte-bench" else who,
                                                                 r["GBps"], r["Mops"], 1 / r["Mops"], r["proc_us"]))
        for who in whos[1:]:
            p = best(runs[who])
            if c and p:
                print("%-14s ratio %s/c++ = %.3f%s" % (provider, who, p["GBps"] / c["GBps"],
                                                      " (target >= 0.9 at window 16)" if who == "python" else
                                                      " (paged_write, %d writes a call)" % a.batch))
                rounds = [q["GBps"] / k["GBps"] if q and k else None for q, k in zip(runs[who], runs["ponte-bench"])]
                print("%-14s   %s/c++ %s" % (provider, who, per_round(rounds)))
    if a.ep == "auto":
        shape = dict(tokens=a.ep_tokens, hidden=a.ep_hidden, topk=a.ep_topk, experts=a.ep_experts, dtype=a.ep_dtype,
                     iters=a.ep_iters, warmup=5)
        tensors = a.ep_tensors
        if tensors is None:
            try:
                import torch  # noqa: F401
                tensors = "both"
            except ImportError:
                print("py_overhead: torch does not import: the MoE rows pass numpy arrays only")
                tensors = "numpy"
        whos = {"numpy": ["python"], "torch": ["py-torch"], "both": ["python", "py-torch"]}[tensors]
        failed |= not ep_overhead(build, a.providers.split(","), a.repeat, a.ep_world, shape, whos)
    return 1 if failed else 0


def ep_rank(me, world, conn, cfg, build):
    """One rank of the Python dispatch+combine loop, timed as ep-bench times its own."""
    sys.path.insert(0, os.path.join(build, "python"))
    import numpy as np
    import ponte

    def allgather(data):
        conn.send(("ag", bytes(data)))
        return conn.recv()

    try:
        E, H, T, K = cfg["experts"], cfg["hidden"], cfg["tokens"], cfg["topk"]
        comm = ponte.Communicator(me, world, allgather, provider=cfg["provider"])
        ep = ponte.EpBuffer(comm, E, H, T, K, dtype=cfg["dtype"])
        dt = np.float32 if cfg["dtype"] == "float32" else np.uint16
        x = (np.arange(T * H, dtype=np.uint32).reshape(T, H) % 13).astype(np.float32)
        if dt is np.uint16:
            x = (x.view(np.uint32) >> 16).astype(np.uint16)  # small integers are exact in bf16
        recv_x = np.empty((ep.local_experts, ep.recv_rows_per_expert, H), dtype=dt)
        recv_count = np.empty(ep.local_experts, dtype=np.int32)
        out = np.empty((T, H), dtype=dt)
        if cfg.get("tensors") == "torch":
            # Tensors over the same memory (bf16 through an int16 view: torch has no uint16), so the
            # check below reads what the torch calls wrote.
            import torch

            def tensor(a):
                if a.dtype == np.uint16:
                    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
                return torch.from_numpy(a)
        else:
            def tensor(a):
                return a
        x_in, recv_x_in, recv_count_in, out_in = tensor(x), tensor(recv_x), tensor(recv_count), tensor(out)
        rng = np.random.default_rng(me + 1)
        d_us, c_us, verified = [], [], True
        for it in range(cfg["warmup"] + cfg["iters"]):
            idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)  # K distinct experts per token
            w = np.full((T, K), 1.0 / K, dtype=np.float32)
            idx, w = tensor(idx), tensor(w)
            comm.barrier()
            t0 = time.perf_counter()
            h = ep.dispatch_send(x_in, idx)
            ep.dispatch_recv(h, recv_x_in, recv_count_in)
            t1 = time.perf_counter()
            ep.combine_send(recv_x_in, h)  # the "experts" return their input: out = x * sum(w) = x
            ep.combine_recv(h, w, out=out_in)
            t2 = time.perf_counter()
            if it >= cfg["warmup"]:
                d_us.append((t1 - t0) * 1e6)
                c_us.append((t2 - t1) * 1e6)
            if it in (cfg["warmup"], cfg["warmup"] + cfg["iters"] - 1):
                got = out.astype(np.float32) if dt is np.float32 else (out.astype(np.uint32) << 16).view(np.float32)
                want = x if dt is np.float32 else (x.astype(np.uint32) << 16).view(np.float32)
                verified &= bool(np.allclose(got, want, rtol=2e-2, atol=2e-2))
        ep.close()
        comm.close()
        conn.send(("result", (d_us, c_us, verified)))
    except Exception as e:
        conn.send(("result", "error: %r" % (e,)))


def python_ep(cfg, world, build):
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(world):
        a, b = ctx.Pipe()
        p = ctx.Process(target=ep_rank, args=(r, world, b, cfg, build), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    results, gathered = {}, {}
    deadline = time.time() + 300
    try:
        while len(results) < world:
            if time.time() > deadline:
                raise RuntimeError("python ranks did not finish")
            for r, c in enumerate(pipes):
                if r in results or not c.poll(0.01):
                    continue
                kind, payload = c.recv()
                if kind == "ag":
                    gathered[r] = payload
                    if len(gathered) == world:
                        for k in range(world):
                            pipes[k].send([gathered[i] for i in range(world)])
                        gathered = {}
                else:
                    results[r] = payload
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r, res in results.items():
        if isinstance(res, str):
            raise RuntimeError("rank %d: %s" % (r, res))
    # Per iteration the slowest rank, then the median (as ep-bench does).
    d = sorted(max(results[r][0][i] for r in range(world)) for i in range(cfg["iters"]))
    c = sorted(max(results[r][1][i] for r in range(world)) for i in range(cfg["iters"]))
    return {"d": d[len(d) // 2], "c": c[len(c) // 2], "verified": all(results[r][2] for r in range(world))}


def cpp_ep(ep_bench, cfg, world):
    cmd = [ep_bench, "--provider", cfg["provider"], "--world", str(world), "--tokens", str(cfg["tokens"]),
           "--hidden", str(cfg["hidden"]), "--topk", str(cfg["topk"]), "--experts", str(cfg["experts"]),
           "--dtype", "f32" if cfg["dtype"] == "float32" else "bf16", "--iters", str(cfg["iters"]), "--json"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (" ".join(cmd), p.returncode, p.stderr[-2000:]))
    start = p.stdout.index("{")
    rows = json.loads(p.stdout[start:])["results"]
    r = rows[0]
    return {"d": r["dispatch_p50_us"], "c": r["combine_p50_us"], "verified": r["verified"]}


def ep_overhead(build, providers, repeat, world, shape, pythons):
    """dispatch+combine through Python (the rows in pythons: "python" with numpy arrays, "py-torch" with
    torch tensors) against ep-bench (C++), same shape, same provider, one run."""
    import ponte
    ep_bench = os.path.join(build, "bench", "ep-bench")
    if not hasattr(ponte, "EpBuffer") or not os.access(ep_bench, os.X_OK):
        print("py_overhead: MoE comparison SKIPPED: %s" % ("ponte.EpBuffer is not built" if not hasattr(ponte, "EpBuffer")
                                                          else ep_bench + " is not built"))
        return True
    ok = True
    print()
    print("py_overhead: MoE dispatch+combine, W=%d, T=%d H=%d top-%d E=%d %s, p50 over %d iterations of the slowest"
          " rank, best of %d, rows rotated each round" % (world, shape["tokens"], shape["hidden"], shape["topk"],
                                                          shape["experts"], shape["dtype"], shape["iters"], repeat))
    print("%-14s %-8s %12s %12s %12s %9s" % ("provider", "who", "dispatch_us", "combine_us", "sum_us", "verified"))
    for provider in providers:
        cfg = dict(shape, provider=provider)
        whos = ("c++",) + tuple(pythons)
        runs = {who: [] for who in whos}
        for i in range(repeat):
            for who in rotated(whos, i):
                try:
                    tensors = "torch" if who == "py-torch" else "numpy"
                    runs[who].append(cpp_ep(ep_bench, cfg, world) if who == "c++" else
                                     python_ep(dict(cfg, tensors=tensors), world, build))
                except Exception as e:
                    print("py_overhead: %s dispatch+combine on %s: %s" % (who, provider, e))
                    runs[who].append(None)  # keeps the rounds aligned for the per-round ratios
                    ok = False
        best = {k: min((r for r in v if r), key=lambda r: r["d"] + r["c"]) for k, v in runs.items() if any(v)}
        for who in whos:
            if who in best:
                r = best[who]
                print("%-14s %-8s %12.1f %12.1f %12.1f %9s" % (provider, who, r["d"], r["c"], r["d"] + r["c"],
                                                             "yes" if r["verified"] else "NO"))
                ok &= bool(r["verified"])
        for who in pythons:
            if who not in best or "c++" not in best:
                continue
            print("%-14s ratio c++/%s time = %.3f (target >= 0.9)" % (
                provider, who, (best["c++"]["d"] + best["c++"]["c"]) / (best[who]["d"] + best[who]["c"])))
            rounds = [(k["d"] + k["c"]) / (q["d"] + q["c"]) if q and k else None
                      for q, k in zip(runs[who], runs["c++"])]
            print("%-14s   c++/%s %s" % (provider, who, per_round(rounds)))
    return ok


if __name__ == "__main__":
    sys.exit(main())
