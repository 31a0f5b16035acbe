"""What a capture produces, importable without torch: the captured and lowered pieces, and the capture's error.

A piece loaded from the disk cache (`disk_cache`) is unpickled into these classes, so a process whose captures are
all on disk never imports torch (its import and torch.compile's are most of a cold `dse evaluate`'s time);
`capture` and `lower` make them and re-export them under their old names.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dse.errors import DseError
from dse.workload import Block

if TYPE_CHECKING:
    from torch import fx

PROLOGUE, EPILOGUE = "prologue", "epilogue"
"""The model's two ends (`generators.fx.ends`): what its forward runs before its first block and after its last."""


class CaptureError(DseError):
    """A model the capture cannot handle (data-dependent control flow, an op without a meta kernel, a block the
    TP plan does not fit): the trial fails with the op and the module named."""


@dataclass(frozen=True)
class CapturedLayer:
    """One block's graphs and what the lowering needs to read them."""

    forward: "fx.GraphModule | None"
    """None once lowered and kept on disk (graphs do not pickle; nothing reads them after the lowering)."""
    backward: "fx.GraphModule | None"
    """None for an inference capture, and on disk."""
    input_shape: tuple[int, ...]
    """The block input's local shape: the forward placeholder it is, the backward output that is its gradient."""
    axes: dict[str, str]
    """Process-group name -> mesh axis ("tp", "ep", "dp"), for the collectives' `group_name` argument."""
    parameters: int
    """Parameters of the whole model as the factory built it (unsharded)."""


@dataclass(frozen=True)
class LoweredGraph:
    block: Block
    saved_bytes: float
    """Forward only: bytes of the activations the forward keeps for backward (weights aside)."""
    state_bytes: float = 0.0
    """Bytes of the floating-point inputs the graph updates in place: the KV cache a decoding layer appends to."""


@dataclass(frozen=True)
class LoweredLayer:
    """A captured layer, lowered: its forward and backward, and the capture they come from."""

    forward: LoweredGraph
    backward: LoweredGraph | None
    """None for an inference capture."""
    captured: CapturedLayer
