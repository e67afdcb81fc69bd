"""The only shared file: process-group set-up and teardown, logging, overlap timing, traffic and memory
counting, traces, and three checking tools.

The lessons' demos use it; their building blocks never do (each block needs only torch, so it pastes alone).
Every demo starts with `rank, world, device = setup()` and ends with `finish("what it proved")`.

    setup()        joins the group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)
                   backend: NCCL when CUDA devices exist, else gloo; BACKEND=gloo|nccl overrides. NCCL wants
                            one device per process: more processes on a node than devices are refused
                   device:  cuda:LOCAL_RANK with NCCL, cpu with gloo. LOCAL_RANK, not RANK, picks the device,
                            so the same file runs on every node of `torchrun --nnodes=N`
                   timeout: PG_TIMEOUT seconds (default 30), so a deadlock raises instead of hanging
                   seed:    the same on every rank, so every rank can build the same reference inputs
                   trace:   TRACE=DIR profiles the run (torch.profiler) and writes DIR/<lesson>.json: every
                            rank one process row, each head() section a labelled range; open it in
                            ui.perfetto.dev or chrome://tracing (README: "Looking at a run")
    refuse(why)    for a world size or option the lesson cannot use, decided alike on every rank: each rank
                   prints one line, all wait for each other (so none is killed before it spoke), exit code 2
    wait_all()     a barrier that, on gloo, names the ranks that never arrived (monitored_barrier)
    finish(what)   rank 0's last line, "[R0] all checks passed: ...", then teardown(): wait for all, destroy
    log / head     rank 0 speaks; log_all prints one line from every rank of a group, in group-rank order
    overlap(...)   start a collective with async_op=True, compute while it travels, then wait
    time_overlap   this rank's seconds for comm alone, compute alone and both overlapped (syncs CUDA first)
    traffic()      `with traffic() as t:` counts this rank's collectives and P2P calls and the bytes handed to them
    memory()       `with memory() as m:` the bytes this rank allocates and still holds (m.live(), m.peak);
                   held_bytes(tensors) the bytes behind tensors that exist already
                   kept_for_backward(fn, params) fn()'s output and the bytes autograd saved for its backward
    checking tools strided_groups(stride): sub-groups whose group rank is not the global rank;
                   replays(schedules): whether posted P2P orders complete as blocking sends (or deadlock);
                   ring_bytes(op, V, W): the bytes one rank sends for a V-byte collective, ring algorithm

`python FILE` (no torchrun) relaunches FILE under torchrun's own entry point, standalone, with NPROC processes
(default 4): the same as `torchrun --standalone --nproc-per-node=4 FILE`.
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
_trace = None  # TRACE=DIR: {"dir", "prof", "section"} while the profiler runs
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _script():
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "lesson.py"


def _say(text: str, stream=None):
    """text and its newline in one write: under torchrun the ranks share one stream, and print() writes the
    newline apart (with PYTHONUNBUFFERED, a write each), so another rank's line could land in between."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


def refuse(why: str):
    """Print one line saying why this run cannot go on, wait until every rank has said it, exit with code 2.

    Call it on every rank (the decision must be the same everywhere). Under torchrun, the first rank to exit
    gets the others killed, so no rank leaves before all have printed: a gloo group is made for that if none
    exists yet (refusals come before setup(), and NCCL may be what is being refused).
    """
    rank = os.environ.get("RANK", "?")
    _say(f"[R{rank}] {_script()} refuses to run: {why}", sys.stderr)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=_timeout)
    teardown()
    sys.exit(EXIT_REFUSED)


def launched_world_size() -> int:
    """WORLD_SIZE from torchrun's environment, readable before the group exists (to refuse early).

    Started as `python FILE`, it runs FILE again under torchrun (standalone, NPROC processes, default 4) and
    exits with torchrun's exit code.
    """
    if all(v in os.environ for v in _TORCHRUN_VARS):
        return int(os.environ["WORLD_SIZE"])
    nproc = os.environ.get("NPROC", "").strip() or "4"  # empty means the default, as for BACKEND and PG_TIMEOUT
    if not nproc.isdigit() or int(nproc) < 1:
        print(f"{_script()}: NPROC={nproc!r} is not a number of processes (a whole number >= 1)",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)
    cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", sys.argv[0], *sys.argv[1:]]
    print(f"not started by torchrun: running torchrun --standalone --nproc-per-node={nproc} "
          f"{' '.join([_script(), *sys.argv[1:]])}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets anyway (it warns when it has to)
    os.execv(sys.executable, [sys.executable, *cmd])


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
    trace_dir = _trace_dir()
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    torch.manual_seed(seed)
    if trace_dir:
        _trace_start(trace_dir, device)
    return dist.get_rank(), dist.get_world_size(), device


def pg_timeout() -> datetime.timedelta:
    """PG_TIMEOUT (default 30 s), which setup() gave the world group: pass it to every group a demo makes, as
    dist.new_group(ranks, timeout=pg_timeout()). Left out, a new group waits torch's default (30 min on gloo)."""
    return _timeout


def wait_all(group=None):
    """Block until every rank of `group` arrives. On gloo a monitored barrier: a rank that never comes is named
    in the error (a plain barrier would only time out)."""
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group, timeout=_timeout, wait_all_ranks=True)  # its default is not the group's
    else:
        dist.barrier(group)


def teardown():
    """Wait for every rank, then destroy every group; the rank that may host the store leaves last.

    Destroying matters on gloo too: a gloo group left to interpreter shutdown can abort the process after all
    checks passed. Rank 0 may host the rendezvous store, and a rank destroying its group while the store's
    host is gone can hang (torch 2.6), so rank 0 waits for the others' word before it leaves.
    """
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
    if _trace is not None:
        if _trace["section"] is not None:
            _trace["section"].__exit__(None, None, None)
        _trace["section"] = torch.profiler.record_function(title)
        _trace["section"].__enter__()


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


# ---- checking tools for the demos ----------------------------------------------------------------------------
def strided_groups(stride: int = 2):
    """[(group, its global ranks)] for {0, s, 2s, ..}, {1, s+1, ..}, ..., s = stride (W < s: one per rank); this
    rank's is [rank % stride]. Every rank makes every group, in order (new_group is collective). From W > s a group
    rank is not the global rank ({0, 2} and {1, 3} at W = 4), so a block that confuses the two fails."""
    W = dist.get_world_size()
    ranks = [list(range(p, W, stride)) for p in range(min(W, stride))]
    return [(dist.new_group(r, timeout=_timeout), r) for r in ranks]


def replays(schedules) -> bool:
    """Whether every rank's posted P2P order completes when each op blocks: a send finishes only once its peer has
    reached the matching receive (gloo's send; NCCL's above its eager size). schedules[r] = rank r's ops in posted
    order, ("send" | "recv", peer[, tag]); a send meets the peer's receive from this rank with the same tag.
    False is a deadlock: the ranks wait on each other."""
    pos, moved = [0] * len(schedules), True
    while moved:
        moved = False
        for a, ops in enumerate(schedules):
            if pos[a] < len(ops) and ops[pos[a]][0] == "send":
                _, b, *tag = ops[pos[a]]
                if pos[b] < len(schedules[b]) and tuple(schedules[b][pos[b]]) == ("recv", a, *tag):
                    pos[a], pos[b], moved = pos[a] + 1, pos[b] + 1, True
    return all(p == len(ops) for p, ops in zip(pos, schedules))


def ring_bytes(op: str, V, W: int) -> float:
    """Bytes one rank sends for a V-byte `op` over W ranks, by the ring algorithm: all_reduce 2(W-1)/W * V;
    reduce_scatter, all_gather, all_to_all (W-1)/W * V (V: the reduce-scatter's input, the all-gather's output,
    the all-to-all's input); broadcast V (the root's). ring_bytes(op, 1, W) is nccl-tests' bus bandwidth factor."""
    return {"all_reduce": 2 * (W - 1) / W, "reduce_scatter": (W - 1) / W, "all_gather": (W - 1) / W,
            "all_to_all": (W - 1) / W, "broadcast": 1}[op] * V


# ---- TRACE=DIR: one Perfetto / chrome://tracing file of the whole run ----------------------------------------
def _trace_dir():
    """TRACE's directory (made if missing), or None; a path that cannot hold the trace is refused in one line."""
    raw = os.environ.get("TRACE", "").strip()
    if not raw:
        return None
    try:
        os.makedirs(raw, exist_ok=True)
        if not os.access(raw, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        refuse(f"TRACE={raw!r}: {e.strerror.lower()}; give a directory the trace can be written to")
    return raw


def _trace_start(trace_dir, device):
    global _trace
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto logs profiler_start/stop to stderr below level 6;
    from torch.profiler import ProfilerActivity, profile  # it reads the level when it first starts

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _trace = {"dir": trace_dir, "prof": profile(activities=activities), "section": None}
    _trace["prof"].start()


def _trace_write():
    """Stop the profiler; every rank's events go into one file that rank 0 writes, a process row per rank.

    torch.profiler writes one Chrome trace per process, its row named by OS pid and its times counted from its
    own base. What it lacks is done here, by each rank on its own events: pid = rank (its CPU threads, gloo's
    threads and its GPU streams become that row's lanes), times moved onto the earliest rank's base, flow-arrow
    ids (which op launched which) made unique per rank; rank 0 joins the ranks' JSON texts.
    """
    global _trace
    if _trace is None:
        return
    import json
    import tempfile

    t, _trace = _trace, None
    if t["section"] is not None:
        t["section"].__exit__(None, None, None)
    t["prof"].stop()
    with tempfile.TemporaryDirectory() as tmp:
        t["prof"].export_chrome_trace(os.path.join(tmp, "rank.json"))
        with open(os.path.join(tmp, "rank.json")) as f:
            mine = json.load(f)
    rank, world = dist.get_rank(), dist.get_world_size()
    bases = [None] * world
    dist.all_gather_object(bases, mine["baseTimeNanoseconds"])
    shift = (mine["baseTimeNanoseconds"] - min(bases)) / 1000  # microseconds, the unit of "ts"
    events = [{"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
              {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}}]
    threads = {}  # tid -> its last name (kineto may name a reused thread id twice)
    for e in mine["traceEvents"]:
        if not isinstance(e.get("pid"), int) or e.get("name") in ("process_name", "process_labels",
                                                                     "process_sort_index"):
            continue  # the profiler's own span row, and its names for the OS process
        if e.get("name") == "thread_name" and e.get("ph") == "M":
            threads[e["tid"]] = e["args"]["name"]
            continue
        e["pid"] = rank
        if "ts" in e:
            e["ts"] += shift
        if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
            e["id"] += rank << 32
        events.append(e)
    events += [{"ph": "M", "pid": rank, "tid": tid, "name": "thread_name",
                "args": {"name": "main thread" if tid == os.getpid() else name}} for tid, name in threads.items()]
    texts = [None] * world if rank == 0 else None
    dist.gather_object(json.dumps(events, separators=(",", ":"))[1:-1], texts, dst=0)  # this rank's events, as JSON
    if rank != 0:
        return
    path = os.path.join(t["dir"], os.path.splitext(_script())[0] + ".json")
    with open(path, "w") as f:
        f.write('{"traceEvents": [' + ",\n".join(texts) + '], "displayTimeUnit": "ms", "baseTimeNanoseconds": '
                f'{min(bases)}, "distributedInfo": {json.dumps(mine.get("distributedInfo"))}}}')
    log(f"trace of {world} rank(s), {sum(map(len, texts)) / 2 ** 20:.1f} MB: {path} (open it in ui.perfetto.dev)")


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
    """A context manager that records every collective and P2P call this rank issues inside it.

        with traffic() as t:
            y = block(x)
        t.counts["all_reduce"], t.bytes["all_reduce"]   # calls, and bytes of the tensors this rank handed in
        t.calls                                          # [(name, group's global ranks, bytes), ...] in order

    Bytes handed in are the input: what an all-reduce reduces, what an all-gather contributes, what a send
    sends, the buffer a recv fills. What a rank puts on the wire follows from it by the algorithm's closed form
    (a ring all-reduce sends 2(W-1)/W of it). It is a dispatch mode, like PyTorch's CommDebugMode: it sees each
    c10d op as it is dispatched, also inside autograd's backward, and unlike CommDebugMode it counts send and
    recv and needs no module tracker (README: "Why the plumbing looks like this").
    """
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


def refused(call, error=ValueError) -> str:
    """call() must raise `error` with a one-line message before any collective or P2P call (a rank that sent
    first would leave the others waiting for the rest); returns the message."""
    with traffic() as t:
        try:
            call()
        except error as e:
            said = str(e)
        else:
            raise AssertionError(f"accepted, where {error.__name__} was expected")
    assert "\n" not in said and not t.calls, (said, t.calls)
    return said


# ---- memory: the bytes this rank really holds ----------------------------------------------------------------
def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once; a storage resized to 0,
    as ZeRO-3 frees a parameter, counts 0): what parameters, gradients or optimizer state really occupy."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr() if s.nbytes() else id(t)] = s.nbytes()
    return sum(seen.values())


def kept_for_backward(fn, params, inputs=()):
    """fn()'s output and the bytes of the activations autograd saved for its backward (held_bytes:
    distinct storages, parameters left out), `inputs` counted with them: a block that keeps its input itself,
    not a copy, adds nothing by that."""
    saved, skip = [], {q.untyped_storage().data_ptr() for q in params}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, held_bytes([t for t in saved if t.untyped_storage().data_ptr() not in skip] + list(inputs))


def memory(device=None):
    """A context manager that follows every tensor storage this rank allocates inside it, for as long as it lives.

        with memory() as m:
            loss = stage(x).sum()          # activations saved for backward, messages in flight, gradients ...
            kept = m.live()                # bytes allocated inside the block and still held right now
            loss.backward()
        m.peak                             # the most held at once (checked whenever an op allocates or grows one)
        m.reset()                          # the next peak starts from what is held now
        m.comms                            # [(c10d op, bytes held as it started)]: e.g. is a sent buffer freed?

    It sees each op as it is dispatched (also inside autograd's backward and the c10d ops), notes the storage of
    every output, and keeps a weak reference: a storage is counted while something still holds it (saved for
    backward, a send's buffer kept until its wait, a gradient) and stops counting when the last holder lets it go,
    or when it is resized to 0 bytes. So it measures what the code keeps, on any device, exactly in bytes.
    Storages allocated before the block (parameters, inputs) are not counted: `held_bytes()` counts those.
    On CUDA `m.device_peak` also gives the allocator's own peak over the block (torch.cuda.max_memory_allocated,
    rounded to its blocks and counting temporaries); on the CPU it is None, as torch keeps no CPU statistics.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Memory(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        def __init__(self):
            super().__init__()
            self.storages = {}  # cdata -> (weak ref, bytes when last seen)
            self.peak, self.device_peak, self.comms = 0, None, []
            self._device = torch.device(device) if device is not None else None

        def live(self) -> int:
            total = 0
            for key, (ref, _) in list(self.storages.items()):
                s = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(key)
                if s is None:
                    del self.storages[key]
                else:
                    total += s.nbytes()
            return total

        def reset(self):
            self.peak = self.live()

        def _note(self, out, skip=()):
            grew = False
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    s = t.untyped_storage()
                    if s.data_ptr() in skip and s.data_ptr():  # an input's storage: not allocated here
                        continue
                    ref = StorageWeakRef(s)
                    old = self.storages.get(ref.cdata)
                    if old is None or old[1] != s.nbytes() or old[0].expired():
                        self.storages[ref.cdata] = (ref, s.nbytes())
                        grew = True
            return grew

        def track(self, tensors):
            """Count these storages too, from now on (one allocated before the block that will grow in it)."""
            if self._note(list(tensors)):
                self.peak = max(self.peak, self.live())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.comms.append((func.__name__.split(".")[0], self.live()))
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"}  # views, in-place, c10d ops
            if self._note(out, skip=inputs):
                self.peak = max(self.peak, self.live())
            return out

        def __enter__(self):
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                self._cuda_start = torch.cuda.memory_allocated(self._device)
                torch.cuda.reset_peak_memory_stats(self._device)
            return super().__enter__()

        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                self.device_peak = torch.cuda.max_memory_allocated(self._device) - self._cuda_start
            return out

    return Memory()
