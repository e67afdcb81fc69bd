"""One keyword a lesson: `pytest test_all.py -k lesson05` runs every test of lesson 05 (its demo and tests/check_05.py
at every world size, its pasted blocks, its benchmark, its suite and trace tests). A test belongs to the lesson whose
two-digit number its id names first as a file or test name (05_tp_layers.py, check_05.py, lesson05, bench/05_tp.py,
test_05_..., trace_of_05_...); numbers inside values (hidden=4096.7) name none.
It also starts the run's one zygote (tests/launch.py) and hands the tests out long ones first."""
import re

LESSON_NUMBER = re.compile(r"(?<![\d.=])(0[1-9]|10)(?=_|\.py|-|\]|$)")


def lesson_of(nodeid):
    """'lesson05' for a test of lesson 05, None for one of no lesson (the launcher, common.py, README)."""
    found = LESSON_NUMBER.search(nodeid.split("::", 1)[-1])
    return f"lesson{found.group(1)}" if found else None


def pytest_configure(config):
    for n in range(1, 11):
        config.addinivalue_line("markers", f"lesson{n:02d}: every test of lesson {n:02d} (-k lesson{n:02d})")
    # one zygote (tests/launch.py) for the whole run, started before xdist starts its workers, who inherit its
    # address: torch is imported once (2.7 CPU s), not once a worker; it imports while the workers collect
    from tests import launch
    if not hasattr(config, "workerinput") and not config.option.collectonly:
        launch.start_zygote()


def pytest_unconfigure(config):
    from tests import launch
    launch.stop_zygote()


# what runs first: real processes (seconds of imports each), then the largest launches and the waits on a timeout,
# then the rest; with pytest.ini's --maxschedchunk=1 xdist hands them out in this order, so the run does not end
# with one long test alone on a core
LONG = re.compile(r"-8\]|check_10|_3_runs_or_is_refused|stuck|times_out|bench_runs_small|readme_commands|"
                  r"importing_a_lesson|resumes_in_new_processes|trace_of")


def pytest_collection_modifyitems(items):
    for item in items:
        if lesson_of(item.nodeid):
            item.add_marker(lesson_of(item.nodeid))
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1 if LONG.search(item.nodeid) else 2)
