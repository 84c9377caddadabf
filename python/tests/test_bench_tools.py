"""bench/py_overhead.py, run small: every stream (Python per write, Python in paged_write batches,
ponte-bench) verifies its data before it is timed, and the MoE rows (numpy arrays and torch tensors)
verify theirs; exit status 0."""
import os
import re
import subprocess
import sys

from peers import engine_workers

REPO = os.environ.get("PONTE_REPO", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# The build root whose python/ the tests import (conftest: PONTE_PY_BUILD, else build/python).
BUILD = os.path.dirname(os.environ.get("PONTE_PY_BUILD", os.path.join(REPO, "build", "python")).rstrip(os.sep))


def test_py_overhead_verifies_every_row_on_shm_and_tcp():
    bench = os.path.join(BUILD, "bench", "ponte-bench")
    assert os.access(bench, os.X_OK), "%s is not built: the stream's reference row cannot run" % bench
    cmd = [sys.executable, os.path.join(REPO, "bench", "py_overhead.py"), "--build", BUILD, "--iters", "256",
           "--repeat", "1", "--batch", "4", "--ep-iters", "3", "--providers", "shm,tcp;ofi_rxm", "--ep-tensors", "both"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "MoE comparison SKIPPED" not in p.stdout, "ep-bench or ponte.EpBuffer is not built"
    for provider in ("shm", "tcp;ofi_rxm"):
        for who in ("c\\+\\+", "python", "py-b4"):
            assert re.search(r"^%s\s+%s\s+\d+\.\d+" % (re.escape(provider), who), p.stdout, re.M), (provider, who)
        assert re.search(r"^%s\s+ratio python/c\+\+ = \d" % re.escape(provider), p.stdout, re.M), provider
        assert re.search(r"^%s\s+ratio py-b4/c\+\+ = \d" % re.escape(provider), p.stdout, re.M), provider
        for who in ("python", "py-b4"):
            assert re.search(r"^%s\s+%s/c\+\+ per round \d+\.\d+; median \d" % (re.escape(provider), who),
                             p.stdout, re.M), (provider, who)
        for who in ("python", "py-torch"):  # numpy arrays, then torch tensors over the same memory
            assert re.search(r"^%s\s+ratio c\+\+/%s time = \d" % (re.escape(provider), who), p.stdout, re.M), who
            assert re.search(r"^%s\s+c\+\+/%s per round \d+\.\d+; median \d" % (re.escape(provider), who),
                             p.stdout, re.M), (provider, who)
            assert re.search(r"^%s\s+%s .* yes$" % (re.escape(provider), who), p.stdout, re.M), (provider, who)


def test_py_overhead_rotates_the_rows_each_round():
    """Every row runs in every place of a round once in as many rounds as there are rows: a row kept
    third measured its place as well as itself."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("py_overhead", os.path.join(REPO, "bench", "py_overhead.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = ("c++", "python", "py-torch")
    orders = [tool.rotated(rows, i) for i in range(len(rows))]
    for order in orders:
        assert sorted(order) == sorted(rows), order  # each round runs every row once
    for place in range(len(rows)):
        assert sorted(o[place] for o in orders) == sorted(rows), (place, orders)
    assert orders[0] == list(rows)  # the first round keeps the order the table prints
    assert tool.rotated(rows, 4) == orders[1]  # more rounds than rows wrap around


def children_of(pid):
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return kids


def test_ponte_bench_worker_cores_pins_each_ends_worker():
    """--worker-cores I,T: the initiator's engine worker may run on core I only, the forked
    target's on T only."""
    import pytest
    import time
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("this process may use one core only: pinned workers look like unpinned ones")
    first, second = cores[-1], cores[0]
    bench = os.path.join(BUILD, "bench", "ponte-bench")
    p = subprocess.Popen([bench, "--provider", "shm", "--op", "write", "--sizes", "4k", "--iters", "100000000",
                          "--timeout", "60", "--worker-cores", "%d,%d" % (first, second)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        mine, theirs = {}, {}
        deadline = time.monotonic() + 20
        # A worker names itself, then pins itself, as it starts: looked at until both are pinned.
        while time.monotonic() < deadline and p.poll() is None and not (
                list(mine.values()) == [{first}] and list(theirs.values()) == [{second}]):
            mine = engine_workers(p.pid)
            theirs = {t: c for k in children_of(p.pid) for t, c in engine_workers(k).items()}
            time.sleep(0.02)
        assert mine and theirs, "no engine worker seen in both ends (exit %r)" % p.poll()
        assert list(mine.values()) == [{first}], "initiator's workers: %r" % mine
        assert list(theirs.values()) == [{second}], "target's workers: %r" % theirs
    finally:
        p.kill()
        p.wait(30)
    bad = subprocess.run([bench, "--worker-cores", "1,2,3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "--worker-cores wants I or I,T" in bad.stdout, bad.stdout
    outside = max(os.sched_getaffinity(0)) + 1
    if outside < 1024:
        bad = subprocess.run([bench, "--worker-cores", "%d,%d" % (first, outside)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=30)
        assert bad.returncode == 2 and "may not run on core %d" % outside in bad.stdout, bad.stdout


def test_py_overhead_pin_places_both_streams():
    """--pin S,R runs every stream row pinned (and says where); the rows still verify their data."""
    import pytest
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("this process may use one core only: --pin needs two")
    cmd = [sys.executable, os.path.join(REPO, "bench", "py_overhead.py"), "--build", BUILD, "--iters", "256",
           "--repeat", "1", "--batch", "0", "--ep", "off", "--providers", "shm,tcp;ofi_rxm",
           "--pin", "%d,%d" % (cores[0], cores[-1])]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "pinned: sending worker on core %d, target's on core %d" % (cores[0], cores[-1]) in p.stdout
    for provider in ("shm", "tcp;ofi_rxm"):
        assert re.search(r"^%s\s+ratio python/c\+\+ = \d" % re.escape(provider), p.stdout, re.M), provider
    same = subprocess.run(cmd[:-1] + ["%d,%d" % (cores[0], cores[0])], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert same.returncode != 0 and "--pin wants two different cores" in same.stdout, same.stdout
