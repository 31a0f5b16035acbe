"""Building design points in tests without point files."""

from typing import Any

from dse.points import assign, build_point, expand
from dse.spec import DesignPoint


def make_point(
    model: str = "tiny-llama",
    system: Any = "tiny-ring",
    seq_len: int = 256,
    global_batch: int = 8,
    micro_batch: int = 1,
    overrides: dict[str, Any] | None = None,
    **parallel: Any,
) -> DesignPoint:
    raw = expand(
        {
            "model": model,
            "workload": {"seq_len": seq_len, "global_batch": global_batch, "micro_batch": micro_batch},
            "parallel": parallel,
            "system": system,
        }
    )
    for path, value in (overrides or {}).items():
        assign(raw, path, value)
    return build_point(raw, "test point")
