"""Pipeline stages' schedules without sizes (`Skeleton`), kept per shape of the step (`Pipeline.scheduled` keys
them) so that a later point of that shape adds only its sizes; and what a point's schedule is keyed by
(`schedule_shape`, `schedule_affinity`)."""

from dataclasses import dataclass

import numpy as np

from dse.lru import MIB, ByteBoundedLru
from dse.spec import DesignPoint
from dse.workload import TENSOR_KIND_CODE, CallShape, OpKind, Program, TableTensors, TensorKind, TensorTable
from generators.symbolic.blocks import LayerKey, Traced
from generators.symbolic.schedule import steady_microbatches
from generators.symbolic.sharding import Sharding

Unit = tuple[str | LayerKey, bool]
"""A traced module a call runs: "embed", "head" or a traced layer, and whether it is the layer's variant whose
backward recomputes nothing (see `Pipeline.unrecomputed`)."""
Source = tuple[str | LayerKey, bool, int]
"""What sizes a scheduled tensor: a unit and what of it: 0 and 1 the weights its forward and its backward gather,
or one of the negative codes below."""
SAVED, SAVED_FOR_INPUT_GRAD, SAVED_FOR_WEIGHT_GRAD, MADE_FOR_WEIGHT_GRAD = -1, -2, -3, -4
"""A unit's saved activations; with a deferred weight-gradient half, the part of them only the input-gradient half
reads, the part the weight-gradient half reads, and what the input-gradient half makes for it
(`Traced.held_for_weight`)."""
RESHARDED = 2
"""A `Source`'s `what` for the 1/n shard of a module's weights kept from its forward to its backward."""
TensorRow = tuple[str, TensorKind, float, int, int]
"""A scheduled tensor as a walk keeps it: a `Tensor`'s fields (name, kind, bytes, producer, consumer call)."""


def traced_bytes(traced: Traced, what: int, post_forward: float | None) -> float:
    """The bytes of what of a traced module sizes a scheduled tensor (a `Source`'s `what`); `post_forward` is the
    shard FSDP keeps of gathered weights after a forward (`Sharding.post_forward`)."""
    if what == RESHARDED:
        assert post_forward is not None
        return traced.gathered_bytes[0] / post_forward
    if what >= 0:
        return traced.gathered_bytes[what]
    saved, (for_weight, made) = traced.saved_bytes, traced.held_for_weight
    return {
        SAVED: saved,
        SAVED_FOR_INPUT_GRAD: saved - for_weight,
        SAVED_FOR_WEIGHT_GRAD: for_weight,
        MADE_FOR_WEIGHT_GRAD: made,
    }[what]


@dataclass(frozen=True, slots=True, eq=False)
class Skeleton:
    """One stage's schedule without sizes: its calls, the p2p blocks it made, and its activation tensors' lifetimes
    with what sizes each (the bytes a source's block saves or gathers). Every program built from it carries its
    `shape`, on which cost models keep what they derive from the calls alone, and its `table` of tensors, to
    which a point adds only the sizes."""

    shape: CallShape
    p2p: tuple[tuple[OpKind, int, str], ...]
    table: TensorTable
    sources: tuple[Source, ...]
    """The distinct sources of the tensors' sizes."""
    source_of: np.ndarray
    """Per row of the table, its source's place in `sources`."""
    marks: tuple[tuple[int, int], ...]
    """Per step of the stage's schedule, the calls and rows made before it (`splice` finds periods by them)."""

    @staticmethod
    def of_walk(
        program: Program,
        rows: list[TensorRow],
        sources: list[Source],
        p2p: tuple[tuple[OpKind, int, str], ...],
        marks: list[tuple[int, int]],
    ) -> "Skeleton":
        """The skeleton of a program just walked (`walk.walk`): the walk kept the tensors `rows` alive,
        sized by `sources`, made the p2p blocks `p2p` and began its steps at `marks`. The program takes the
        skeleton's shape and holds those tensors in its table after its own."""
        distinct = tuple(dict.fromkeys(sources))
        place = {source: i for i, source in enumerate(distinct)}
        names, kinds, nbytes, producer, consumer = tuple(zip(*rows, strict=True)) or ((),) * 5
        table = TensorTable(
            names,
            kinds,
            np.array(producer, dtype=np.intp),
            np.array(consumer, dtype=np.intp),
            np.array([TENSOR_KIND_CODE[kind] for kind in kinds], dtype=np.intp),
        )
        skeleton = Skeleton(
            CallShape(tuple(program.calls)),
            p2p,
            table,
            distinct,
            np.array([place[source] for source in sources], dtype=np.intp),
            tuple(marks),
        )
        program.calls, program.shape = skeleton.shape.program_calls(), skeleton.shape
        program.tensors = TableTensors(program.tensors, table, np.array(nbytes, dtype=float))
        return skeleton

    def fill(self, program: Program, nbytes: np.ndarray) -> None:
        """Make a program holding only its stage's fixed tensors run this skeleton's calls, its tensors sized by
        `nbytes` per source."""
        self.fill_rows(program, nbytes[self.source_of])

    def fill_rows(self, program: Program, row_bytes: np.ndarray) -> None:
        """`fill`, given the bytes of each row of the table."""
        program.calls, program.shape = self.shape.program_calls(), self.shape
        program.tensors = TableTensors(program.tensors, self.table, row_bytes)


@dataclass(frozen=True, slots=True, eq=False)
class StepShape:
    """The part of a stage skeleton's key that every stage of a step shares (`Pipeline.step_shape`): a long tuple
    (a layer kind per layer, the traces' blocks) hashed once per step rather than once per stage. A stage's whole
    shape (its key but for the micro-batches) is one too, hashed once however many micro-batches `kept_shorter`
    tries it with."""

    key: tuple
    digest: int

    @staticmethod
    def of(key: tuple) -> "StepShape":
        return StepShape(key, hash(key))

    def __hash__(self) -> int:
        return self.digest

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, StepShape) and self.digest == other.digest and self.key == other.key)


def runs(items: list) -> tuple[tuple[object, int], ...]:
    """A list as its runs of equal items, (item, length) each: a model's layer kinds are a few runs of many layers."""
    out: list[tuple[object, int]] = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1] = (item, out[-1][1] + 1)
        else:
            out.append((item, 1))
    return tuple(out)


def schedule_shape(point: DesignPoint) -> tuple:
    """The fields of a point that its stages' schedule skeletons are keyed by, besides the model's structure and
    the number of micro-batches scheduled."""
    p = point.parallel
    sharding = Sharding.of(p)
    return (
        point.model.name,
        p.pp,
        p.virtual_stages if p.pp_schedule == "interleaved" else 1,
        p.pp_schedule,
        p.microbatch_group,
        point.workload.mode,
        p.zero >= 2 and not sharding.grad_per_step,
        sharding.hold,
        sharding.head_hold,
        p.overlap_grad_reduce,
        p.overlap_p2p_comm,
        p.recompute_every,
        p.first_stage_layers,
        p.last_stage_layers,
        p.fsdp_prefetch,
        p.grad_bucket_mb,
    )


def schedule_affinity(point: DesignPoint) -> tuple:
    """The schedule skeletons a cost model prices a point from: its shape and the micro-batches of its steady
    form (or of the step, without one). The first point of each pays the walk over every layer and micro-batch,
    most of a cold generation, and the cost model keeps its segment layouts on the skeletons' call shapes, so
    points alike in these run best in one process: the generator's `affinity`."""
    return (*schedule_shape(point), steady_microbatches(point) or point.micro_batches)


SKELETON_CACHE_BYTES = 64 * MIB
"""About 440 stages of GPT-3 175B at pp 16 (~150 KB each, with what cost models keep on their shapes); several
studies' distinct stage shapes."""
SKELETON_BYTES_PER_CALL = 260
"""A skeleton's bytes per call: a walk of gc referents summed 95-97 KiB for each of the 583-call stages of
benchmarks/vs_calculon.py's pp 16 configurations (its calls, tensor table and sources: 170 B a call), and the arrays
cost models keep on its shape's memo, 88 B a call after those 96 configurations (the compiled engine's call arrays
34, peak memory's moments 29, the calls' fields 24, the steady check's twins 1)."""
_SKELETONS: ByteBoundedLru[tuple, Skeleton] = ByteBoundedLru(
    "skeletons", SKELETON_CACHE_BYTES, lambda skeleton: SKELETON_BYTES_PER_CALL * len(skeleton.shape)
)
"""Per process (an evaluator actor keeps it across trials), least recently used out first."""


def skeleton_for(key: tuple) -> Skeleton | None:
    """The skeleton kept for a stage of this shape (`Pipeline.scheduled` makes the key), if any."""
    return _SKELETONS.get(key)


def keep_skeleton(key: tuple, skeleton: Skeleton) -> None:
    """Keep a stage's skeleton for later points of its shape."""
    _SKELETONS.put(key, skeleton)


def kept_shorter(stage_shape: StepShape, microbatches: int, fewest: int) -> tuple[int, Skeleton] | None:
    """The kept skeleton of a stage of this shape (`Pipeline.scheduled` keys them by it and their micro-batches)
    over the most micro-batches from `fewest` to fewer than `microbatches`, with those micro-batches; None if
    none is kept. Looked up without counting a miss per number of micro-batches tried."""
    for fewer in range(microbatches - 1, fewest - 1, -1):
        skeleton = _SKELETONS.peek((stage_shape, fewer))
        if skeleton is not None:
            return fewer, skeleton
    return None


@dataclass(frozen=True, slots=True, eq=False)
class StepSkeletons:
    """The skeletons every stage of a step took, kept by the step's key (`Pipeline.programs`): a later point of the
    step's shape looks up its first stage's skeleton and, finding the one these start with, fills the others
    without a lookup each. The p2p blocks the stages after the first made, and the distinct sources of all their
    tensors' sizes with each stage's picks of them, so that every source is sized once per point."""

    skeletons: tuple[Skeleton, ...]
    p2p: tuple[tuple[OpKind, int, str], ...]
    sources: tuple[Source, ...]
    picks: tuple[tuple[int, ...], ...]
    """Per stage, the place in `sources` of each of its skeleton's sources."""
    rows: tuple[np.ndarray, ...]
    """Per stage, the place in `sources` of each row of its skeleton's table (its `source_of` through its picks)."""

    @staticmethod
    def of(skeletons: list[Skeleton], p2p: tuple[tuple[OpKind, int, str], ...]) -> "StepSkeletons":
        place: dict[Source, int] = {}
        for skeleton in skeletons:
            for source in skeleton.sources:
                place.setdefault(source, len(place))
        picks = tuple(tuple(place[source] for source in skeleton.sources) for skeleton in skeletons)
        rows = tuple(
            np.array(stage_picks, dtype=np.intp)[skeleton.source_of]
            for skeleton, stage_picks in zip(skeletons, picks, strict=True)
        )
        return StepSkeletons(tuple(skeletons), p2p, tuple(place), picks, rows)

    def fill(self, programs: list[Program], sized: list[float]) -> None:
        """Fill the programs of the stages after the first (`Skeleton.fill`), given the bytes of every source.
        Sizes all floats (as a replay makes them) are indexed per row in one step from one array; otherwise each
        stage's come as `Skeleton.fill` takes them, so that a stage of integer sizes keeps an integer array."""
        stages = zip(programs[1:], self.skeletons[1:], self.picks[1:], self.rows[1:], strict=True)
        if all(type(nbytes) is float for nbytes in sized):
            every = np.array(sized, dtype=float)
            for program, skeleton, _, rows in stages:
                skeleton.fill_rows(program, every[rows])
            return
        for program, skeleton, picks, _ in stages:
            skeleton.fill(program, np.array([sized[i] for i in picks]))


_STEPS: ByteBoundedLru[tuple, StepSkeletons] = ByteBoundedLru(
    "step_skeletons",
    SKELETON_CACHE_BYTES,
    lambda step: SKELETON_BYTES_PER_CALL * sum(len(skeleton.shape) for skeleton in step.skeletons),
)
"""Per process, like the skeletons. An entry keeps its skeletons alive after the skeleton cache lets them go, so it
is counted at their bytes (an upper bound: both caches mostly hold the same ones)."""


def step_for(key: tuple) -> StepSkeletons | None:
    """The skeletons kept for a step of this key (`Pipeline.programs` makes it, with the skeleton its first stage
    took: one made anew, after the skeleton cache let the old one go or was cleared, schedules the step anew)."""
    return _STEPS.get(key)


def keep_step(key: tuple, step: StepSkeletons) -> None:
    """Keep the skeletons a step's stages took for later points of its shape."""
    _STEPS.put(key, step)
