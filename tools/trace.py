"""TRACE=DIR: one Perfetto / chrome://tracing file of a whole run, every rank a process row (docs/plumbing.md).

common.setup() calls start() when TRACE is set, head() calls section(), finish() and teardown() call write().
torch.profiler writes one Chrome trace per process, its row named by OS pid and its times counted from its own
base. merge() does what that lacks, for each rank's events: pid = rank (its CPU threads, gloo's threads and its
GPU streams become that row's lanes), times moved onto the earliest rank's base, flow-arrow ids (which op
launched which) made unique per rank; rank 0 joins the ranks' JSON texts.
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist

_run = None  # {"dir", "prof", "section", "name"} while the profiler runs


def directory(refuse):
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


def start(trace_dir, device, name):
    global _run
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto logs profiler_start/stop to stderr below level 6;
    from torch.profiler import ProfilerActivity, profile  # it reads the level when it first starts

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _run = {"dir": trace_dir, "prof": profile(activities=activities), "section": None, "name": name}
    _run["prof"].start()


def section(title):
    """Under TRACE, every rank's trace gets a range named `title` until the next section."""
    if _run is None:
        return
    if _run["section"] is not None:
        _run["section"].__exit__(None, None, None)
    _run["section"] = torch.profiler.record_function(title)
    _run["section"].__enter__()


def merge(rank, trace, bases, pid):
    """This rank's exported Chrome trace -> its events for the joint file: one process row named `rank {rank}`,
    times moved from its own clock base onto the earliest of `bases` (every rank's baseTimeNanoseconds), flow ids
    made unique per rank. pid: the OS pid of the main thread (its lane is named "main thread")."""
    shift = (trace["baseTimeNanoseconds"] - min(bases)) / 1000  # microseconds, the unit of "ts"
    events = [{"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
              {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}}]
    threads = {}  # tid -> its last name (kineto may name a reused thread id twice)
    for e in trace["traceEvents"]:
        if not isinstance(e.get("pid"), int) or e.get("name") in ("process_name", "process_labels",
                                                                     "process_sort_index"):
            continue  # the profiler's own span row, and its names for the OS process
        if e.get("name") == "thread_name" and e.get("ph") == "M":
            threads[e["tid"]] = e["args"]["name"]
            continue
        e = dict(e, pid=rank)
        if "ts" in e:
            e["ts"] += shift
        if e.get("ph") in ("s", "t", "f") and isinstance(e.get("id"), int):
            e["id"] += rank << 32
        events.append(e)
    return events + [{"ph": "M", "pid": rank, "tid": tid, "name": "thread_name",
                      "args": {"name": "main thread" if tid == pid else name}} for tid, name in threads.items()]


def write(log):
    """Stop the profiler; rank 0 writes every rank's events into DIR/<lesson>.json. Collective: every rank."""
    global _run
    if _run is None:
        return
    t, _run = _run, None
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
    events = merge(rank, mine, bases, os.getpid())
    texts = [None] * world if rank == 0 else None
    dist.gather_object(json.dumps(events, separators=(",", ":"))[1:-1], texts, dst=0)  # this rank's, as JSON
    if rank != 0:
        return
    path = os.path.join(t["dir"], t["name"] + ".json")
    with open(path, "w") as f:
        f.write('{"traceEvents": [' + ",\n".join(texts) + '], "displayTimeUnit": "ms", "baseTimeNanoseconds": '
                f'{min(bases)}, "distributedInfo": {json.dumps(mine.get("distributedInfo"))}}}')
    log(f"trace of {world} rank(s), {sum(map(len, texts)) / 2 ** 20:.1f} MB: {path} (open it in ui.perfetto.dev)")
