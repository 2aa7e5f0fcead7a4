"""The vLLM worker side's pieces that need no vLLM (the engine tests are in tests/vllm)."""

from __future__ import annotations

from kvstore.integrations.vllm.worker import openmp_spin_hint

_GOMP = "7f00-7f10 r-xp 00000000 00:00 1 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1\n"


def test_openmp_spin_hint_names_the_knob_under_libgomp_defaults():
    hint = openmp_spin_hint({}, _GOMP)
    assert hint is not None and "GOMP_SPINCOUNT=10000" in hint and "docs/vllm.md" in hint


def test_openmp_spin_hint_is_quiet_when_the_spin_is_set_or_no_libgomp():
    assert openmp_spin_hint({"GOMP_SPINCOUNT": "10000"}, _GOMP) is None
    assert openmp_spin_hint({"OMP_WAIT_POLICY": "passive"}, _GOMP) is None
    assert openmp_spin_hint({}, "7f00-7f10 r-xp 0 00:00 1 /usr/lib/libiomp5.so\n") is None
