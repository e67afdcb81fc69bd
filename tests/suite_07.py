"""07's runs that need a setting, each refused in one line on every rank before any work: a world size that does
not divide the vocabulary (5 ranks: 48 rows in the lesson, 384 in its check script) by both, and by the benchmark a
BENCH_SMALL other than 1, 0 or unset, and 3 ranks (its vocabulary is a power of two). The sizes that fit run in the
world-size tests (1, 2, 3, 4, 8), the benchmark's BENCH_SMALL=1 in the benchmark test."""
from tests.launch import REFUSED, launch


def _refused_everywhere(run_, world, named):
    assert run_.codes == [2] * world and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and REFUSED.match(e) and named in e for e in run_.errs), run_.report()
    assert not any(run_.outs), run_.report()                       # refused before any work: nothing printed


def test_07_world_size_5_is_refused_on_every_rank():
    for script, named in (("07_vocab_parallel.py", "splits over 1, 2, 3, 4, 6 or 8 ranks, not 5"),
                          ("tests/check_07.py", "fit 1, 2, 3, 4, 6, 8 ranks, not 5")):
        _refused_everywhere(launch(script, 5, real_exit=False), 5, named)


def test_07_bench_refuses_a_bad_bench_small():
    _refused_everywhere(launch("bench/07_loss.py", 2, extra_env={"BENCH_SMALL": "yes"}, real_exit=False), 2,
                        "BENCH_SMALL='yes'")
    _refused_everywhere(launch("bench/07_loss.py", 3, extra_env={"BENCH_SMALL": "1"}, real_exit=False), 3,
                        "a vocabulary of 1024 splits over a power of two ranks, not 3")
