"""03's runs that need settings: bench/03_bandwidth.py refuses a BENCH_SMALL other than 1, 0 or unset (1 itself runs in
test_all's test_bench_runs_small)."""
import pytest

from tests.launch import REFUSED, launch


@pytest.mark.parametrize("value", ["2", "yes"])
def test_03_bench_refuses_a_bad_bench_small_on_every_rank(value):
    """BENCH_SMALL=1 is the last valid value; 2, or a word, is refused by every rank in one line, exit 2, in seconds,
    before any work."""
    run_ = launch("bench/03_bandwidth.py", 2, extra_env={"BENCH_SMALL": value}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and REFUSED.match(e) and f"BENCH_SMALL={value!r}" in e
               for e in run_.errs), run_.report()
    assert not any(run_.outs), run_.report()
