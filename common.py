"""The only shared file: process-group set-up and teardown, refusals, logging, overlap timing, traffic counting.

A lesson's demo uses it; its building blocks never do (each needs only torch, so it pastes alone). A demo starts with
`rank, world, device = setup()` and ends with `finish("what it proved")`. setup() joins the group torchrun describes:
NCCL on CUDA devices (cuda:LOCAL_RANK: every node of `torchrun --nnodes=N` runs the same file), else gloo; BACKEND=
gloo|nccl overrides. Every group times out after PG_TIMEOUT seconds (default 30; pass pg_timeout() to each group a
demo makes). TRACE=DIR writes one trace of all ranks (tools/trace.py). `python FILE` runs FILE under torchrun.
"""
import collections
import datetime
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_timeout = datetime.timedelta(seconds=30)  # setup() sets it from PG_TIMEOUT
_trace = None  # tools/trace.py, when TRACE is set
_HERE = os.path.dirname(os.path.abspath(__file__))


def _script():
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "lesson.py"


def _say(text: str, stream=None):  # one write for a line and its newline: ranks share torchrun's stream
    (stream or sys.stdout).write(text + "\n")
    (stream or sys.stdout).flush()


def refuse(why: str):
    """One line saying why this run cannot go on; exit 2 once every rank has said it (torchrun kills the others
    when one exits). Call it on every rank. A gloo group is made for the wait if none exists yet."""
    _say(f"[R{os.environ.get('RANK', '?')}] {_script()} refuses to run: {why}", sys.stderr)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=_timeout)
    teardown()
    sys.exit(2)


def launched_world_size() -> int:
    """WORLD_SIZE from torchrun's environment, readable before the group exists (to refuse early). Started as
    `python FILE`, it runs FILE again under torchrun (standalone, NPROC processes, default 4)."""
    if all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["WORLD_SIZE"])
    nproc = os.environ.get("NPROC", "").strip() or "4"  # empty means the default, as for BACKEND and PG_TIMEOUT
    if not nproc.isdigit() or int(nproc) < 1:
        _say(f"{_script()}: NPROC={nproc!r} is not a number of processes (a whole number >= 1)", sys.stderr)
        sys.exit(2)
    _say(f"not started by torchrun: running torchrun --standalone --nproc-per-node={nproc} "
         f"{' '.join([_script(), *sys.argv[1:]])}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway (it warns when it has to)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", sys.argv[0], *sys.argv[1:]])


def setup(seed: int = 0):
    """Join the process group; seed every rank alike; return (rank, world_size, device)."""
    global _timeout, _trace
    launched_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = os.environ.get("BACKEND", "").strip().lower() or ("nccl" if gpus else "gloo")
    if backend not in ("gloo", "nccl"):
        refuse(f"BACKEND={backend!r}; use gloo or nccl")
    if backend == "nccl" and local_world > gpus:  # decided alike on every rank of the node: all refuse
        refuse(f"NCCL needs one CUDA device per process: {local_world} processes on this node, {gpus} CUDA devices; "
               f"use BACKEND=gloo" + (f" or --nproc-per-node={gpus}" if gpus else ""))
    raw = os.environ.get("PG_TIMEOUT", "").strip() or "30"
    seconds = float(raw) if raw.replace(".", "", 1).isdigit() else 0.0  # refuses "inf", "nan", "-5", "1e3"
    if seconds <= 0:
        refuse(f"PG_TIMEOUT={raw!r}: give the seconds a collective may wait, a number > 0 (default 30)")
    _timeout = datetime.timedelta(seconds=seconds)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=_timeout, device_id=device if backend == "nccl" else None)
    torch.manual_seed(seed)
    if os.environ.get("TRACE", "").strip():  # tools/trace.py, by its path: in tests/, `tools` is tests/tools.py
        spec = importlib.util.spec_from_file_location("_trace", os.path.join(_HERE, "tools", "trace.py"))
        _trace = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_trace)
        _trace.start(_trace.directory(refuse), device, os.path.splitext(_script())[0])
    return dist.get_rank(), dist.get_world_size(), device


def pg_timeout() -> datetime.timedelta:
    """PG_TIMEOUT, the world group's: dist.new_group(ranks, timeout=pg_timeout()) (torch's default is 30 min)."""
    return _timeout


def teardown():
    """Wait for every rank (on gloo a monitored barrier names one that never comes); destroy every group (one left
    to interpreter shutdown can abort the process); rank 0, the store's likely host, leaves last (else it can hang)."""
    if _trace:
        _trace.write(log)
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=_timeout, wait_all_ranks=True)  # its default is not the group's
    else:
        dist.barrier()
    dist.destroy_process_group()
    store.set(f"left/{rank}", "1")
    if rank == 0 and world > 1:
        store.wait([f"left/{r}" for r in range(1, world)])


def finish(summary: str):
    """Rank 0 prints the lesson's final line (the tests look for it); then tear down."""
    if _trace:
        _trace.write(log)
    log(f"all checks passed: {summary}")
    teardown()


def log(msg: str = ""):
    """Rank 0 prints one line."""
    if dist.get_rank() == 0:
        _say(f"[R0] {msg}")


def head(title: str):
    """Rank 0 prints a section heading; under TRACE every rank's trace gets a range named `title` until the next."""
    if dist.get_rank() == 0:
        _say(f"\n== {title}")
    if _trace:
        _trace.section(title)


def log_all(msg: str, group=None):
    """Every rank of `group` contributes one line; its first rank prints them in rank order."""
    lines = [None] * dist.get_world_size(group)
    dist.all_gather_object(lines, f"[R{dist.get_rank()}] {msg}", group=group)
    if dist.get_rank() == dist.get_global_rank(group or dist.group.WORLD, 0):
        _say("\n".join(lines))


def sync(device: torch.device):
    """Wait for queued GPU work, so that a clock read after it measures the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def overlap(start_comm, compute):
    """Run `compute()` while the collective `start_comm()` started (async_op=True, its Work returned) travels;
    returns compute's result, with the collective's output ready."""
    work = start_comm()
    out = compute()
    work.wait()
    return out


def time_overlap(start_comm, compute, device, iters: int = 5) -> dict:
    """Median seconds of comm alone, compute alone, and both overlapped, measured alike on every rank."""
    def timed(fn):
        samples = []
        for _ in range(iters + 1):  # the first run warms up and is dropped
            sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync(device)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])

    return {"comm": timed(lambda: start_comm().wait()), "compute": timed(compute),
            "overlapped": timed(lambda: overlap(start_comm, compute))}


def ring_bytes(op: str, V, W: int) -> float:
    """Bytes one rank sends for a V-byte `op` over W ranks, by the ring algorithm: all_reduce 2(W-1)/W * V;
    reduce_scatter, all_gather, all_to_all (W-1)/W * V (V: the reduce-scatter's input, the all-gather's output,
    the all-to-all's input); broadcast V (the root's). ring_bytes(op, 1, W) is nccl-tests' bus bandwidth factor."""
    return {"all_reduce": 2 * (W - 1) / W, "reduce_scatter": (W - 1) / W, "all_gather": (W - 1) / W,
            "all_to_all": (W - 1) / W, "broadcast": 1}[op] * V


# ---- traffic: what this rank hands to c10d ------------------------------------------------------------------
# c10d op -> (name, index of the argument holding the tensors this rank hands in). In-place ops (all-reduce,
# broadcast, reduce, send, recv) hand their first argument; the others are (output, input, ...).
_C10D = {op: (name, which) for name, which, ops in [
    ("all_reduce", 0, "allreduce_ allreduce_coalesced_"), ("broadcast", 0, "broadcast_"), ("reduce", 0, "reduce_"),
    ("send", 0, "send"), ("recv", 0, "recv_ recv_any_source_"), ("scatter", 1, "scatter_"), ("gather", 1, "gather_"),
    ("all_gather", 1, "_allgather_base_ allgather_ allgather_coalesced_ allgather_into_tensor_coalesced_"),
    ("reduce_scatter", 1, "_reduce_scatter_base_ reduce_scatter_ reduce_scatter_tensor_coalesced_"),
    ("all_to_all", 1, "alltoall_base_ alltoall_")] for op in ops.split()}


class traffic(TorchDispatchMode):
    """`with traffic() as t:` records every collective and P2P call this rank issues inside it:
    t.counts[op], t.bytes[op] (calls; bytes of the tensors this rank handed in: what an all-reduce reduces, an
    all-gather contributes, a send sends, a recv fills), t.calls [(op, group's global ranks, bytes)] in order.
    The wire bytes follow by the closed form (ring_bytes: NCCL's rings; gloo's reduce-scatter is an all-reduce).
    A dispatch mode, like torch's CommDebugMode: each c10d op, in backward too, send and recv (docs/plumbing.md)."""

    @classmethod
    def _should_skip_dynamo(cls):  # torch.compile need not skip this mode: saves importing dynamo (~3 s)
        return False

    def __init__(self):
        super().__init__()
        self.counts, self.bytes, self.calls = collections.Counter(), collections.Counter(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, which = _C10D.get(func._overloadpacket.__name__, (None, None))
        if name is not None and func.namespace == "c10d":
            pg = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                      and "ProcessGroup" in str(a._type()))
            nbytes = sum(x.nbytes for x in tree_leaves(args[which]))
            self.counts[name] += 1
            self.bytes[name] += nbytes
            self.calls.append((name, tuple(dist.get_process_group_ranks(pg)), nbytes))
        return func(*args, **(kwargs or {}))
