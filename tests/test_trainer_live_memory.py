"""benchmarks/trainer_live_memory.py: how a live allocation's stack is classed (memray itself is not needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import trainer_live_memory  # noqa: E402


def test_a_stack_is_classed_by_its_first_matching_frames():
    classify = trainer_live_memory.classify
    assert classify(["_PyCode_CreateLineArray (codeobject.c:740)", "call_trace (ceval.c:6869)"]).startswith(
        "the tracer"
    )
    assert classify(["torch::autograd::impl::grad_accumulator(at::Tensor const&) (<unknown>:0)"]).startswith("torch")
    assert classify(["deque_new (_collectionsmodule.c:162)", "__init__ (streams.py:130)"]) == "aiohttp connections"
    assert classify(["PyList_New (listobject.c:1)", "step (run.py:10)"]) == "other"
