"""One keyword a lesson: `pytest test_all.py -k lesson05` runs every test of lesson 05 (its demo and tests/check_05.py
at every world size, its pasted blocks, its benchmark, its suite and trace tests). A test belongs to the lesson whose
two-digit number its id names first as a file or test name (05_tp_layers.py, check_05.py, lesson05, bench/05_tp.py,
test_05_..., trace_of_05_...); numbers inside values (hidden=4096.7) name none."""
import re

LESSON_NUMBER = re.compile(r"(?<![\d.=])(0[1-9]|10)(?=_|\.py|-|\]|$)")


def lesson_of(nodeid):
    """'lesson05' for a test of lesson 05, None for one of no lesson (the launcher, common.py, README)."""
    found = LESSON_NUMBER.search(nodeid.split("::", 1)[-1])
    return f"lesson{found.group(1)}" if found else None


def pytest_configure(config):
    for n in range(1, 11):
        config.addinivalue_line("markers", f"lesson{n:02d}: every test of lesson {n:02d} (-k lesson{n:02d})")


def pytest_collection_modifyitems(items):
    for item in items:
        if lesson_of(item.nodeid):
            item.add_marker(lesson_of(item.nodeid))
