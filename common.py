"""The only shared file: process-group set-up and teardown, refusals, logging, overlap timing, traffic counting.

The lessons' demos use it; their building blocks never do (each needs only torch, so it pastes alone). A demo
starts with `rank, world, device = setup()` and ends with `finish("what it proved")`. setup() joins the group
torchrun describes: NCCL when CUDA devices exist, else gloo (BACKEND=gloo|nccl overrides); device cuda:LOCAL_RANK
with NCCL, so the same file runs on every node of `torchrun --nnodes=N`; every group times out after PG_TIMEOUT
seconds (default 30; pass pg_timeout() to each group a demo makes); the same seed on every rank; TRACE=DIR writes
one trace of all ranks (tools/trace.py). refuse(why) says one line on every rank and exits 2. `python FILE`
relaunches FILE under torchrun, standalone, with NPROC processes (default 4). The test instruments (memory
meters, refused, replays) are in tests/tools.py.
"""
import collections
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

EXIT_REFUSED = 2
_timeout = datetime.timedelta(seconds=30)  # setup() sets it from PG_TIMEOUT
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _tracing():  # TRACE=DIR only: tools/trace.py, loaded by path (tests/tools.py takes the name `tools`)
    if "_trace" not in sys.modules:
        import importlib.util
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "trace.py")
        spec = importlib.util.spec_from_file_location("_trace", path)
        spec.loader.exec_module(sys.modules.setdefault("_trace", importlib.util.module_from_spec(spec)))
    return sys.modules["_trace"]


def _trace_write():
    if "_trace" in sys.modules:
        sys.modules["_trace"].write(log)


def _script():
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "lesson.py"


def _say(text: str, stream=None):  # one write for a line and its newline: ranks share torchrun's stream
    (stream or sys.stdout).write(text + "\n")
    (stream or sys.stdout).flush()


def refuse(why: str):
    """One line saying why this run cannot go on; exit 2 once every rank has said it (torchrun kills the others
    when one exits). Call it on every rank. A gloo group is made for the wait if none exists yet."""
    rank = os.environ.get("RANK", "?")
    _say(f"[R{rank}] {_script()} refuses to run: {why}", sys.stderr)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=_timeout)
    teardown()
    sys.exit(EXIT_REFUSED)


def launched_world_size() -> int:
    """WORLD_SIZE from torchrun's environment, readable before the group exists (to refuse early). Started as
    `python FILE`, it runs FILE again under torchrun (standalone, NPROC processes, default 4)."""
    if all(v in os.environ for v in _TORCHRUN_VARS):
        return int(os.environ["WORLD_SIZE"])
    nproc = os.environ.get("NPROC", "").strip() or "4"  # empty means the default, as for BACKEND and PG_TIMEOUT
    if not nproc.isdigit() or int(nproc) < 1:
        _say(f"{_script()}: NPROC={nproc!r} is not a number of processes (a whole number >= 1)", sys.stderr)
        sys.exit(EXIT_REFUSED)
    _say(f"not started by torchrun: running torchrun --standalone --nproc-per-node={nproc} "
         f"{' '.join([_script(), *sys.argv[1:]])}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway (it warns when it has to)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", sys.argv[0], *sys.argv[1:]])


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        refuse(f"{name}={raw!r}: give the seconds a collective may wait, a number > 0 (default {default:g})")
    return value


def setup(seed: int = 0):
    """Join the process group; return (rank, world_size, device)."""
    launched_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = os.environ.get("BACKEND", "").strip().lower() or ("nccl" if gpus else "gloo")
    if backend not in ("gloo", "nccl"):
        refuse(f"BACKEND={backend!r}; use gloo or nccl")
    if backend == "nccl" and local_world > gpus:  # decided alike on every rank of the node: all refuse
        refuse(f"NCCL needs one CUDA device per process: {local_world} processes on this node, {gpus} CUDA "
               f"devices; use --nproc-per-node={gpus} or BACKEND=gloo" if gpus else
               f"NCCL needs one CUDA device per process, and this machine has 0 CUDA devices; use BACKEND=gloo")
    global _timeout
    _timeout = timeout = datetime.timedelta(seconds=_seconds("PG_TIMEOUT", 30))
    trace_dir = _tracing().directory(refuse) if os.environ.get("TRACE", "").strip() else None
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    torch.manual_seed(seed)
    if trace_dir:
        _tracing().start(trace_dir, device, os.path.splitext(_script())[0])
    return dist.get_rank(), dist.get_world_size(), device


def pg_timeout() -> datetime.timedelta:
    """PG_TIMEOUT, the world group's: dist.new_group(ranks, timeout=pg_timeout()) (torch's default is 30 min)."""
    return _timeout


def wait_all(group=None):
    """Block until every rank of `group` arrives; on gloo a rank that never comes is named (monitored_barrier)."""
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group, timeout=_timeout, wait_all_ranks=True)  # its default is not the group's
    else:
        dist.barrier(group)


def teardown():
    """Wait for every rank, destroy every group (a gloo group left to interpreter shutdown can abort the process);
    rank 0, which may host the store, leaves last (destroying with the store's host gone can hang)."""
    _trace_write()
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    wait_all()
    dist.destroy_process_group()
    store.set(f"left/{rank}", "1")
    if rank == 0 and world > 1:
        store.wait([f"left/{r}" for r in range(1, world)])


def finish(summary: str):
    """Rank 0 prints the lesson's final line (the tests look for it); then tear down."""
    _trace_write()
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
    if "_trace" in sys.modules:
        sys.modules["_trace"].section(title)


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
_C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
         "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
         "allgather_coalesced_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
         "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
         "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
         "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
         "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0), "scatter_": ("scatter", 1),
         "gather_": ("gather", 1), "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0)}


def _nbytes(x) -> int:
    return x.nbytes if isinstance(x, torch.Tensor) else sum(_nbytes(y) for y in x)


def traffic():
    """`with traffic() as t:` records every collective and P2P call this rank issues inside it:
    t.counts[op], t.bytes[op] (calls; bytes of the tensors this rank handed in: what an all-reduce reduces, an
    all-gather contributes, a send sends, a recv fills), t.calls [(op, group's global ranks, bytes)] in order.
    The wire bytes follow by the closed form (ring_bytes). A dispatch mode, like PyTorch's CommDebugMode: it sees
    each c10d op, also inside backward, and also send and recv (docs/plumbing.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Traffic(TorchDispatchMode):
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
                nbytes = _nbytes(args[which])
                self.counts[name] += 1
                self.bytes[name] += nbytes
                self.calls.append((name, tuple(dist.get_process_group_ranks(pg)), nbytes))
            return func(*args, **(kwargs or {}))

    return Traffic()
