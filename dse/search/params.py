"""One searched field of a study file (`space:`): its choices or range, how Optuna samples it, and what a grid walks."""

from typing import Annotated, Any

from annotated_types import Gt
from pydantic import BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from dse.limits import MAX_CHOICES
from dse.search.decoding import Value


class Param(BaseModel):
    """One searched field: `{choices: [...]}`, or `{low, high, step?, log?}` (an int range if low and high are
    ints, else a float range)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    choices: list[Value] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    low: int | float | None = None
    high: int | float | None = None
    step: Annotated[int | float, Gt(0)] | None = None
    log: bool = False
    feasibility_only: bool = False
    """The field only decides whether a point fits, never its objectives: the study evaluates each configuration
    once, at the largest value, and derives the result for every other value (`dse.search.capacity`)."""
    _repeated: list[Value] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "Param":
        ranged = self.low is not None or self.high is not None or self.step is not None or self.log
        if self.choices is not None:
            if ranged:
                raise ValueError("give either 'choices' or 'low'/'high' (with 'step' or 'log'), not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give 'choices: [...]' or both 'low' and 'high'")
        if self.low > self.high:
            raise ValueError(f"low={self.low} is above high={self.high}")
        if self.log and self.step is not None:
            raise ValueError("a range is either log-scaled or stepped, not both; drop 'step' or 'log'")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")
        return self

    @property
    def first(self) -> Value:
        return self.choices[0] if self.choices is not None else self.low  # type: ignore[return-value]

    @property
    def largest(self) -> Value:
        """The largest value: where a feasibility-only dimension is evaluated."""
        return max(self.choices) if self.choices is not None else self.high  # type: ignore[type-var,return-value]

    @property
    def values(self) -> list[Value]:
        """The choices, or the ends of the range: what load_study checks against the field."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]  # type: ignore[list-item]

    @property
    def is_int(self) -> bool:
        return all(isinstance(v, int) for v in (self.low, self.high, self.step) if v is not None)

    @property
    def size(self) -> int | None:
        """Distinct values: the choices, or the steps of an integer range (load_study has checked that the step fits
        the range); None for a float range."""
        if self.choices is not None:
            return len(self.choices)
        if not self.is_int:
            return None
        return (int(self.high) - int(self.low)) // int(self.step or 1) + 1  # type: ignore[arg-type]

    @model_validator(mode="wrap")
    @classmethod
    def _distinct_choices(cls, data: Any, handler: ModelWrapValidatorHandler["Param"]) -> "Param":
        """Each choice once, the first kept: a repeat would be searched (and counted) twice. The repeats are kept
        aside (`repeated`) for load_study's warning, which can name the file and the field."""
        param = handler(data)
        if param.choices is None:
            return param
        distinct: dict[tuple[str, Value], Value] = {}
        repeated = []
        for choice in param.choices:
            if (key := _choice_key(choice)) in distinct:
                repeated.append(choice)
            else:
                distinct[key] = choice
        if not repeated:
            return param
        out = param.model_copy(update={"choices": list(distinct.values())})
        out._repeated = repeated
        return out

    @property
    def repeated(self) -> list[Value]:
        """Choices the file gave more than once, each after its first, as they were dropped."""
        return self._repeated


def _choice_key(choice: Value) -> tuple[str, Value]:
    """What makes two choices one: numbers by value (1, 1.0 and 1e0 give the same point), booleans and strings as
    written (true is not 1: a field takes one or the other, and the other is refused by name)."""
    if isinstance(choice, bool | str):
        return type(choice).__name__, choice
    return "number", int(choice) if isinstance(choice, float) and choice.is_integer() else choice
