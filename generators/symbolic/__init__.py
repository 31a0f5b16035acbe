"""The symbolic generator: STAGE-style symbolic tensor graphs lowered to the IR.

Each kind of block (embedding, transformer layer, head; forward and backward) is traced once and shared by every
layer, micro-batch and stage that runs it; programs (one per pipeline stage) are sequences of calls to those blocks
in the order of the pipeline schedule. A trace is recorded once per model family, parallel layout and kind of step
and replayed on the sizes and degrees of later points (`tape`).
"""

from generators.symbolic.generator import SymbolicGenerator, count_parameters

__all__ = ["SymbolicGenerator", "count_parameters"]
