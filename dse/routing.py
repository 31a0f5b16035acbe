"""How a mixture-of-experts layer's tokens reach its experts: how many experts a step's tokens reach, and how
unevenly they load the expert-parallel ranks (`workload.routing`).

Both decide a MoE step's time apart from its FLOPs. A grouped GEMM reads the weights of the experts that received
tokens, not of every expert the rank holds: a DeepSeek-V3 decode step of one token reads 8 of its 256 routed
experts. And every EP rank waits for the busiest one at the combine all-to-all, so the layer runs at the pace of the
rank that received the most tokens (DeepSeek-V3 sec. 3.4 balances them with redundant experts, EPLB, for this).
"""

import math
from typing import Annotated

from annotated_types import Ge, Le
from pydantic import Field, model_validator

from dse.fields import Name, Spec
from dse.limits import MAX_WORLD

Imbalance = Annotated[float, Ge(1.0), Le(MAX_WORLD)]


class RoutingSpec(Spec):
    """Routing of tokens to the experts, as the busiest expert-parallel rank sees it."""

    imbalance: Imbalance = Field(
        1.0,
        description="the busiest EP rank's routed tokens over the mean of the EP group's ranks: 1 is uniform "
        "routing; at most parallel.ep (every token on one rank). Its expert GEMMs and its all-to-all bytes scale "
        "by it, and the layer waits for it",
    )
    source: Name | None = Field(
        None, description="where the imbalance figure comes from (a paper's table, a profile); needed above 1"
    )

    @model_validator(mode="after")
    def _sourced(self) -> "RoutingSpec":
        if self.imbalance > 1 and self.source is None:
            raise ValueError(
                f"routing.imbalance {self.imbalance} needs routing.source: where the figure comes from (e.g. "
                "'DeepSeek-V3 EPLB report'); or set imbalance 1 (uniform routing)"
            )
        if self.imbalance == 1 and self.source is not None:
            raise ValueError("routing.source names an imbalance's origin, and imbalance is 1 (uniform); remove it")
        return self


def active_experts(experts: int, copies: float) -> float:
    """Expected experts that receive at least one of `copies` token copies routed uniformly and independently over
    `experts`: E (1 - (1 - 1/E)^T). One copy reaches one expert; copies >> E reach all of them (T = 32k copies of
    a training micro-batch miss none of 256 experts to within 1e-55)."""
    if experts == 1:
        return 1.0
    return experts * -math.expm1(copies * math.log1p(-1.0 / experts))


def busiest_rank_share(imbalance: float, ep: int) -> str | None:
    """Why `imbalance` cannot be among `ep` ranks (the busiest holds at most all of the group's tokens), or None."""
    if imbalance > ep:
        return (
            f"workload.routing.imbalance {imbalance} exceeds parallel.ep={ep}: the busiest of {ep} ranks holds at "
            f"most all of their tokens ({ep} times the mean); lower the imbalance or raise ep"
        )
    return None
