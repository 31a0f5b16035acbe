"""The primitives every section of a point file is built from: strict base model, checked number types, dtypes.

Everything read from a file is checked strictly, so that no typo is silently read as something else: a count
is a whole number (`8`, or `8.0` / `8e0`, which JSON writers and YAML exponents give, but never `true`, `'8'` or
`2.5`); a flag is true or false, not 1 or 'yes'; every float is finite and within the physical range of its
field; and every size is within the tool's limits (dse/limits.py, README: Limits).
"""

from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints
from pydantic_core import PydanticCustomError

from dse.limits import (
    MAX_CAPACITY_GIB,
    MAX_LATENCY_NS,
    MAX_LAYERS,
    MAX_NAME_CHARS,
    MAX_RATE,
    MAX_WIDTH,
    MAX_WORLD,
    MIN_RATE,
    MIN_SHARE,
)

GiB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
Dtype = Literal["fp32", "bf16", "fp16", "fp8"]
PeakDtype = Literal["fp32", "bf16", "fp16", "fp8", "fp4"]
"""A dtype an accelerator states a peak for: fp4 (Blackwell's NVFP4 tensor cores) is a peak only, not a model,
cache or reduction dtype (Dtype): its half-byte elements would break the whole-byte itemsizes the generators, the
Chakra exporter and the fx models' torch dtypes count in, and no stored table times an fp4 op."""
OpCategory = Literal["gemm", "attention", "elementwise", "norm", "embedding", "optimizer", "other"]


def as_whole(value: Any) -> Any:
    """A float with no fraction is the whole number it writes (8192.0, 8e3); a boolean is no number at all (YAML
    reads true, yes and on as booleans, and Python counts True as 1). Anything else is left to the strict check."""
    if isinstance(value, bool):
        raise PydanticCustomError("bool_type", "expected a number, not a boolean")
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    return value


def as_tuple(value: Any) -> Any:
    """A YAML or JSON list where a tuple is kept (strict validation takes tuples only)."""
    return tuple(value) if isinstance(value, list) else value


Whole = Annotated[int, BeforeValidator(as_whole)]
Count = Annotated[Whole, Gt(0)]
Layers = Annotated[Count, Le(MAX_LAYERS)]
Width = Annotated[Count, Le(MAX_WIDTH)]
Degree = Annotated[Count, Le(MAX_WORLD)]
Rate = Annotated[float, Ge(MIN_RATE), Le(MAX_RATE)]
"""TFLOP/s or GB/s."""
Share = Annotated[float, Ge(MIN_SHARE), Le(1)]
"""A share of a peak rate."""
Capacity = Annotated[float, Ge(0), Le(MAX_CAPACITY_GIB)]
"""GiB."""
Latency = Annotated[float, Ge(0), Le(MAX_LATENCY_NS)]
"""Nanoseconds."""
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$")]
"""A model's, accelerator's or system's name: shown in tables, plots and MLflow, so one line of text."""


class Spec(BaseModel):
    """Frozen and strict: a misspelt field is an error, not a silent default, and no value is coerced from
    another type (see the module docstring); floats must be finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def left_out_at_default(default: Any, description: str) -> Any:
    """A field added after points were stored: left out of a point's dump while it holds its default, so that the
    key of a point that does not set it (`DesignPoint.key`, by which a resumed study finds its evaluated points and
    `dse compare` matches fronts) stays what it was."""
    return Field(default, exclude_if=lambda value: value == default, description=description)
