#!/usr/bin/env python3
"""Plain torch.distributed all_reduce and all_to_all on the NCCL backend, verified and timed.

Nothing in it knows about ponte: launched with NCCL_NET_PLUGIN=ponte (see the configurations in
this folder and their `torch` mode) NCCL moves the inter-node traffic through the plugin.

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=$MASTER_ADDR:29500 torch_collectives.py [--max-mib 256] [--iters 20]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def bench(op, nbytes, iters, warmup, rank, world, device):
    numel = max(nbytes // 4, world)
    numel -= numel % world  # all_to_all splits evenly
    if op == "all_reduce":
        x = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=device)
        expect = world * (world + 1) / 2

        def run():
            dist.all_reduce(x)

        def check():
            # After warmup + iters reductions the value grew geometrically; check one clean round.
            x.fill_(float(rank + 1))
            dist.all_reduce(x)
            torch.cuda.synchronize(device)
            return bool(torch.all(x == expect).item())

        busbw_factor = 2 * (world - 1) / world
    else:
        chunk = numel // world
        src = torch.arange(numel, dtype=torch.float32, device=device) + rank * numel
        dst = torch.empty_like(src)

        def run():
            dist.all_to_all_single(dst, src)

        def check():
            dist.all_to_all_single(dst, src)
            torch.cuda.synchronize(device)
            # Chunk p of dst came from rank p: its chunk `rank`.
            ok = True
            for p in range(world):
                first = p * numel + rank * chunk
                got = dst[p * chunk:(p + 1) * chunk]
                want = torch.arange(first, first + chunk, dtype=torch.float32, device=device)
                ok = ok and bool(torch.equal(got, want))
            return ok

        busbw_factor = (world - 1) / world
    for _ in range(warmup):
        run()
    torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / iters
    ok = check()
    size = numel * 4
    algbw = size / dt / 1e9
    return size, dt * 1e6, algbw, algbw * busbw_factor, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--min-kib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # One GPU per rank; the one-GPU smoke test puts both ranks on GPU 0.
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)

    failures = 0
    for op in ("all_reduce", "all_to_all"):
        if rank == 0:
            print(f"# {op}: {world} ranks, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
                  f"NCCL_NET_PLUGIN={os.environ.get('NCCL_NET_PLUGIN', '')}")
            print(f"# {'size(B)':>12} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} ok")
        nbytes = args.min_kib * 1024
        while nbytes <= args.max_mib * 1024 * 1024:
            size, us, algbw, busbw, ok = bench(op, nbytes, args.iters, args.warmup, rank, world, device)
            oks = torch.tensor([1 if ok else 0], device=device)
            dist.all_reduce(oks)
            all_ok = int(oks.item()) == world
            failures += 0 if all_ok else 1
            if rank == 0:
                print(f"  {size:>12} {us:>10.1f} {algbw:>12.3f} {busbw:>12.3f} {'yes' if all_ok else 'NO'}")
            nbytes *= 4
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise SystemExit(f"{failures} size(s) gave wrong results")


if __name__ == "__main__":
    main()
