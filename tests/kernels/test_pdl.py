"""The programmatic-dependent-launch switch (``kernels/pdl.py``): what a kernel's launch gets,
and never PDL under Triton's interpreter (the CPU tests), which has no grid dependency control.
The kernels' outputs with it on are checked on a GPU (tests/test_gpu_engine.py)."""

import pytest

from aspire_ray.kernels import pdl


@pytest.fixture(autouse=True)
def _off_after():
    yield
    pdl.set_enabled(False)


def test_off_the_kernels_compile_no_prologue():
    pdl.set_enabled(False)
    assert pdl.launch_options() == {"GDC": False}


def test_on_the_launch_asks_for_pdl_and_the_prologue(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU host
    pdl.set_enabled(True)
    assert pdl.enabled() and pdl.launch_options() == {"GDC": True, "launch_pdl": True}


def test_the_interpreter_never_launches_with_pdl(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pdl.set_enabled(True)
    assert not pdl.enabled() and pdl.launch_options() == {"GDC": False}
