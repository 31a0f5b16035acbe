"""The IR: the distributed execution graph of one step, kept compact through repetition.

A Workload holds op templates (`Block`s: a layer's forward, its backward, a pipeline send, the optimizer step)
and, per rank class, a `Program`: the sequence of block `Call`s that class issues. Layers, micro-batches and
ranks repeat, so a 1024-rank Llama-3-70B step is a few dozen blocks and a few thousand calls, not millions of
ops. `expand()` gives the flat per-op graph that exporters and the reference simulation walk.

Units: FLOPs (2 per multiply-add), bytes, seconds. Communication sizes follow the nccl-tests convention: all-reduce
= the buffer, all-gather = the output, reduce-scatter = the input, all-to-all = the send buffer.
"""

from collections import UserList
from collections.abc import Callable, Iterable, Iterator, MutableSequence, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from math import prod
from typing import Literal, NamedTuple, overload

import numpy as np

from dse.calls import Call, CallShape

BLOCK_INPUT = -1
"""In Op.deps: the op waits for the outputs of the calls that feed its block."""


class OpKind(StrEnum):
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    SEND = "send"
    RECV = "recv"


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


def bus_factor(kind: Collective | str, n: int) -> float:
    """The share of the buffer a ring over n members moves over each member's link: nccl-tests' bus bandwidth
    (busbw) is this times the buffer over the time, which makes collectives of any kind and size comparable."""
    kind = Collective(kind)
    if kind is Collective.BROADCAST:
        return 1.0
    return (2 if kind is Collective.ALL_REDUCE else 1) * (n - 1) / n


class TensorKind(StrEnum):
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    KV_CACHE = "kv_cache"
    TEMPORARY = "temporary"


class AttentionShape(NamedTuple):
    """A fused attention kernel's problem as it runs, per sequence and head: `queries` rows attending over `keys`
    rows. Kernels reach a higher share of peak on longer sequences and wider heads, and less under the causal mask
    and in the backward pass, so a cost model that prices attention by its kernel's measured throughput needs this,
    not only the FLOPs. A table timed per call (batch, heads, KV heads) also needs the call's parallel work."""

    queries: float
    keys: float
    """Before the causal mask."""
    head_dim: float
    """(query/key width + value width) / 2: the width of a standard kernel doing the same FLOPs."""
    causal: bool
    backward: bool
    batch: float = 0.0
    """Sequences of the call on one rank; 0: not given (measured per-call tables then cannot price it)."""
    heads: float = 0.0
    """Query heads of the call on one rank (after tensor parallelism); 0: not given."""
    kv_heads: float = 0.0
    """Key/value heads the call reads on one rank: fewer than `heads` under grouped-query attention; 0: not given."""


@dataclass(slots=True, frozen=True)
class Op:
    """One kernel or one communication call.

    category: a compute category (gemm, attention, elementwise, norm, embedding, optimizer, other) or, for
    collectives, the Collective value. density: the share of `flops` the kernel executes (causal attention
    skips the masked half; `flops` keeps the conventional count that MFU uses). axis: the process-group axis a
    collective or p2p runs on ("tp", "dp", "dp+cp"); peer: the offset along that axis of a send's destination or
    a recv's source.
    """

    name: str
    kind: OpKind
    category: str
    flops: float = 0.0
    bytes: float = 0.0
    density: float = 1.0
    comm_bytes: float = 0.0
    axis: str = ""
    peer: int = 0
    deps: tuple[int, ...] = ()
    out_bytes: float = 0.0
    """Bytes of the tensors a compute op writes (for exporters' tensor lists; 0 when unknown)."""
    attention: AttentionShape | None = None
    """A fused attention kernel's problem (None for any other op, and where the generator does not say)."""
    gemm: tuple[float, float, float, float] | None = None
    """A matrix product's (batch, m, n, k) on one rank, when the generator knows it: a GEMM's speed depends on
    its shape (how its output tiles fill the SMs), not only on its FLOPs; None for any other op."""

    @property
    def is_comm(self) -> bool:
        return self.kind is not OpKind.COMPUTE


@dataclass(slots=True, frozen=True)
class Block:
    """An op template instantiated by calls. deps index earlier ops of the block, or BLOCK_INPUT.

    output: the op whose end makes the block's result available to the calls it feeds (a layer's backward
    hands its input gradient on before its asynchronous gradient sync has finished). temp_bytes: transient
    working memory held while the block runs.
    """

    name: str
    ops: tuple[Op, ...]
    output: int = -1
    temp_bytes: float = 0.0

    @property
    def output_index(self) -> int:
        return self.output % len(self.ops)


class Tensor(NamedTuple):
    """A memory allocation: live from the start of its producer call to the end of its last consumer call.

    None for producer means allocated before the step (parameters, optimizer states); None for consumer means
    kept to the end of the step. A named tuple, like Call: there is one per layer and micro-batch.
    """

    name: str
    kind: TensorKind
    bytes: float
    producer: int | None = None
    consumer: int | None = None


TENSOR_KINDS = tuple(TensorKind)
"""TensorKind by code, the code being its place here (TensorColumns.kind)."""
TENSOR_KIND_CODE = {kind: code for code, kind in enumerate(TENSOR_KINDS)}
NO_CALL = -1
"""In TensorColumns.producer and .consumer: no producer (allocated before the step) or no consumer (kept)."""


class TensorColumns(NamedTuple):
    """Tensors as arrays, for a cost model's sweep over many of them."""

    producer: np.ndarray
    consumer: np.ndarray
    kind: np.ndarray
    """Codes into TENSOR_KINDS."""
    bytes: np.ndarray


def tensor_columns(tensors: Sequence[Tensor]) -> TensorColumns:
    return TensorColumns(
        np.array([NO_CALL if t.producer is None else t.producer for t in tensors], dtype=np.intp),
        np.array([NO_CALL if t.consumer is None else t.consumer for t in tensors], dtype=np.intp),
        np.array([TENSOR_KIND_CODE[t.kind] for t in tensors], dtype=np.intp),
        np.array([t.bytes for t in tensors], dtype=float),
    )


@dataclass(frozen=True, eq=False)
class TensorTable:
    """Tensors alike but for their sizes, as columns: the activations a pipeline stage's schedule keeps alive, which
    every program generated from that schedule shares; only their sizes change from one design point to the next.
    Every row has a producer and a consumer call."""

    names: tuple[str, ...]
    kinds: tuple[TensorKind, ...]
    producer: np.ndarray
    consumer: np.ndarray
    kind: np.ndarray


class TableTensors(UserList):
    """A program's tensors: a few of its own (weights, optimizer states) then a TensorTable's rows with this
    program's sizes. It reads and changes like the list of Tensors it stands for, made on first such use; until
    then `columns` hands a cost model the arrays without making an object per tensor (thousands per program, more
    time than the cost model's whole memory sweep). Without a table it is a plain list of `own`, as UserList's
    slicing and concatenation make."""

    def __init__(
        self, own: Iterable[Tensor] = (), table: TensorTable | None = None, nbytes: np.ndarray | None = None
    ) -> None:
        self._own = tuple(own)
        self._table = table
        self._nbytes = nbytes
        self._rows: list[Tensor] | None = list(self._own) if table is None else None

    @property
    def data(self) -> list[Tensor]:  # type: ignore[override]
        if self._rows is None:
            t = self._table
            assert t is not None and self._nbytes is not None
            rows = zip(t.names, t.kinds, self._nbytes.tolist(), t.producer.tolist(), t.consumer.tolist(), strict=True)
            self._rows = [*self._own, *(Tensor(*row) for row in rows)]
        return self._rows

    @data.setter
    def data(self, rows: list[Tensor]) -> None:
        self._rows = rows

    @property
    def unmade(self) -> bool:
        """Whether its rows were never made as objects: until then nothing can have changed them, so what a cost
        model derived from these tensors still holds."""
        return self._rows is None

    def columns(self) -> TensorColumns:
        if self._rows is not None:  # read as objects, perhaps changed since
            return tensor_columns(self._rows)
        own, t = tensor_columns(self._own), self._table
        assert t is not None and self._nbytes is not None
        return TensorColumns(
            np.concatenate((own.producer, t.producer)),
            np.concatenate((own.consumer, t.consumer)),
            np.concatenate((own.kind, t.kind)),
            np.concatenate((own.bytes, self._nbytes)),
        )

    def snapshot(self) -> tuple:
        """Equal for equal tensors while unmade (same table, same sizes), without making them."""
        if self._rows is not None:
            return ("rows", tuple(self._rows))
        assert self._nbytes is not None
        return ("table", self._own, self._table, self._nbytes.tobytes(), self._nbytes.dtype.str)

    @staticmethod
    def rows_of(snapshot: tuple) -> tuple[Tensor, ...]:
        """The tensors a snapshot stands for, as objects."""
        if snapshot[0] == "rows":
            return snapshot[1]
        _, own, table, nbytes, dtype = snapshot
        return tuple(TableTensors(own, table, np.frombuffer(nbytes, dtype=dtype)))


def columns_of(tensors: Sequence[Tensor]) -> TensorColumns:
    return tensors.columns() if isinstance(tensors, TableTensors) else tensor_columns(tensors)


def table_parts(tensors: Sequence[Tensor]) -> tuple[tuple[Tensor, ...], TensorTable, np.ndarray] | None:
    """(own tensors, table, the table's sizes) of tensors held in a TensorTable and never made as objects, else
    None: what a cost model needs to keep what it derives from the table's columns for later points of the table,
    and to read a point's sizes without `columns_of` building every column again."""
    if not isinstance(tensors, TableTensors) or not tensors.unmade:
        return None
    assert tensors._table is not None and tensors._nbytes is not None
    return tensors._own, tensors._table, tensors._nbytes


@dataclass(slots=True)
class Program:
    """What every rank of one rank class runs."""

    rank_class: int
    name: str
    calls: MutableSequence[Call] = field(default_factory=list)
    tensors: list[Tensor] | TableTensors = field(default_factory=list)
    shape: CallShape | None = field(default=None, compare=False)
    """The calls as a shared sequence, when the generator knows one (see CallShape); None otherwise."""

    def add(self, call: Call) -> int:
        self.calls.append(call)
        return len(self.calls) - 1

    def call_shape(self) -> CallShape | None:
        """`shape` if it still holds the program's calls, else None (the calls were edited after generation)."""
        shape = self.shape
        return shape if shape is not None and shape.holds(self.calls) else None


@dataclass(frozen=True)
class RankLayout:
    """Named parallel axes, innermost first; a rank's coordinate on axis i is (rank // stride_i) % size_i."""

    axes: tuple[tuple[str, int], ...]

    @property
    def world(self) -> int:
        return prod(size for _, size in self.axes)

    def size(self, axis: str) -> int:
        """Size of an axis or of a '+'-joined combination of axes."""
        sizes = dict(self.axes)
        return prod(sizes[a] for a in axis.split("+"))

    def stride(self, axis: str) -> int:
        stride = 1
        for name, size in self.axes:
            if name == axis:
                return stride
            stride *= size
        raise KeyError(axis)

    def coord(self, rank: int, axis: str) -> int:
        return (rank // self.stride(axis)) % dict(self.axes)[axis]

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` except those on the given axis (or axes)."""
        members = [rank]
        for name in axis.split("+"):
            stride, size = self.stride(name), dict(self.axes)[name]
            base = [r - self.coord(r, name) * stride for r in members]
            members = [b + i * stride for b in base for i in range(size)]
        return sorted(set(members))

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of the axis, each once, ordered by its lowest rank."""
        seen: set[int] = set()
        out = []
        for rank in range(self.world):
            if rank not in seen:
                members = self.group(rank, axis)
                seen.update(members)
                out.append(members)
        return out

    def peer(self, rank: int, axis: str, offset: int) -> int:
        """The rank `offset` positions along the axis, around its ring (a ring step's last rank sends to the
        first)."""
        coord = self.coord(rank, axis)
        size = dict(self.axes)[axis]
        return rank + ((coord + offset) % size - coord) * self.stride(axis)


def _tensor_snapshot(tensors: Sequence[Tensor]) -> tuple:
    """What tensors are made of, with every list copied (TableTensors.snapshot, or the tensors themselves)."""
    return tensors.snapshot() if isinstance(tensors, TableTensors) else ("rows", tuple(tensors))


class DeferredPrograms(Sequence[Program]):
    """A workload's programs, built on first use.

    A cost model that prices the step from its SteadyForm never reads the full programs, and building them (a
    call per layer and micro-batch on every stage) would be most of the generation; everything else (exporters,
    summaries, the reference simulation) gets them on first access, built by the same generator code."""

    def __init__(self, count: int, build: Callable[[], list[Program]]) -> None:
        self._count = count
        self._build: Callable[[], list[Program]] | None = build
        self._programs: list[Program] = []
        self._as_built: tuple[tuple[tuple[Call, ...], tuple], ...] = ()

    @property
    def built(self) -> bool:
        return self._build is None

    def unedited(self) -> bool:
        """Whether the programs are still as built (trivially, when they have not been built)."""
        if self._build is not None:
            return True
        # Unedited programs share their items with the snapshot, so this compares by identity, item by item; a
        # table of tensors never read as objects compares by its sizes' bytes, without making the objects.
        return all(
            tuple(p.calls) == calls
            and (_tensor_snapshot(p.tensors) == tensors or tuple(p.tensors) == TableTensors.rows_of(tensors))
            for p, (calls, tensors) in zip(self._programs, self._as_built, strict=True)
        )

    def _get(self) -> list[Program]:
        if self._build is not None:
            self._programs = self._build()
            self._as_built = tuple((tuple(p.calls), _tensor_snapshot(p.tensors)) for p in self._programs)
            self._build = None
        return self._programs

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Program: ...
    @overload
    def __getitem__(self, index: slice) -> list[Program]: ...
    def __getitem__(self, index: int | slice) -> Program | list[Program]:
        return self._get()[index]

    def __iter__(self) -> Iterator[Program]:
        return iter(self._get())

    def __getstate__(self) -> dict:
        """Pickled built: what builds them is a closure of the generator's, which pickle cannot carry (a Ray
        worker or a subprocess handing a workload back)."""
        self._get()
        return self.__dict__


@dataclass(eq=False)
class SteadyForm:
    """The same step with fewer micro-batches, for cost models that price a pipeline's steady state once.

    With identical micro-batches a 1F1B pipeline settles into a steady state in which every stage repeats the
    same calls, shifted by one period, until it drains; the step with more micro-batches only repeats that state
    more often. A cost model may simulate `programs` (this step's programs with `microbatches` micro-batches,
    calling the workload's blocks), find the period on their timeline and add it `repeats` more times, instead of
    walking every micro-batch: it checks the timeline really is periodic first, since only its own rules decide
    that. `period`: micro-batches after which a stage repeats its calls (1 for 1F1B, the stage count for
    interleaved 1F1B). It stands for the workload's programs only while those are DeferredPrograms still as
    built (`holds`): a workload edited since must be priced from its own programs.

    Some pipelines settle into a state that repeats only every few periods (a 1F1B pipeline whose transfers queue
    behind each other on a shared link can repeat every pp micro-batches, not every one), which this form is too
    short to show. `longer()` is then a longer form of the step whose `period` is such a cycle (pp periods): a
    cost model may look on its timeline for any multiple of the shorter form's period that divides it. It is
    built on first call, so a step whose shorter form repeats never pays for it."""

    programs: list[Program]
    microbatches: int
    period: int
    repeats: int
    build_longer: "Callable[[], SteadyForm] | None" = field(default=None, repr=False)
    _longer: "SteadyForm | None" = field(default=None, init=False, repr=False)

    @staticmethod
    def holds(programs: Sequence[Program]) -> bool:
        return isinstance(programs, DeferredPrograms) and programs.unedited()

    def longer(self) -> "SteadyForm | None":
        """The longer form, or None if the step has none."""
        if self.build_longer is not None:
            self._longer, self.build_longer = self.build_longer(), None
        return self._longer

    def __getstate__(self) -> dict:
        """Pickled with its longer form built, as DeferredPrograms are: what builds it is a generator's closure."""
        self.longer()
        return self.__dict__


@dataclass(frozen=True)
class ExpertExchange:
    """A serving step's MoE dispatch and combine all-to-alls as the serving framework runs them: DeepEP's
    low-latency kernels in a decode step, its normal (high-throughput) kernels in a prefill step, as SGLang's
    `--deepep-mode auto` picks. Their time depends on the tokens each rank sends and the layer's shape, which a
    measured table is read by, not on the bytes the workload gives the op (DeepEP dispatches FP8 copies where the
    op moves the activations' dtype)."""

    kernel: Literal["low_latency", "normal"]
    hidden: int
    top_k: int
    experts: int
    copy_bytes: float
    """Bytes of one token copy as the op's comm_bytes count it (hidden x the activations' itemsize): the op's
    bytes over top_k copies of this are the tokens a rank sends (its busiest rank's, under a routing skew)."""
    dispatch: str
    """The name of the dispatch all-to-all op."""
    combine: str
    """The name of the combine all-to-all op."""

    def tokens(self, comm_bytes: float) -> float:
        """Tokens per rank of an all-to-all of these bytes."""
        return comm_bytes / (self.top_k * self.copy_bytes)


@dataclass(frozen=True)
class ExpertCompute:
    """A serving step's routed experts on one rank (their gate/up and down GEMMs and the activation between), which
    a serving framework runs as one fused MoE kernel: a measured table of that kernel is read by the layer's shape
    and the tokens the expert-parallel group routes, not by the ops' own sizes."""

    hidden: int
    width: int
    """One expert's inner width, unsplit (model.moe.expert_ffn)."""
    experts: int
    top_k: int
    ep: int
    prefix: str
    """The names of the block's routed-expert compute ops begin with this."""
    gemm: str
    """The name of the gate (first) GEMM: its rows (batch x m) are the token copies the rank's experts receive, and
    the expert width over its n the tensor-parallel split of the experts."""

    def tokens(self, copies: float) -> float:
        """Tokens the expert-parallel group routes, of `copies` token copies on the rank: each token sends top_k
        copies, spread over ep ranks (the busiest rank's copies under a routing skew, so its effective load)."""
        return copies * self.ep / self.top_k


@dataclass
class Workload:
    """One step of one design point, as the generator sees it and every cost model reads it."""

    point_key: str
    layout: RankLayout
    blocks: list[Block]
    programs: Sequence[Program]
    """One per rank class: a list, or DeferredPrograms built on first use."""
    class_of: np.ndarray
    """Rank -> index into programs."""
    tokens: int
    """Tokens processed per step, over all ranks."""
    model_flops: float
    """FLOPs of the step by the conventional count (6 N T + attention, no recompute), for MFU."""
    dtype: str = "bf16"
    """The dtype the compute ops run their math in (its peak is what a roofline divides by)."""
    steady: SteadyForm | None = None
    """The step with fewer micro-batches, when the generator knows its pipeline settles (see SteadyForm)."""
    attention_kernel: str = "auto"
    """The fused attention kernel the step runs (WorkloadSpec.attention_kernel): with the ops' AttentionShape, what
    a cost model prices attention by."""
    framework_allreduce: bool = False
    """The step runs in a serving framework (prefill and decode steps), whose tensor-parallel all-reduce within a
    node is its own kernel (TensorRT-LLM's one-shot and two-shot all-reduce, vLLM's and SGLang's custom all-reduce)
    where that is faster than NCCL's: a cost model with the framework's measured table prices it by the faster of
    the two at each size, as the frameworks' automatic strategy picks."""
    expert_exchange: ExpertExchange | None = None
    """A serving step's MoE dispatch and combine (None: a training step, or a model without experts over ep): a
    cost model with the framework's measured DeepEP tables prices them from those."""
    expert_compute: ExpertCompute | None = None
    """A serving step's routed experts (None: a training step, or a model without gated experts): a cost model with
    the framework's measured MoE table prices them from it."""

    def ranks_of(self, rank_class: int) -> np.ndarray:
        return np.flatnonzero(self.class_of == rank_class)

    def representative(self, rank_class: int) -> int:
        return int(np.argmax(self.class_of == rank_class))


@dataclass(slots=True, frozen=True)
class FlatOp:
    """An op of the expanded program: global index, global deps, and the call it came from."""

    index: int
    op: Op
    call: int
    deps: tuple[int, ...]


def expand(workload: Workload, program: Program) -> Iterator[FlatOp]:
    """Every op of a program in issue order, with dependencies resolved to expanded indices."""
    call_output: list[int] = []
    offset = 0
    for c, call in enumerate(program.calls):
        block = workload.blocks[call.block]
        inputs = tuple(call_output[i] for i in call.inputs)
        for local, op in enumerate(block.ops):
            deps: list[int] = []
            for d in op.deps:
                if d == BLOCK_INPUT:
                    deps.extend(inputs)
                else:
                    deps.append(offset + d)
            yield FlatOp(offset + local, op, c, tuple(deps))
        call_output.append(offset + block.output_index)
        offset += len(block.ops)
