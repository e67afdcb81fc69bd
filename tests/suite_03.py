"""03's runs that need settings or a patched benchmark: bench/03_bandwidth.py refuses a BENCH_SMALL other than 1, 0 or
unset (1 itself runs in test_all's test_bench_runs_small); its timing, the bytes and bus factor it hands its arithmetic,
and its result checks, each shown able to fail."""
import textwrap

import pytest

from tests.launch import REFUSED, check_passed, launch, probe


@pytest.mark.parametrize("value", ["2", "yes"])
def test_03_bench_refuses_a_bad_bench_small_on_every_rank(value):
    """BENCH_SMALL=1 is the last valid value; 2, or a word, is refused by every rank in one line, exit 2, in seconds,
    before any work."""
    run_ = launch("bench/03_bandwidth.py", 2, extra_env={"BENCH_SMALL": value}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and REFUSED.match(e) and f"BENCH_SMALL={value!r}" in e
               for e in run_.errs), run_.report()
    assert not any(run_.outs), run_.report()


def _bench(tmp_path, body):
    return probe(tmp_path, textwrap.dedent("""
        import importlib.util, os, time, torch
        spec = importlib.util.spec_from_file_location("bench03", os.path.join("bench", "03_bandwidth.py"))
        b = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(b)
    """) + textwrap.dedent(body))


def test_03_bench_time_is_one_call_of_the_slowest_rank(tmp_path):
    """timed() with 3 rounds of a call that takes 20 ms on rank 1 and nothing on rank 0: 20 ms, not 60 ms (the
    sum of the rounds) and not rank 0's ~0 (BENCH_SMALL=1 runs one round, where the two agree)."""
    script = _bench(tmp_path, """
        from common import finish, setup
        rank, W, device = setup()
        t = b.timed(lambda: time.sleep(0.02 if rank == 1 else 0), device, rounds=3)
        assert 0.02 <= t < 0.05, t
        finish(f"t = {t * 1e3:.1f} ms")
    """)
    check_passed(launch(script, 2, real_exit=False))


def test_03_bench_hands_its_arithmetic_the_bytes_and_the_kind(tmp_path):
    """Under BENCH_SMALL=1 at 2 ranks, every bandwidths() call gets S in bytes (n float32 = 4n) and the kind whose
    bus factor is right for the op: the ring all-reduce is an all-reduce."""
    script = _bench(tmp_path, """
        os.environ["BENCH_SMALL"] = "1"
        calls, original = [], b.bandwidths
        b.bandwidths = lambda kind, S, t, W: calls.append((kind, S)) or original(kind, S, t, W)
        b.main()
        kinds = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "all_reduce"]
        want = [(k, max(2, s // 4 // 2 * 2) * 4) for s in b.SMALL for k in kinds]
        calls = [c for c in calls if c[1] != 3e9]            # check_bandwidths' own worked numbers
        assert calls == want, (calls, want)
    """)
    check_passed(launch(script, 2, real_exit=False))


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"])
def test_03_bench_catches_an_op_that_does_nothing(tmp_path, op):
    script = _bench(tmp_path, f"""
        os.environ["BENCH_SMALL"] = "1"
        ops = b.bench_ops
        def broken(rank, W, device):
            o = ops(rank, W, device)
            kind, make = o[{op!r}]
            o[{op!r}] = (kind, lambda n: (lambda: None, make(n)[1]))
            return o
        b.bench_ops = broken
        b.main()
    """)
    run_ = launch(script, 2, extra_env={"PG_TIMEOUT": "3"}, real_exit=False, grace=2, deadline=30)
    assert any(f"{op} of 8 B: wrong result" in e for e in run_.errs), run_.report()
