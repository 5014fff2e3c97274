"""Import time counted apart from a phase's own work: outermost imports only, the block's thread only, and the
import machinery restored after, also when the block raises."""

from __future__ import annotations

import builtins
import itertools
import sys
import threading

import pytest

from paritylab.run.import_time import counting_imports


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Two fresh modules, ``outer_mod`` importing ``inner_mod``, importable from ``tmp_path``."""
    (tmp_path / "inner_mod.py").write_text("VALUE = 1\n")
    (tmp_path / "outer_mod.py").write_text("import inner_mod\nVALUE = inner_mod.VALUE + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("outer_mod", "inner_mod"):
        sys.modules.pop(name, None)


def test_only_the_outermost_import_is_counted(modules):
    ticks = itertools.count()
    original = builtins.__import__
    with counting_imports(clock=lambda: float(next(ticks))) as imported:
        import outer_mod  # noqa: F401 - imports inner_mod inside: one outermost import, two clock reads

        work = sum(range(10))  # the block's own work reads no clock
    assert imported.seconds == 1.0 and work == 45
    assert builtins.__import__ is original and sys.modules["inner_mod"].VALUE == 1


def test_other_threads_are_not_counted_and_the_hook_goes_on_error(modules):
    ticks = itertools.count()
    original = builtins.__import__
    with (
        pytest.raises(RuntimeError, match="builder failed"),
        counting_imports(clock=lambda: float(next(ticks))) as imported,
    ):
        thread = threading.Thread(target=lambda: __import__("outer_mod"))
        thread.start()
        thread.join()
        raise RuntimeError("builder failed")
    assert imported.seconds == 0.0 and "outer_mod" in sys.modules
    assert builtins.__import__ is original
