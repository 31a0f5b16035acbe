"""A workload crosses a process boundary (a Ray worker, a subprocess handing it back) by pickle. A generated
pipeline's programs (`DeferredPrograms`) and its steady form's longer form are built by closures of the generator,
which pickle cannot carry: both are pickled built, and the copy prices as the original, from its steady form."""

import pickle
from dataclasses import replace

from dse.workload import SteadyForm
from generators.symbolic import SymbolicGenerator
from simulators.analytical import AnalyticalCostModel
from tests.helpers import make_point


def test_a_workload_with_a_steady_and_a_longer_form_round_trips():
    point = make_point(
        model={"base": "gpt3-175b", "flash_attention": False, "dropout": True},
        system={"base": "dgx-h100", "network": {1: {"npus": 8}}},
        tp=8,
        pp=8,
        dp=1,
        sp=False,
        global_batch=64,
        seq_len=2048,
    )
    workload = SymbolicGenerator().generate(point)
    assert workload.steady is not None and workload.steady.build_longer is not None
    copy = pickle.loads(pickle.dumps(workload))
    assert SteadyForm.holds(copy.programs)  # still stands for the step: priced from its form
    longer = workload.steady.longer()
    assert longer is not None and copy.steady.longer().microbatches == longer.microbatches
    assert copy.steady.microbatches == workload.steady.microbatches
    model = AnalyticalCostModel()
    assert model.simulate(replace(copy, point_key="copy"), point.system) == model.simulate(workload, point.system)
