"""The analytical cost model: roofline compute, closed-form collectives on the hierarchical network, and a
dependency-driven schedule of every rank class's streams that yields overlap, pipeline bubbles and peak
memory.
"""

from simulators.analytical.cost_model import AnalyticalCostModel
from simulators.analytical.trace import to_chrome_trace

__all__ = ["AnalyticalCostModel", "to_chrome_trace"]
