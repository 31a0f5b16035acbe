"""The calibration set: published end-to-end training and collective measurements, and the model's error on each.

Every case is a design point in the point-file format and what was measured on it (tokens/s per GPU, and peak
memory where the source gives it), with the source. `dse calibrate` prices each case with the chosen generator
and cost model and prints model against measurement. The accelerator and network efficiencies in the catalog are
set from kernel and collective measurements (see the catalog files' sources), never fitted per case; these cases
check the result. Float8 rows of the torchtitan table are left out: the generator emits bf16 GEMMs only. Each case
runs the kernels its software ran (`workload.kernels`): the blog's fms-fsdp runs and torchtitan's eager row eager,
torchtitan's torch.compile row fused, so the eager/compile difference is itself checked. Where a case's accelerator
prices its GEMMs and collectives from measured kernel tables (`kernel_source: auto` with kernel_tables, the catalog
default), the case is priced again with `kernel_source: roofline` and both are printed side by side.

The collective cases are nccl-tests bus bandwidths on a catalog system's network, priced by the chosen cost model
when it prices a collective alone (dse.interfaces.CollectiveCostModel; the analytical model does, with the closed
forms its simulation uses). Most of them set a catalog efficiency (they say which): their row shows that the
catalog and the formulas reproduce the figure they were set from. The others check the model, and only those count
in the mean.

Where a collective runs within one node, the tables can price it instead (dse.tables.nccl): the NVLink cases are
printed beside aiconfigurator-core's NCCL tables of the same node at a few sizes, so the network model's link
efficiencies are checked against the tables where the two overlap (`NCCL_CASES`).

The held-out cases are published measurements outside ../shared/calibration.md that set nothing: Megatron-LM's
iteration times from Korthikanti et al. 2022, the figures Calculon reports its own accuracy on. They run the
software of their day (attention before fused kernels, dropout, fp16) and are printed in a table of their own.
"""

import argparse
import json
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from dse import plugins
from dse.errors import SpecError
from dse.fields import GiB
from dse.interfaces import CollectiveCostModel, CostModel, WorkloadGenerator
from dse.point.evaluate import evaluate
from dse.point.points import build_point, expand
from dse.spec import DesignPoint
from dse.system import SystemSpec
from dse.tables.nccl import MeasuredCollectives
from dse.tables.source import PACKAGE, NcclTables
from dse.workload import Collective, bus_factor

FSDP_BLOG = "IBM/Meta FSDP blog, pytorch.org 2024-03-13 'Maximizing training throughput using PyTorch FSDP'"
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (iteration 90)"
NCCL_TESTS = "NVIDIA nccl-tests issues #149, #175 (A100), #212, #290 (H100, NDR InfiniBand)"


@dataclass(frozen=True)
class Case:
    name: str
    point: dict[str, Any]
    tokens_per_s_per_gpu: float
    peak_memory_GiB: float | None
    source: str
    note: str = ""


EAGER_BLOG = (
    "eager: fms-fsdp at the blog's date (commit 7746dac, 2024-03-13) defaults use_torch_compile to False and refuses "
    "compile with activation checkpointing; its compile fixes (RoPE) were merged on 2024-03-18, and the follow-up blog "
    "(pytorch.org, 'Maximizing training throughput using PyTorch FSDP and Torch.compile') reports these 57% MFU "
    "runs as the no-compile baseline. fms's LLaMA (ibm-fms) runs RMSNorm in fp32 (use_high_precision_pow), "
    "SiLU and the gate product apart, and a real-valued RoPE (model.rope_impl real: fms/modules/positions.py "
    "RotaryEmbedding.adjusted_qk at fms's state of 2024-03-13, a per-position 2x2 rotation table broadcast "
    "against q and k in fp32, then summed). FSDP1 (parallel.fsdp): main_training.py wraps the model in "
    "FullyShardedDataParallel with use_orig_params = use_torch_compile (False: flat parameters) and bf16 "
    "MixedPrecision (param, reduce and buffer dtypes), so the flat gradient is concatenated and divided before "
    "the bf16 reduce-scatter (torch 2.2 _runtime_utils._reduce_grad)"
)
SELECTIVE_EVERY = 2
"""The blog's 'selective' checkpointing is fms-fsdp's: whole blocks are checkpointed, a share p of them evenly
spaced (fms_fsdp/policies/ac_handler.py). Its 13B rows imply p = 1/2: HFU / MFU is 1 + p/3 (recompute adds a
forward to forward + backward) and the table gives 0.59 / 0.51 = 1.16 on A100 and 0.40 / 0.35 = 1.14 on H100."""


def _fsdp_blog(model: str, system: str, world: int, checkpointing: str, tokens: float) -> Case:
    gpu = "A100" if "a100" in system else "H100"
    recompute = {"none": "none", "selective": "full", "full": "full"}[checkpointing]
    every = SELECTIVE_EVERY if checkpointing == "selective" else 1
    return Case(
        name=f"{model} {gpu}x{world} FSDP, AC {checkpointing}",
        point={
            "model": {"base": model, "rope_impl": "real"},
            "workload": {"seq_len": 4096, "global_batch": 2 * world, "micro_batch": 2, "kernels": "eager"},
            "parallel": {
                "dp": world,
                "zero": 3,
                "fsdp": "fsdp1",
                "fsdp_reduce_dtype": "bf16",
                "recompute": recompute,
                "recompute_every": every,
            },
            "system": system,
        },
        tokens_per_s_per_gpu=tokens,
        peak_memory_GiB=None,
        source=FSDP_BLOG,
        note=EAGER_BLOG
        + (f"; selective: every {SELECTIVE_EVERY}nd layer checkpointed whole" if checkpointing == "selective" else ""),
    )


def _torchtitan_8b(kernels: str, tokens: float, memory: float) -> Case:
    variant = {"eager": "eager", "fused": "torch.compile"}[kernels]
    return Case(
        name=f"llama3.1-8b H100x8 FSDP, AC selective, {variant}",
        point={
            "model": "llama3-8b",
            "workload": {"seq_len": 8192, "global_batch": 16, "micro_batch": 2, "kernels": kernels},
            "parallel": {"dp": 8, "zero": 3, "fsdp": "fsdp2", "fsdp_reduce_dtype": "fp32", "recompute": "selective_op"},
            "system": "torchtitan-h100",
        },
        tokens_per_s_per_gpu=tokens,
        peak_memory_GiB=memory,
        source=TORCHTITAN,
        note="selective = torchtitan's per-op policy (selective_ac_option 'op', its default then); FSDP2 "
        "(fully_shard) with bf16 parameters and its default fp32 reduction (training.mixed_precision_reduce); "
        + (
            "eager: torchtitan's Llama code op by op (RMSNorm in fp32, complex RoPE, repeat_kv)"
            if kernels == "eager"
            else "torch.compile compiles each transformer block, fusing its norms, RoPE and SwiGLU, and its "
            "backward graph recomputes and keeps only what it reads (not w2's output, which only the residual add "
            "reads); the output layer and the fp32 cross-entropy stay eager in both rows"
        ),
    )


CASES: list[Case] = [
    _fsdp_blog("llama2-7b", "ibm-a100-fsdp", 128, "none", 3700),
    _fsdp_blog("llama2-13b", "ibm-a100-fsdp", 128, "selective", 1800),
    _fsdp_blog("llama2-34b", "ibm-a100-fsdp", 128, "full", 700),
    _fsdp_blog("llama2-70b", "ibm-a100-fsdp", 128, "full", 370),
    _fsdp_blog("llama2-7b", "ibm-h100-fsdp", 96, "none", 7500),
    _fsdp_blog("llama2-13b", "ibm-h100-fsdp", 96, "selective", 3800),
    _fsdp_blog("llama2-34b", "ibm-h100-fsdp", 96, "full", 1550),
    _fsdp_blog("llama2-70b", "ibm-h100-fsdp", 96, "full", 800),
    _torchtitan_8b("eager", 5762, 82.4),
    _torchtitan_8b("fused", 6667, 77.0),
]

KORTHIKANTI = (
    "Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models', tables 3 and 5 "
    "(Megatron-LM on Selene, DGX A100 80GB, 8 x 200 Gb/s InfiniBand per node)"
)


def _megatron(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    pp: int,
    batch: int,
    micro: int,
    virtual: int,
    new: bool,
    step_s: float,
) -> Case:
    """One row of Korthikanti et al.'s table 5: its full-recompute baseline (tensor parallelism without sequence
    parallelism) or its 'present work' (sequence parallelism and selective recompute), on the model and layout
    of its table 3: TP 8, no data parallelism, sequence 2048, Megatron's GPT (vocabulary padded to 51,200, tied
    embeddings, biases, dropout, attention before fused kernels), fp16."""
    world = 8 * pp
    schedule = {"pp_schedule": "interleaved", "virtual_stages": virtual} if virtual > 1 else {}
    return Case(
        name=f"megatron {name} A100x{world} TP8 PP{pp}, {'SP + selective' if new else 'full recompute'}",
        point={
            "model": {
                "base": "gpt3-175b",
                "layers": layers,
                "hidden": hidden,
                "heads": heads,
                "ffn": 4 * hidden,
                "vocab": 51200,
                "dropout": True,
                "flash_attention": False,
                "dtype": "fp16",
            },
            "workload": {"seq_len": 2048, "global_batch": batch, "micro_batch": micro},
            "parallel": {"tp": 8, "pp": pp, "sp": new, "recompute": "selective" if new else "full", **schedule},
            "system": {"base": "dgx-a100", "network": {1: {"npus": pp}}},
        },
        tokens_per_s_per_gpu=batch * 2048 / step_s / world,
        peak_memory_GiB=None,
        source=KORTHIKANTI,
        note=f"iteration time {step_s} s",
    )


HELD_OUT: list[Case] = [
    _megatron(name, layers, hidden, heads, pp, batch, micro, virtual, new, step)
    for name, layers, hidden, heads, pp, batch, micro, virtual, steps in (
        ("22B", 48, 6144, 64, 1, 4, 4, 1, (1.42, 1.10)),
        ("175B", 96, 12288, 96, 8, 64, 1, 3, (18.13, 13.75)),
        ("530B", 105, 20480, 128, 35, 280, 1, 3, (49.05, 37.83)),
        ("1T", 128, 25600, 160, 64, 512, 1, 1, (94.42, 71.49)),
    )
    for new, step in zip((False, True), steps, strict=True)
]
"""Published measurements that set nothing and are not in ../shared/calibration.md: the iteration times against
which Calculon reports its accuracy (3.65% mean, 8.87% max), printed by `dse calibrate` as a held-out check."""


@dataclass(frozen=True)
class CollectiveCase:
    """A measured bus bandwidth (nccl-tests' busbw; a send's bandwidth for "send") over the first `npus` NPUs of a
    system, at a buffer large enough for bandwidth to rule (8 GiB, as the sources measured)."""

    name: str
    system: str | dict[str, Any]
    collective: str
    npus: int
    bus_GBps: float
    sets: str | None
    """The catalog parameter this measurement sets, or None when it checks the model."""


COLLECTIVE_CASES: list[CollectiveCase] = [
    CollectiveCase("8x H100 NVLink4, all-reduce (NVLS)", "dgx-h100", "all_reduce", 8, 480, "reduction_efficiency"),
    CollectiveCase("8x H100 NVLink4, all-gather (ring)", "dgx-h100", "all_gather", 8, 370, "efficiency"),
    CollectiveCase("8x A100 NVLink3, all-reduce (ring)", "dgx-a100", "all_reduce", 8, 230, "efficiency"),
    CollectiveCase("400G NDR InfiniBand, one NIC, send", "dgx-h100", "send", 16, 47, "efficiency"),
    CollectiveCase(
        "2 nodes x 8 A100, 4x200G InfiniBand each, all-reduce",
        {"base": "dgx-a100", "network": {1: {"npus": 2, "bandwidth_GBps": 100 / 8}}},
        "all_reduce",
        16,
        86,
        None,
    ),
]
BUFFER = 8 * 2**30


@dataclass(frozen=True)
class CollectiveRow:
    case: CollectiveCase
    bus_GBps: float

    @property
    def error(self) -> float:
        return self.bus_GBps / self.case.bus_GBps - 1


def run_collectives(
    cost_model: CostModel, cases: list[CollectiveCase] = COLLECTIVE_CASES
) -> list[CollectiveRow] | None:
    """Each case's bus bandwidth as the cost model prices it; None when the model does not price a collective
    alone (it is not a CollectiveCostModel)."""
    if not isinstance(cost_model, CollectiveCostModel):
        return None
    rows = []
    for case in cases:
        system = _network_model(case.system)
        if case.collective == "send":
            bus = BUFFER / cost_model.p2p_time(BUFFER, 0, case.npus - 1, system)
        else:
            kind = Collective(case.collective)
            seconds = cost_model.collective_time(kind, BUFFER, range(case.npus), system)
            bus = bus_factor(kind, case.npus) * BUFFER / seconds
        rows.append(CollectiveRow(case, bus / 1e9))
    return rows


def _network_model(system: str | dict[str, Any]) -> SystemSpec:
    """The system with its collectives priced by the network model's closed forms, not its accelerator's NCCL tables
    (kernel_source: roofline): what the collective cases set and check."""
    expanded = expand({"system": system})["system"]
    expanded["accelerator"]["kernel_source"] = "roofline"
    return SystemSpec.model_validate(expanded)


@dataclass(frozen=True)
class NcclCase:
    """A collective over a catalog node's 8 GPUs, priced by the network model and read from the NCCL tables that
    aiconfigurator-core measured on such a node: the ones the system's accelerator names (kernel_tables)."""

    name: str
    system: str
    collective: str

    @property
    def tables(self) -> tuple[str, NcclTables]:
        """The system folder and NCCL collection of the catalog accelerator."""
        tables = _network_model(self.system).accelerator.kernel_tables
        assert tables is not None and tables.nccl is not None  # the cases name catalog systems that have them
        return tables.system, tables.nccl


NCCL_CASES: list[NcclCase] = [
    NcclCase("8x H100 NVLink4, all-reduce", "dgx-h100", "all_reduce"),
    NcclCase("8x H100 NVLink4, all-gather", "dgx-h100", "all_gather"),
    NcclCase("8x A100 NVLink3, all-reduce", "dgx-a100", "all_reduce"),
    NcclCase("8x A100 NVLink3, all-gather", "dgx-a100", "all_gather"),
]
NCCL_SIZES = (2**20, 2**26, 2**30)
"""1 MiB (latency-bound), 64 MiB (the tables' bandwidth regime) and 1 GiB (beyond their 512 MiB largest)."""


@dataclass(frozen=True)
class NcclRow:
    case: NcclCase
    size: int
    model_GBps: float
    table_GBps: float
    """Bus bandwidths (nccl-tests' busbw) the network model and the tables give the collective at this size."""

    @property
    def error(self) -> float:
        """The model's against the tables'."""
        return self.model_GBps / self.table_GBps - 1


def run_nccl_tables(cost_model: CostModel, cases: list[NcclCase] = NCCL_CASES) -> list[NcclRow] | str | None:
    """Each case at each size, model against tables; None when the cost model does not price a collective alone,
    the one-line reason when the tables cannot be read (aiconfigurator-core is not installed)."""
    if not isinstance(cost_model, CollectiveCostModel):
        return None
    rows = []
    for case in cases:
        system = _network_model(case.system)
        try:
            tables = MeasuredCollectives(*case.tables)
        except SpecError as error:
            return str(error)
        kind = Collective(case.collective)
        for size in NCCL_SIZES:
            model = cost_model.collective_time(kind, size, range(8), system)
            measured = tables.seconds(kind, 8, size)
            assert measured is not None  # every collection has 8-GPU rows of the cases' collectives
            factor = bus_factor(kind, 8) * size / 1e9
            rows.append(NcclRow(case, size, factor / model, factor / measured))
    return rows


@dataclass(frozen=True)
class Row:
    case: Case
    tokens_per_s_per_gpu: float
    peak_memory_GiB: float
    roofline_tokens_per_s_per_gpu: float | None = None
    """The case priced with `kernel_source: roofline` where its accelerator's default is the measured kernel tables
    (None where the roofline is already what priced it): the two side by side."""

    @property
    def throughput_error(self) -> float:
        """Signed relative error of the model's tokens/s per GPU."""
        return self.tokens_per_s_per_gpu / self.case.tokens_per_s_per_gpu - 1

    @property
    def roofline_error(self) -> float | None:
        """Signed relative error of the roofline's tokens/s per GPU, where it is not the model's."""
        if self.roofline_tokens_per_s_per_gpu is None:
            return None
        return self.roofline_tokens_per_s_per_gpu / self.case.tokens_per_s_per_gpu - 1

    @property
    def memory_error(self) -> float | None:
        if self.case.peak_memory_GiB is None:
            return None
        return self.peak_memory_GiB / self.case.peak_memory_GiB - 1


def run(
    generator: WorkloadGenerator, cost_model: CostModel, cases: list[Case] = CASES, beside: bool = True
) -> list[Row]:
    """Each case priced as its accelerator prices by default, and (`beside`) by the roofline beside it where that
    default is the measured kernel tables."""
    rows = []
    for case in cases:
        expanded = expand(case.point)
        point = build_point(expanded, f"calibration case '{case.name}'")
        tokens, peak = _priced(point, generator, cost_model)
        roofline = None
        if beside and point.system.accelerator.reads_tables:
            expanded["system"]["accelerator"]["kernel_source"] = "roofline"
            roofline, _ = _priced(build_point(expanded, f"calibration case '{case.name}'"), generator, cost_model)
        rows.append(Row(case, tokens, peak, roofline))
    return rows


def _priced(point: DesignPoint, generator: WorkloadGenerator, cost_model: CostModel) -> tuple[float, float]:
    """(tokens/s per GPU, peak memory GiB) of one point."""
    evaluation = evaluate(point, generator, cost_model)
    result = evaluation.result
    return evaluation.workload.tokens / result.step_time_s / point.parallel.world, result.peak_memory_bytes / GiB


def errors(rows: list[Row]) -> list[float]:
    """Absolute relative errors of every compared figure (throughput of every case, memory where measured)."""
    out = [abs(row.throughput_error) for row in rows]
    out += [abs(row.memory_error) for row in rows if row.memory_error is not None]
    return out


def main(args: argparse.Namespace, console: Console) -> int:
    generator, cost_model = plugins.generator(args.generator), plugins.cost_model_of(args)
    plugins.preflight(generator, {f"--cost-model {args.cost_model}": cost_model}, [])  # not found case by case
    rows = run(generator, cost_model, CASES)
    held_out = run(generator, cost_model, HELD_OUT)
    collectives = run_collectives(cost_model)
    nccl = run_nccl_tables(cost_model)
    if args.json:
        print(
            json.dumps(
                {
                    "training": [_as_dict(row) for row in rows],
                    "held_out": [_as_dict(row) for row in held_out],
                    "collectives": None if collectives is None else [_collective_dict(row) for row in collectives],
                    "nccl_tables": nccl if nccl is None or isinstance(nccl, str) else [_nccl_dict(r) for r in nccl],
                }
            )
        )
        return 0
    _print_training(rows, "calibration: model vs measured", console)
    _print_training(held_out, "held out (sets nothing): Megatron-LM iteration times", console)
    if collectives is None:
        console.print(
            f"collectives: cost model '{cost_model.name}' does not price a collective alone "
            "(dse.interfaces.CollectiveCostModel), so the nccl-tests cases are left out",
            soft_wrap=True,
        )
    else:
        _print_collectives(collectives, cost_model.name, console)
    if isinstance(nccl, str):
        console.print(f"NCCL tables left out: {nccl}", soft_wrap=True)
    elif nccl is not None:
        _print_nccl(nccl, cost_model.name, console)
    return 0


def _print_training(rows: list[Row], title: str, console: Console) -> None:
    table = Table(title=title)
    columns = ("case", "tokens/s/GPU model", "measured", "error", "roofline", "error", "peak GiB model", "measured")
    for column in (*columns, "error"):
        table.add_column(column, justify="left" if column == "case" else "right", no_wrap=column == "case")
    for row in rows:
        memory, roofline = row.memory_error, row.roofline_error
        table.add_row(
            row.case.name,
            f"{row.tokens_per_s_per_gpu:,.0f}",
            f"{row.case.tokens_per_s_per_gpu:,.0f}",
            f"{100 * row.throughput_error:+.1f}%",
            "-" if row.roofline_tokens_per_s_per_gpu is None else f"{row.roofline_tokens_per_s_per_gpu:,.0f}",
            "-" if roofline is None else f"{100 * roofline:+.1f}%",
            f"{row.peak_memory_GiB:.1f}",
            "-" if row.case.peak_memory_GiB is None else f"{row.case.peak_memory_GiB:.1f}",
            "-" if memory is None else f"{100 * memory:+.1f}%",
        )
    console.print(table)
    figures = errors(rows)
    console.print(
        f"{len(figures)} figures: mean |error| {100 * sum(figures) / len(figures):.1f}%, max {100 * max(figures):.1f}%"
    )
    if compared := [row for row in rows if row.roofline_error is not None]:
        model = [abs(row.throughput_error) for row in compared]
        roofline = [abs(row.roofline_error or 0.0) for row in compared]
        console.print(
            f"on the {len(compared)} case(s) whose accelerator has kernel tables (model: the tables; roofline: "
            f"kernel_source roofline): mean |throughput error| {100 * sum(model) / len(model):.1f}% vs "
            f"{100 * sum(roofline) / len(roofline):.1f}%, max {100 * max(model):.1f}% vs {100 * max(roofline):.1f}%",
            soft_wrap=True,
        )
    for source in sorted({row.case.source for row in rows}):
        console.print(f"source: {source}", soft_wrap=True)


def _print_collectives(rows: list[CollectiveRow], cost_model: str, console: Console) -> None:
    table = Table(title=f"collectives: {cost_model} network model vs nccl-tests bus bandwidth")
    for column in ("case", "GB/s model", "measured", "error", "role"):
        table.add_column(column, justify="left" if column in ("case", "role") else "right", no_wrap=column == "case")
    for row in rows:
        role = f"sets {row.case.sets}" if row.case.sets else "checks the model"
        table.add_row(
            row.case.name, f"{row.bus_GBps:.1f}", f"{row.case.bus_GBps:.0f}", f"{100 * row.error:+.1f}%", role
        )
    console.print(table)
    checks = [abs(row.error) for row in rows if row.case.sets is None]
    console.print(
        f"{len(checks)} checking figure(s): mean |error| {100 * sum(checks) / len(checks):.1f}%, "
        f"max {100 * max(checks):.1f}%; source: {NCCL_TESTS}",
        soft_wrap=True,
    )


def _print_nccl(rows: list[NcclRow], cost_model: str, console: Console) -> None:
    table = Table(title=f"collectives within a node: {cost_model} network model vs {PACKAGE}'s NCCL tables")
    for column in ("case", "size", "GB/s model", "tables", "model vs tables"):
        table.add_column(column, justify="left" if column == "case" else "right", no_wrap=column == "case")
    for row in rows:
        size = f"{row.size // 2**30} GiB" if row.size >= 2**30 else f"{row.size // 2**20} MiB"
        table.add_row(row.case.name, size, f"{row.model_GBps:.1f}", f"{row.table_GBps:.1f}", f"{100 * row.error:+.1f}%")
    console.print(table)
    versions = sorted({_collection(row.case) for row in rows})
    console.print(
        f"bus bandwidth (nccl-tests' busbw); tables: {', '.join(versions)} (measured to 512 MiB; 1 GiB extends their "
        "last doubling)",
        soft_wrap=True,
    )


def _nccl_dict(row: NcclRow) -> dict[str, Any]:
    return {
        "case": row.case.name,
        "bytes": row.size,
        "bus_GBps": row.model_GBps,
        "table_bus_GBps": row.table_GBps,
        "error": row.error,
        "tables": _collection(row.case),
    }


def _collection(case: NcclCase) -> str:
    system, nccl = case.tables
    return f"{system} nccl {nccl.version}"


def _collective_dict(row: CollectiveRow) -> dict[str, Any]:
    return {
        "case": row.case.name,
        "bus_GBps": row.bus_GBps,
        "measured_bus_GBps": row.case.bus_GBps,
        "error": row.error,
        "sets": row.case.sets,
    }


def _as_dict(row: Row) -> dict[str, Any]:
    return {
        "case": row.case.name,
        "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
        "measured_tokens_per_s_per_gpu": row.case.tokens_per_s_per_gpu,
        "throughput_error": row.throughput_error,
        "roofline_tokens_per_s_per_gpu": row.roofline_tokens_per_s_per_gpu,
        "roofline_throughput_error": row.roofline_error,
        "peak_memory_GiB": row.peak_memory_GiB,
        "measured_peak_memory_GiB": row.case.peak_memory_GiB,
        "memory_error": row.memory_error,
    }
