"""ASTRA-sim as a cost model: the workload's Chakra traces run through ASTRA-sim's analytical network backends."""

from simulators.astrasim.cost_model import AstraSimCostModel
from simulators.astrasim.options import AstraSimOptions
from simulators.astrasim.runner import AstraSimError

__all__ = ["AstraSimCostModel", "AstraSimError", "AstraSimOptions"]
