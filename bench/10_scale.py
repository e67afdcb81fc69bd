"""10's closed forms at scale: for a Llama-shaped model on a dp x pp x tp grid, the bytes each rank sends in one
step, per group, with the seconds at given link speeds, and the bytes it holds at its peak under ZeRO-1, 2 and 3.

    torchrun --nproc-per-node=1 bench/10_scale.py                         (Llama 3 70B on dp 16 x pp 8 x tp 8)
    torchrun --nproc-per-node=1 bench/10_scale.py hidden=4096 heads=32 ffn=14336 layers=32 pp=4 dp=32  (Llama 3 8B)
    (key=value pairs, or SCALE="key=value,..."; the keys and defaults: 10_3d_parallel.py's SCALE; ZERO=3: ZeRO-3)

10_3d_parallel.py states the forms in its docstring and asserts step_traffic against the collectives a toy Llama
issues, to the byte; tests/check_10.py asserts the bytes it holds against step_memory below. Here they are only
evaluated (a calculator: nothing is timed, so BENCH_SMALL=1 changes nothing). Asserted in both modes: the table's
TP, PP and DP bytes equal the docstring's per-step sums, written out again here; each seconds figure is its bytes
over its link's speed; a model shaped as a published Llama has its published parameter count, within 0.5 %.

5D (GPUS=N, default 2048; GPU_GB, default 80): for a Llama 3 405B-like (128 layers, not 126: pp divides them) and a
DeepSeek-V3-like MoE (64 layers, each 256 SwiGLU experts top-8 + a shared one; MLA as 128 plain heads), every
dp x pp x cp x tp grid of N GPUs with ep over dp x cp: the bytes a rank of stage 0 holds (moe_memory, ZeRO-1:
the dense weights' state over dp cp, the experts' over dp cp/ep, asserted per part against a toy's in
tests/check_10.py; activations at s/cp, every layer's as a dense one's, an estimate) and the seconds one step's
traffic takes (TP and CP on NVLink, the rest on InfiniBand, nothing overlapped); names the grid that
fits GPU_GB with the fewest seconds.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import finish, head, log, refuse, setup  # noqa: E402
from tests.tools import lesson  # noqa: E402

ten = lesson("10_3d_parallel.py")
PUBLISHED = {  # the parameter counts their model cards give, and the shapes that make them
    "Llama 3.2 1B": (1.24e9, dict(hidden=2048, heads=32, kv_heads=8, ffn=8192, layers=16, vocab=128256, tied=1)),
    "Llama 3.2 3B": (3.21e9, dict(hidden=3072, heads=24, kv_heads=8, ffn=8192, layers=28, vocab=128256, tied=1)),
    "Llama 3 8B": (8.03e9, dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32, vocab=128256, tied=0)),
    "Llama 3 70B": (70.6e9, ten.LLAMA3_70B),
    "Llama 3 405B": (405e9, dict(hidden=16384, heads=128, kv_heads=8, ffn=53248, layers=126, vocab=128256, tied=0))}


def scale_config(pairs):
    """10's SCALE updated by key=value pairs, or (None, one line naming the first bad one): sizes and bytes are
    whole numbers >= 1 (tied 0 or 1), bandwidths and bucket_mb numbers > 0; tp divides what it splits, pp the
    layers, heads the hidden size and K/V heads the heads."""
    c = dict(ten.SCALE)
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if key not in c or not eq:
            return None, (f"{pair!r} is not key=value with a key of {', '.join(ten.SCALE)}"
                          + (" (README's '...' stands for more of them)" if "..." in pair else ""))
        real = isinstance(ten.SCALE[key], float)
        try:
            number = float(value) if real else int(value) if value.isdigit() else -1
        except ValueError:
            number = math.nan
        low, high = (0, 1) if key == "tied" else (1, math.inf)
        if not (0 < number < math.inf if real else low <= number <= high):
            rule = "a number > 0" if real else "0 or 1" if key == "tied" else "a whole number >= 1"
            return None, f"{key}={value}: {key} is {rule} (default {key}={ten.SCALE[key]:g})"
        c[key] = number
    split = [f"{k}={c[k]}" for k in ("hidden", "heads", "kv_heads", "ffn", "seq", "vocab") if c[k] % c["tp"]]
    if split:
        return None, f"tp={c['tp']} does not divide {', '.join(split)}: tensor parallelism splits them"
    for part, whole in (("pp", "layers"), ("heads", "hidden"), ("kv_heads", "heads")):
        if c[whole] % c[part]:
            return None, f"{part}={c[part]} does not divide {whole}={c[whole]}"
    return c, None


def step_memory(c, stage, zero, numel=None):
    """{what: bytes one rank of stage `stage` holds at its peak} under ZeRO-1, 2 or 3 as 09 runs them, the m
    micro-batches added up under no_sync (10's docstring); numel: the stage's bucketed elements (default:
    stage_numel's); c["act"]: one layer's activations of one micro-batch."""
    numel = ten.stage_numel(c, stage) if numel is None else numel
    shard, ep, eg, last = -(-numel // c["dp"]), c["ep"], c["eg"], stage == c["pp"] - 1
    return {"parameters": (shard if zero == 3 else numel) * ep,
            "gathered": 2 * min(c["bucket_mb"] * 2 ** 20 // eg, numel) * ep if zero == 3 else 0,   # ZeRO-3: in use
            "gradients": (numel + shard) * eg,                        # the stage's, added up; the reduced shard
            "optimizer": shard * (2 * eg + (4 if ep < 4 else 0)),     # two moments (+ an fp32 master)
            "activations": min(c["pp"] - stage, c["m"]) * c["layers"] // c["pp"] * c["act"],
            "logits": last * 2 * c["seq"] * c["micro"] * c["vocab"] // c["tp"] * c["e"]}   # and their gradient


def activations(c):
    """Bytes one dense layer keeps for backward from one micro-batch on one TP rank (SP, a flash attention kernel: no
    s^2 term), c["seq"] the rank's positions of a sequence (s/cp under CP): per token s*b/t, each RMSNorm its input,
    1/rms and the normalised input (2 x (2h + 1)), the column layers' local slices (2h), q, k, v with the fused qkv
    output they view and the attention output twice ((4H + 3H_kv) d), the attention's log-sum-exp (H), gate, up,
    silu(gate) and their product (4 ffn); per position RoPE's cos and sin for q and k (2d); in e bytes."""
    d = c["hidden"] // c["heads"]
    per_token = 6 * c["hidden"] + 2 + (4 * c["heads"] + 3 * c["kv_heads"]) * d + c["heads"] + 4 * c["ffn"]
    return c["e"] * (c["seq"] * c["micro"] // c["tp"] * per_token + 2 * c["seq"] * d)


def moe_memory(g, stage, zero, dense, expert):
    """step_memory of a rank of a dp x pp x cp x tp grid with ep, in two parts (g["dp"]: the dp x cp ranks): the
    dense weights' (dense elements, over dp x cp; one micro-batch's activations and logits at s/cp tokens) and the
    experts' (expert elements, over dp cp / ep; a mixture's activations are not in this form)."""
    local = {**g, "seq": g["seq"] // g.get("cp", 1)}
    return (step_memory({**local, "act": activations(local)}, stage, zero, dense),
            step_memory({**g, "dp": g["dp"] // g.get("ep_size", 1), "act": 0, "vocab": 0}, stage, zero, expert))


def docstring_sums(c, stage, zero, numel):
    """The bytes one step sends per group, from 10's docstring's sentences, summed by hand: TP 10 (t-1)/t A a layer
    and micro-batch, +2 (t-1)/t A (embedding) or +3 (t-1)/t A and the loss's 3 fp32 a token over t (head), the
    norms' all-reduce; PP A/t + e each way (08's flag); DP a reduce-scatter of the gradients, all-gathers of the
    parameters."""
    t, pp, m, dp, h = c["tp"], c["pp"], c["m"], c["dp"], c["hidden"]
    A, first, last, per = c["micro"] * c["seq"] * h * c["e"], stage == 0, stage == pp - 1, c["layers"] // pp
    tp = (t - 1) / t * m * A * (10 * per + 2 * first + 3 * last) + last * m * (t - 1) * 3 * c["micro"] * c["seq"] * \
        max(c["e"], 4) + 2 * (t - 1) / t * (2 * h * per + last * h) * c["eg"]
    pipe = (2 - first - last) * m * (A / t + c["e"]) if pp > 1 else 0   # a message one element longer: 08's flag
    data = (dp - 1) / dp * numel * (c["eg"] + (2 * m if zero == 3 else 1) * c["ep"])
    embedding = c["tied"] * (first or last) * (pp > 1) * c["vocab"] // t * h * c["eg"]
    return {"tp": tp, "pp": pipe, "dp": data, "embedding": embedding}


FIVE_D = {"Llama 3 405B-like": dict(PUBLISHED["Llama 3 405B"][1], layers=128, seq=8192, micro=1, m=16),  # pp | 128
          "DeepSeek-V3-like": dict(hidden=7168, heads=128, kv_heads=128, ffn=18432, layers=64, vocab=129280, tied=0,
                                   experts=256, top_k=8, moe_every=1, moe_ffn=2048, shared_ffn=2048, seq=4096,
                                   micro=1, m=16)}


def five_d(name, c, gpus, gpu_gb):
    """[(seconds, GB held, grid)] for every 5D grid of `gpus` the model takes, and the best one that fits."""
    c, rows = {**ten.SCALE, **c}, []
    for tp, cp, pp in ((t, x, p) for t in (1, 2, 4, 8) for x in (1, 2, 4, 8) for p in (1, 2, 4, 8, 16)):
        dp, E = gpus // (tp * cp * pp), c.get("experts", 0)
        if dp * tp * cp * pp != gpus or c["layers"] % pp or c["kv_heads"] % tp and tp > c["kv_heads"]:
            continue
        for ep in [e for e in (1, 2, 4, 8, 16, 32, 64) if (dp * cp) % e == 0 and (E % e == 0 if E else e == 1)]:
            g = {**c, "dp": dp * cp, "pp": pp, "cp": cp, "tp": tp, "ep_size": ep, "zero": 2}
            dense, expert = ten.stage_numel(g, 0), ten.stage_numel(g, 0, True)
            g["buckets"] = [-(-dense // (dp * cp)) * dp * cp]
            g["expert_buckets"] = [-(-expert // (dp * cp // ep)) * (dp * cp // ep)] if expert else []
            link = lambda k: c["nvlink_GBps"] if k in ("tp", "cp") else c["ib_GBps"]
            sec = sum(float(b) / 1e9 / link(k) for (k, _), (_, b) in ten.step_traffic(g, 0).items())
            held = sum(sum(part.values()) for part in moe_memory(g, 0, 1, dense, expert))
            rows.append((sec, held / 1e9, f"dp {dp} x pp {pp} x cp {cp} x tp {tp}, ep {ep}"))
    fits = sorted(r for r in rows if r[1] <= gpu_gb)
    assert rows and all(s > 0 and h > 0 for s, h, _ in rows), name
    return rows, fits


def main():
    zero = os.environ.get("ZERO", "").strip() or "2"
    c, bad = scale_config(os.environ.get("SCALE", "").replace(",", " ").split() + sys.argv[1:])
    gpus, gpu_gb = os.environ.get("GPUS", "").strip() or "2048", os.environ.get("GPU_GB", "").strip() or "80"
    if not bad and not (gpus.isdigit() and int(gpus) >= 1):
        bad = f"GPUS={gpus!r}: give the number of GPUs, a whole number >= 1 (default 2048)"
    if not bad and not gpu_gb.replace(".", "", 1).isdigit() or not bad and float(gpu_gb) <= 0:
        bad = f"GPU_GB={gpu_gb!r}: give a GPU's memory in GB, a number > 0 (default 80)"
    if bad or zero not in ("2", "3"):
        refuse(bad or f"ZERO={zero!r}: give 2 (ZeRO-2, the default) or 3")
    setup()
    zero = int(zero)
    head(f"10's forms at scale: hidden {c['hidden']}, {c['layers']} layers, {c['heads']}/{c['kv_heads']} heads, ffn "
         f"{c['ffn']}, seq {c['seq']}, vocab {c['vocab']}, {c['m']} micro-batches of {c['micro']}, dp {c['dp']} x pp "
         f"{c['pp']} x tp {c['tp']}")
    total = ten.stage_numel({**c, "tp": 1, "pp": 1}, 0)
    named = [name for name, (_, shape) in PUBLISHED.items() if all(c[k] == v for k, v in shape.items())]
    for name in named:                              # SwiGLU's 3 matrices, GQA's K/V, the head tied or not
        assert abs(total / PUBLISHED[name][0] - 1) < 0.005, (name, total)
    log(f"{total:,} parameters" + "".join(f" ({n}: published {PUBLISHED[n][0] / 1e9:g}B)" for n in named)
        + f"; bytes an element: activations {c['e']}, gradients {c['eg']}, parameters {c['ep']}")
    stages, cap = sorted({0, c["pp"] - 1}), int(c["bucket_mb"] * 2 ** 20 // c["eg"])   # a bucket's elements
    link = {"tp": c["nvlink_GBps"], "pp": c["ib_GBps"], "dp": c["ib_GBps"], "embedding": c["ib_GBps"]}
    tables = []
    for s in stages:
        full, rest = divmod(ten.stage_numel(c, s), cap)                 # buckets of bucket_mb, the last one short
        buckets = [-(-n // c["dp"]) * c["dp"] for n in [cap] * full + [rest] * bool(rest)]   # padded, as 09's
        by = {}
        for (kind, _), (n, b) in ten.step_traffic({**c, "zero": zero, "buckets": buckets}, s).items():
            by[kind] = (by.get(kind, (0, 0))[0] + n, by.get(kind, (0, 0))[1] + float(b))
        sums = docstring_sums(c, s, zero, sum(buckets))
        assert all(math.isclose(by.get(k, (0, 0))[1], v, rel_tol=1e-9, abs_tol=1) for k, v in sums.items()), (by, sums)
        tables.append({k: (n, b, b / 1e9 / link[k]) for k, (n, b) in by.items()})
    assert all(math.isclose(b / 1e9 / sec, link[k]) for tab in tables for k, (_, b, sec) in tab.items() if b)
    log(f"ZeRO-{zero:<5} " + " ".join(f"{f'stage {s}: calls':>15} {'GB sent':>8} {'seconds':>8}" for s in stages))
    for kind in sorted(set().union(*tables)):
        log(f"{kind:10} " + " ".join(f"{n:>15} {b / 1e9:>8.2f} {sec:>8.3f}" for n, b, sec in
                                     (tab.get(kind, (0, 0, 0)) for tab in tables)))
    log(f"seconds if nothing overlaps, TP at {c['nvlink_GBps']:g} GB/s (NVLink), the others {c['ib_GBps']:g} GB/s; "
        f"TP sits on every layer's critical path, DP can hide behind backward")
    act, cols = activations(c), ("parameters", "gathered", "gradients", "optimizer", "activations", "logits")
    log(f"GB held at the peak; activations {act / 1e6:.0f} MB a layer and micro-batch (flash attention: no s^2 term)")
    log(f"{'':7} " + " ".join(f"stage {s}: " + " ".join(f"{k[:6]:>6}" for k in cols) + f" {'total':>6}"
                              for s in stages))
    for z in (1, 2, 3):
        log(f"ZeRO-{z:<2} " + " ".join(" " * 9 + " ".join(f"{m[k] / 1e9:>6.1f}" for k in cols) +
                                      f" {sum(m.values()) / 1e9:>6.1f}"
                                      for m in (step_memory({**c, "act": act}, s, z) for s in stages)))
    log(f"not counted: one layer's all-gathered input and temporaries, P2P messages in flight (A/t each), the "
        f"allocator's slack; ZeRO-2/3 keep the whole gradient while {c['m']} micro-batches add up")
    gpus, gpu_gb = int(gpus), float(gpu_gb)
    for name, shape in FIVE_D.items():
        rows, fits = five_d(name, shape, gpus, gpu_gb)
        total = ten.stage_numel({**ten.SCALE, **shape, "tp": 1, "pp": 1}, 0) + \
            ten.stage_numel({**ten.SCALE, **shape, "tp": 1, "pp": 1}, 0, True)
        head(f"5D on {gpus} GPUs of {gpu_gb:g} GB: {name} ({total / 1e9:.0f}B parameters), {len(rows)} grids, "
             f"{len(fits)} fit (ZeRO-1, stage 0)")
        for sec, gb, grid in fits[:3] or sorted(rows, key=lambda r: r[1])[:1]:
            log(f"{grid:36} {sec:8.2f} s of traffic a step {gb:8.1f} GB held" + ("" if fits else " (none fits)"))
        log(f"fits {gpus} GPUs best: {fits[0][2]}" if fits else f"no grid of {gpus} GPUs fits {gpu_gb:g} GB")
    finish("the bytes sent == the docstring's sums, each seconds figure == bytes / link speed"
           + (f", {' and '.join(named)}'s published parameter count" if named else ""))


if __name__ == "__main__":
    main()
