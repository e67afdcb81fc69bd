"""The only shared file: process-group set-up, logging, and async-overlap helpers (and, on torch < 2.13, the
two renamed collectives: importing it adds `dist.all_gather_single` and `dist.reduce_scatter_single`).

Every numbered lesson starts with `rank, world, device = setup()` and ends with `finish("what it proved")`.

    setup()        joins the group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)
                   backend: NCCL when CUDA devices exist, else gloo; BACKEND=gloo|nccl overrides. NCCL wants
                            one device per process: more processes on a node than devices are refused
                   device:  cuda:LOCAL_RANK with NCCL, cpu with gloo. LOCAL_RANK, not RANK, picks the device,
                            so the same file runs on every node of `torchrun --nnodes=N`
                   timeout: PG_TIMEOUT seconds (default 30), so a deadlock raises instead of hanging
                   seed:    the same on every rank, so every rank can build the same reference inputs
    refuse(why)    one line on each rank, process exit code 2 (torchrun itself then exits 1): for world
                   sizes or options a lesson cannot use
    finish(what)   rank 0's last line, "[R0] all checks passed: ...", then a barrier (and on NCCL, destroy)
    log / head     rank 0 speaks; log_all prints one line from every rank, in rank order
    overlap(...)   start a collective with async_op=True, compute while it travels, then wait
    time_overlap   this rank's seconds for comm alone, compute alone and both overlapped (syncs CUDA first)

Started without torchrun, a lesson prints the torchrun command to use and exits with code 2.
"""
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# torch 2.13 renamed two collectives; the old names still work there but warn. Lessons use the new
# names, and these two lines give them to older torch.
if not hasattr(dist, "all_gather_single"):
    dist.all_gather_single = dist.all_gather_into_tensor
if not hasattr(dist, "reduce_scatter_single"):
    dist.reduce_scatter_single = dist.reduce_scatter_tensor

EXIT_REFUSED = 2
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _script():
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "lesson.py"


def refuse(why: str):
    """Print one line saying why this run cannot go on, on this rank, and exit with code 2."""
    rank = os.environ.get("RANK", "?")
    print(f"[R{rank}] {_script()} refuses to run: {why}", file=sys.stderr, flush=True)
    if dist.is_initialized() and dist.get_backend() == "nccl":  # see teardown()
        dist.destroy_process_group()
    sys.exit(EXIT_REFUSED)


def launched_world_size() -> int:
    """WORLD_SIZE from torchrun's environment, readable before the group exists (to refuse early).

    Started without torchrun, it prints the torchrun command to use and exits with code 2.
    """
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        print(f"{_script()} is a distributed lesson: start it with torchrun, e.g.\n"
              f"    torchrun --nproc-per-node=4 {_script()}\n"
              f"(missing environment variables: {', '.join(missing)})", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)
    return int(os.environ["WORLD_SIZE"])


def setup(seed: int = 0):
    """Join the process group; return (rank, world_size, device)."""
    launched_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = os.environ.get("BACKEND", "nccl" if gpus else "gloo").lower()
    if backend not in ("gloo", "nccl"):
        refuse(f"BACKEND={backend!r}; use gloo or nccl")
    if backend == "nccl" and local_world > gpus:  # decided alike on every rank of the node: all refuse
        refuse(f"NCCL needs one CUDA device per process: {local_world} processes on this node, {gpus} CUDA "
               f"devices; use --nproc-per-node={gpus} or BACKEND=gloo" if gpus else
               f"NCCL needs one CUDA device per process, and this machine has 0 CUDA devices; use BACKEND=gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "30")))
    dist.init_process_group(backend, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    torch.manual_seed(seed)
    return dist.get_rank(), dist.get_world_size(), device


def teardown():
    """Wait for every rank (so none leaves while another still talks to it), then free the group.

    NCCL needs destroy_process_group() to free its communicators (and warns without it). On gloo the process's
    exit frees the group: torch 2.6's destroy_process_group() on gloo can hang when the rank that hosts the
    store has already left (seen in this project's tests), and 2.13 needs neither.
    """
    dist.barrier()
    if dist.get_backend() == "nccl":
        dist.destroy_process_group()


def finish(summary: str):
    """Rank 0 prints the lesson's final line (the tests look for it); then tear down."""
    log(f"all checks passed: {summary}")
    teardown()


def log(msg: str = ""):
    """Rank 0 prints one line."""
    if dist.get_rank() == 0:
        print(f"[R0] {msg}", flush=True)


def head(title: str):
    """Rank 0 prints a section heading."""
    if dist.get_rank() == 0:
        print(f"\n== {title}", flush=True)


def log_all(msg: str, group=None):
    """Every rank of `group` contributes one line; its first rank prints them in rank order."""
    lines = [None] * dist.get_world_size(group)
    dist.all_gather_object(lines, f"[R{dist.get_rank()}] {msg}", group=group)
    if dist.get_rank() == dist.get_global_rank(group or dist.group.WORLD, 0):
        print("\n".join(lines), flush=True)


def sync(device: torch.device):
    """Wait for queued GPU work, so that a clock read after it measures the work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def overlap(start_comm, compute):
    """Run `compute()` while the communication started by `start_comm()` travels.

    start_comm: launches a collective with async_op=True and returns its Work handle.
    Returns compute's result; when it returns, the collective's output is ready to use.
    """
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

    return {"comm": timed(lambda: start_comm().wait()),
            "compute": timed(compute),
            "overlapped": timed(lambda: overlap(start_comm, compute))}
