"""No setting of a point file is silently ignored (README: Point files). The schema is walked: every field either
changes what `dse evaluate` reports on a point where it applies, or is a label listed with its reason; and every
rule by which a field cannot apply (dse/spec.py's IGNORED_RULES, the model's and accelerator's validators) refuses
the field set where it cannot. A field added later fails `test_every_field_of_a_point_is_in_the_tables` until it
is placed in one of them."""

import copy
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml
from helpers import make_point
from pydantic import BaseModel

from dse import plugins
from dse.errors import SpecError
from dse.point.evaluate import evaluate
from dse.point.feasibility import infeasibility
from dse.point.points import assign, expand, load_point
from dse.spec import IGNORED_RULES, DesignPoint, ignored_setting, without_ignored_settings

METRICS = ("step_time_s", "peak_memory_bytes", "compute_time_s", "comm_time_s", "exposed_comm_time_s", "mfu")
METRICS += ("tokens_per_s_per_gpu", "overlap_ratio", "fits_memory", "hbm_bytes", "model_flops")
METRICS += ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2e_p99_s", "requests_per_s")
METRICS += ("goodput_requests_per_s", "kv_capacity_tokens", "slo_excess", "preemptions", "max_rate_per_s")
METRICS += ("capital_usd", "cost_per_step_usd", "cost_per_million_tokens_usd", "tokens_per_dollar", "budget_excess_usd")
METRICS += ("facility_power_kW", "energy_per_step_J", "energy_per_token_J", "tokens_per_joule", "power_excess_kW")


def schema_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every field of a pydantic model, nested models included (a list's items at index 0)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(f"{prefix}{name}")
        for inner in _models(field.annotation):
            listed = get_origin(field.annotation) is list or any(
                get_origin(a) is list for a in get_args(field.annotation)
            )
            out += schema_paths(inner, f"{prefix}{name}.0." if listed else f"{prefix}{name}.")
    return out


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models(arg)]


def section(kind: str, ref: Any) -> Any:
    """A catalog entry (or an override of one) expanded, to set a whole section of a point."""
    return expand({kind: ref})[kind]


DGX = {"base": "dgx-h100", "network": {1: {"npus": 1}}}
DGX_NETWORK_MODEL = {**DGX, "accelerator": {"kernel_source": "roofline"}}
"""One node whose all-reduce the network model prices (NVLS), not the H100's NCCL tables."""
ROWS = [[64, 512, 100.0]]
"""An attention kernel table's one row: slower than every H100 row at tiny-llama's sizes (head dim 32, 256 tokens)."""
TABLE = "<a measured table>"
"""Stands for the CSV the test writes (tests/test_ignored_settings.py's `table` fixture)."""

SERVING = {"isl": 64, "osl": 16, "concurrency": 8}
"""tiny-llama serving 8 clients over the test ring's 8 NPUs, one instance each."""


def serving(**fields: Any) -> dict[str, Any]:
    """make_point's arguments for a serving point: SERVING with these fields (None removes one)."""
    section = {name: value for name, value in {**SERVING, **fields}.items() if value is not None}
    if "rate_per_s" in fields or "max_rate" in fields:
        section.pop("concurrency")
    steps = {"workload.mode": "serve", "workload.seq_len": None, "workload.global_batch": None}
    return {"overrides": {**steps, "workload.serving": section}}


SERVE, EVENTS = serving(), serving(depth="events", requests=200)
SPECULATIVE = serving(speculative={"draft_tokens": 1, "acceptance": 0.5})
BUSY = serving(concurrency=64)
KV_BOUND = {
    "overrides": {
        **serving(concurrency=64, scheduler={"max_num_seqs": 64, "max_batched_tokens": 128})["overrides"],
        "system.accelerator.hbm_GiB": 0.564,
    }
}
"""A cache of about 500 tokens an engine (0.9 x 0.564 GiB less the 0.5 GiB runtime reserve and tiny-llama's 7 MB of
weights, at 2 KiB a token): the 8 clients an engine has do not all fit, and how many do depends on the blocks'
rounding."""
TRACE = "<a request trace>"
"""Stands for the CSV the test writes (the `trace` fixture)."""
DISAGGREGATED = {"kind": "disaggregated", "decode": {"dp": 4}}
DISAGG = {**serving(**DISAGGREGATED), "dp": 4}
"""Four prefill and four decode instances of one NPU each."""
BUSY_DISAGG = {**serving(concurrency=64, **DISAGGREGATED), "dp": 4}
KV_BOUND_DISAGG = {
    "overrides": {
        **serving(concurrency=64, scheduler={"max_num_seqs": 64, "max_batched_tokens": 128}, **DISAGGREGATED)[
            "overrides"
        ],
        "system.accelerator.hbm_GiB": 0.564,
    },
    "dp": 4,
}
"""KV_BOUND's cache on both pools' engines."""
NO_LENGTHS = {"workload.serving.isl": None, "workload.serving.osl": None}

# field: (the point where it applies, as make_point's arguments; the fields changed on it, dotted -> value). The
# point is tiny-llama on the 8-NPU test ring (its H100s have attention kernel tables), pure data parallelism,
# unless the arguments say otherwise; a degree or a section changes together with what must change beside it.
ZERO3, TP2, PP2 = {"zero": 3}, {"dp": 4, "tp": 2}, {"dp": 4, "pp": 2}
DRAGONFLY = {"system.network.1.topology": "dragonfly", "system.network.1.group_npus": 1}
DRAGONFLY["system.network.1.global_bandwidth_GBps"] = 5.0
"""The test ring's switch as a dragonfly of one node a group: its global links bound the data-parallel ring."""
MOE, DEEPSEEK, MAMBA = {"model": "tiny-moe"}, {"model": "tiny-deepseek"}, {"model": "tiny-mamba"}
SKEW = {"imbalance": 1.5, "source": "a test's skew"}
EP2, SKEWED = {**MOE, "ep": 2}, {**MOE, "ep": 2, "overrides": {"workload.routing": SKEW}}
KERNEL_TABLES = {
    f"system.accelerator.attention_kernels.{kernel}{part}": (
        {"overrides": {"workload.attention_kernel": kernel}},
        {f"system.accelerator.attention_kernels.{kernel}{part}": value},
    )
    for kernel in ("fa2", "fa3", "cudnn")
    for part, value in (
        ("", {"causal": {"fwd": ROWS}, "noncausal": {"fwd": ROWS, "bwd": ROWS}}),
        (".causal", {"fwd": ROWS}),
        (".causal.fwd", ROWS),
        (".causal.bwd", ROWS),
        (".noncausal", {"fwd": ROWS, "bwd": ROWS}),
        (".noncausal.fwd", ROWS),
        (".noncausal.bwd", ROWS),
    )
}
H100_TABLES = {
    "system": "h100_sxm",
    "framework": "trtllm",
    "version": "1.3.0rc20",
    "peak_tflops": {"bf16": 989.4},
    "hbm_bandwidth_GBps": 3350.0,
}
"""aiconfigurator-core's H100 GEMM tables, as measured (the ring's H100 is that device)."""
B60_VLLM = {"system": "b60", "framework": "vllm", "version": "0.26.0"}
"""A collection with two versions of one framework that both time GEMMs and attention (H100's do not)."""
TABLES = {"overrides": {"system.accelerator.kernel_source": "tables", "system.accelerator.kernel_tables": H100_TABLES}}
MEASURED_GEMMS = {
    "system.accelerator.kernel_source": ({}, {"system.accelerator.kernel_source": "tables", **TABLES["overrides"]}),
    "system.accelerator.kernel_tables": (
        TABLES,
        {"system.accelerator.kernel_tables": {**H100_TABLES, "system": "a100_sxm", "version": "1.0.0"}},
    ),
    "system.accelerator.kernel_tables.system": (TABLES, {"system.accelerator.kernel_tables.system": "h200_sxm"}),
    "system.accelerator.kernel_tables.framework": (
        TABLES,
        {"system.accelerator.kernel_tables.framework": "vllm", "system.accelerator.kernel_tables.version": "0.24.0"},
    ),
    "system.accelerator.kernel_tables.version": (
        {"overrides": {**TABLES["overrides"], "system.accelerator.kernel_tables": {**H100_TABLES, **B60_VLLM}}},
        {"system.accelerator.kernel_tables.version": "0.20.0"},
    ),
    "system.accelerator.kernel_tables.peak_tflops": (
        TABLES,
        {"system.accelerator.kernel_tables.peak_tflops": {"bf16": 10.0}},
    ),
    "system.accelerator.kernel_tables.hbm_bandwidth_GBps": (
        TABLES,
        {"system.accelerator.kernel_tables.hbm_bandwidth_GBps": 1000.0},
    ),
    "system.accelerator.kernel_tables.sustained_share": (
        TABLES,
        {"system.accelerator.kernel_tables.sustained_share": 0.02},  # tiny-llama's GEMMs are bound by HBM
    ),
}
NCCL = {"version": "2.29.2", "bandwidth_GBps": 450.0}
"""aiconfigurator-core's H100 NCCL tables, NVLink4's line rate; they price the TP pairs within the ring's nodes."""


def nccl_tables(nccl: dict[str, Any] | None) -> dict[str, Any]:
    """TP 2 on the H100 tables, with these NCCL tables: fresh dicts, as make_point's overrides assign into them."""
    tables = {**H100_TABLES, **({} if nccl is None else {"nccl": dict(nccl)})}
    return {"overrides": {**TABLES["overrides"], "system.accelerator.kernel_tables": tables}, **TP2}


MEASURED_COLLECTIVES = {
    "system.accelerator.kernel_tables.nccl": (nccl_tables(None), {"system.accelerator.kernel_tables.nccl": NCCL}),
    "system.accelerator.kernel_tables.nccl.version": (
        nccl_tables(NCCL),
        {"system.accelerator.kernel_tables.nccl.version": "2.27.3"},
    ),
    "system.accelerator.kernel_tables.nccl.bandwidth_GBps": (
        nccl_tables(NCCL),
        {"system.accelerator.kernel_tables.nccl.bandwidth_GBps": 900.0},
    ),
}
WIDE_MOE = {"model.hidden": 7168, "model.moe": {"experts": 256, "top_k": 8, "expert_ffn": 256}}
WIDE_EP = {
    "model": "tiny-moe",
    "system": {"base": "dgx-h100", "network": {1: {"npus": 2}}},
    "overrides": {"workload.mode": "decode", **WIDE_MOE},
    "dp": 16,
    "ep": 16,
}
"""tiny-moe at DeepSeek-V3's MoE shape decoding a token a rank over EP 16 on two DGX H100 nodes: the catalog H100's
DeepEP tables price its dispatch and combine."""
ONE_NODE_EP = {**WIDE_EP, "system": DGX, "dp": 8, "ep": 8}
DEEPEP = {"version": "0.5.6.post2", "scale_up_GBps": 450.0, "scale_out_GBps": 50.0}
MEASURED_EXCHANGE = {
    "system.accelerator.kernel_tables.deepep": (
        {**WIDE_EP, "overrides": {**WIDE_EP["overrides"], "system.accelerator.kernel_tables.deepep": None}},
        {"system.accelerator.kernel_tables.deepep": DEEPEP},
    ),
    "system.accelerator.kernel_tables.deepep.version": (
        ONE_NODE_EP,
        {"system.accelerator.kernel_tables.deepep.version": "0.5.12"},  # its rows are one node's
    ),
    "system.accelerator.kernel_tables.deepep.scale_up_GBps": (
        ONE_NODE_EP,  # across nodes the NICs bound the model's all-to-all, whatever NVLink's rate
        {"system.accelerator.kernel_tables.deepep.scale_up_GBps": 900.0},
    ),
    "system.accelerator.kernel_tables.deepep.scale_out_GBps": (
        WIDE_EP,
        {"system.accelerator.kernel_tables.deepep.scale_out_GBps": 100.0},
    ),
}
SRAM = {"name": "sram", "GiB": 0.01, "bandwidth_GBps": 100000.0}
SRAM_TIER = {"overrides": {"system.accelerator.memory_tiers": [SRAM]}}
LINK = {"nic_price_usd": 1.0, "nic_power_W": 1.0, "switch_price_usd": 1.0, "switch_ports": 8, "switch_power_W": 1.0}
SWITCHED = {
    "overrides": {
        "system.network.0.topology": "switch",
        "system.network.0.npus": 8,
        "system.network.1.npus": 1,
        "system.network.0.hardware": {**LINK, "cable_price_usd": 1.0},
    }
}
"""tiny-ring's 8 GPUs on one 8-port switch: each hardware figure is priced (a 4-port switch takes a two-tier tree)."""
ECONOMICS = {
    "economics": ({}, {"economics": {"electricity_usd_per_kWh": 0.1}}),
    "economics.lifetime_years": ({}, {"economics.lifetime_years": 2.0}),
    "economics.utilization": ({}, {"economics.utilization": 0.5}),
    "economics.idle_power_share": ({}, {"economics.idle_power_share": 0.5}),
    "economics.pue": ({}, {"economics.pue": 1.5}),
    "economics.electricity_usd_per_kWh": ({}, {"economics.electricity_usd_per_kWh": 0.1}),
    "economics.budget_usd": ({}, {"economics.budget_usd": 1e5}),
    "economics.power_limit_kW": ({}, {"economics.power_limit_kW": 1.0}),
    "system.accelerator.price_usd": ({}, {"system.accelerator.price_usd": 1000.0}),
    "system.accelerator.tdp_W": ({}, {"system.accelerator.tdp_W": 350.0}),
    "system.network.0.hardware": ({}, {"system.network.0.hardware": {"nic_price_usd": 100.0}}),
    **{
        f"system.network.0.hardware.{name}": (
            SWITCHED,
            {f"system.network.0.hardware.{name}": 4 if "ports" in name else 2.0},
        )
        for name in (*LINK, "cable_price_usd")
    },
}
"""The cost and energy objectives' inputs (objectives/cost.py, objectives/energy.py): each changes a cost or energy
metric (tiny-ring's H100 has a price and a TDP)."""
APPLIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    **ECONOMICS,
    "model": ({}, {"model": section("model", "tiny-gpt")}),
    "model.family": ({"model": "tiny-hybrid"}, {"model.family": "llama", "model.ssm": None}),
    "model.layers": ({}, {"model.layers": 8}),
    "model.hidden": ({}, {"model.hidden": 512}),
    "model.heads": ({}, {"model.heads": 4}),
    "model.kv_heads": ({}, {"model.kv_heads": 8}),
    "model.head_dim": ({}, {"model.head_dim": 64}),
    "model.ffn": ({}, {"model.ffn": 512}),
    "model.moe": ({}, {"model.moe": {"experts": 4, "top_k": 1, "expert_ffn": 128}}),
    "model.moe.experts": (MOE, {"model.moe.experts": 16}),
    "model.moe.top_k": (MOE, {"model.moe.top_k": 1}),
    "model.moe.expert_ffn": (MOE, {"model.moe.expert_ffn": 256}),
    "model.moe.shared_experts": (MOE, {"model.moe.shared_experts": 1}),
    "model.moe.first_dense_layers": (MOE, {"model.moe.first_dense_layers": 1}),
    "model.mla": (
        {},
        {
            "model.kv_heads": None,
            "model.mla": {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
        },
    ),
    "model.mla.kv_lora_rank": (DEEPSEEK, {"model.mla.kv_lora_rank": 32}),
    "model.mla.q_lora_rank": (DEEPSEEK, {"model.mla.q_lora_rank": 64}),
    "model.mla.qk_nope_head_dim": (DEEPSEEK, {"model.mla.qk_nope_head_dim": 16}),
    "model.mla.qk_rope_head_dim": (DEEPSEEK, {"model.mla.qk_rope_head_dim": 32}),
    "model.mla.v_head_dim": (DEEPSEEK, {"model.mla.v_head_dim": 16}),
    "model.ssm": (MAMBA, {"model.ssm": {"state": 32}}),
    "model.ssm.state": (MAMBA, {"model.ssm.state": 32}),
    "model.ssm.conv": (MAMBA, {"model.ssm.conv": 8}),
    "model.ssm.expand": (MAMBA, {"model.ssm.expand": 4}),
    "model.ssm.dt_rank": (MAMBA, {"model.ssm.dt_rank": 32}),
    "model.ssm.attention_every": ({"model": "tiny-hybrid"}, {"model.ssm.attention_every": 2}),
    "model.dropout": ({}, {"model.dropout": True}),
    "model.flash_attention": ({}, {"model.flash_attention": False}),
    "model.rope_impl": ({"overrides": {"workload.kernels": "eager"}}, {"model.rope_impl": "real"}),
    "model.vocab": ({}, {"model.vocab": 2048}),
    "model.norm": ({}, {"model.norm": "layernorm"}),
    "model.activation": ({}, {"model.activation": "gelu"}),
    "model.position": ({}, {"model.position": "learned", "model.max_seq": 512}),
    "model.max_seq": ({"model": "tiny-gpt"}, {"model.max_seq": 2048}),
    "model.tied_embeddings": ({}, {"model.tied_embeddings": True}),
    "model.bias": ({}, {"model.bias": True}),
    "model.qkv_bias": ({}, {"model.qkv_bias": True}),
    "model.norm_bias": ({"model": "tiny-gpt"}, {"model.norm_bias": False}),
    "model.qk_norm": ({}, {"model.qk_norm": True}),
    "model.parallel_block": ({}, {"model.parallel_block": "shared_norm"}),
    "model.dtype": ({}, {"model.dtype": "fp32"}),
    "workload": ({}, {"workload": {"seq_len": 512, "global_batch": 16}}),
    "workload.mode": ({}, {"workload.mode": "prefill"}),
    "workload.seq_len": ({}, {"workload.seq_len": 512}),
    "workload.global_batch": ({}, {"workload.global_batch": 32}),
    "workload.micro_batch": ({}, {"workload.micro_batch": 2}),
    "workload.kernels": ({}, {"workload.kernels": "eager"}),
    "workload.attention_kernel": ({}, {"workload.attention_kernel": "fa3"}),
    "workload.grad_clip": ({}, {"workload.grad_clip": False}),
    "workload.routing": (EP2, {"workload.routing": SKEW}),
    "workload.routing.imbalance": (SKEWED, {"workload.routing.imbalance": 2.0}),
    "workload.serving": (SERVE, {"workload.serving": {**SERVING, "isl": 128}}),
    "workload.serving.isl": (SERVE, {"workload.serving.isl": 128}),
    "workload.serving.osl": (SERVE, {"workload.serving.osl": 32}),
    "workload.serving.concurrency": (SERVE, {"workload.serving.concurrency": 16}),
    "workload.serving.rate_per_s": (serving(rate_per_s=10.0), {"workload.serving.rate_per_s": 20.0}),
    "workload.serving.max_rate": (
        serving(slo={"tpot_p99_s": 0.01}),
        {"workload.serving.concurrency": None, "workload.serving.max_rate": True},
    ),
    "workload.serving.trace": (
        SERVE,
        {"workload.serving.concurrency": None, "workload.serving.trace": TRACE, **NO_LENGTHS},
    ),
    "workload.serving.depth": (SERVE, {"workload.serving.depth": "events", "workload.serving.requests": 200}),
    "workload.serving.requests": (EVENTS, {"workload.serving.requests": 300}),
    "workload.serving.warmup": (EVENTS, {"workload.serving.warmup": 0.2}),
    "workload.serving.seed": (serving(depth="events", requests=200, rate_per_s=50.0), {"workload.serving.seed": 1}),
    "workload.serving.arrival": (
        serving(depth="events", requests=200, rate_per_s=50.0),
        {"workload.serving.arrival": "uniform"},
    ),
    "workload.serving.lengths": (EVENTS, {"workload.serving.lengths": {"distribution": "lognormal", "cv": 1.0}}),
    "workload.serving.lengths.distribution": (
        serving(depth="events", requests=200, lengths={"distribution": "lognormal", "cv": 0.5}),
        {"workload.serving.lengths.distribution": "uniform"},
    ),
    "workload.serving.lengths.cv": (
        serving(depth="events", requests=200, lengths={"distribution": "lognormal", "cv": 0.5}),
        {"workload.serving.lengths.cv": 1.0},
    ),
    "workload.serving.scheduler": (BUSY, {"workload.serving.scheduler": {"max_num_seqs": 2}}),
    "workload.serving.scheduler.max_num_seqs": (BUSY, {"workload.serving.scheduler.max_num_seqs": 2}),
    "workload.serving.scheduler.max_batched_tokens": (
        serving(scheduler={"max_num_seqs": 16}),
        {"workload.serving.scheduler.max_batched_tokens": 16},
    ),
    "workload.serving.scheduler.admission": (KV_BOUND, {"workload.serving.scheduler.admission": "reserve"}),
    "workload.serving.scheduler.chunked_prefill": (BUSY, {"workload.serving.scheduler.chunked_prefill": False}),
    "workload.serving.scheduler.prefill_chunk": (SERVE, {"workload.serving.scheduler.prefill_chunk": 16}),
    "workload.serving.kv_cache": (SERVE, {"workload.serving.kv_cache": {"dtype": "fp8"}}),
    "workload.serving.kv_cache.block_tokens": (KV_BOUND, {"workload.serving.kv_cache.block_tokens": 64}),
    "workload.serving.kv_cache.memory_fraction": (SERVE, {"workload.serving.kv_cache.memory_fraction": 0.5}),
    "workload.serving.kv_cache.dtype": (SERVE, {"workload.serving.kv_cache.dtype": "fp8"}),
    "workload.serving.speculative": (SERVE, {"workload.serving.speculative": {"draft_tokens": 1, "acceptance": 0.5}}),
    "workload.serving.speculative.draft_tokens": (SPECULATIVE, {"workload.serving.speculative.draft_tokens": 2}),
    "workload.serving.speculative.acceptance": (SPECULATIVE, {"workload.serving.speculative.acceptance": 0.9}),
    "workload.serving.slo": (SERVE, {"workload.serving.slo": {"ttft_p99_s": 1e-6}}),
    "workload.serving.kind": (
        SERVE,
        {"workload.serving.kind": "disaggregated", "workload.serving.decode": {"dp": 4}, "parallel.dp": 4},
    ),
    "workload.serving.kv_transfer": (DISAGG, {"workload.serving.kv_transfer": "layers"}),
    "workload.serving.decode": (DISAGG, {"workload.serving.decode": {"dp": 2, "tp": 2}}),
    "workload.serving.decode.dp": (DISAGG, {"workload.serving.decode.dp": 2, "parallel.dp": 6}),
    "workload.serving.decode.tp": (DISAGG, {"workload.serving.decode.tp": 2, "workload.serving.decode.dp": 2}),
    "workload.serving.decode.pp": (DISAGG, {"workload.serving.decode.pp": 2, "workload.serving.decode.dp": 2}),
    "workload.serving.decode.ep": (DISAGG | MOE, {"workload.serving.decode.ep": 2}),
    "workload.serving.decode.max_num_seqs": (BUSY_DISAGG, {"workload.serving.decode.max_num_seqs": 2}),
    "workload.serving.decode.admission": (KV_BOUND_DISAGG, {"workload.serving.decode.admission": "reserve"}),
    "parallel": ({}, {"parallel": {"dp": 4, "tp": 2}}),
    "parallel.dp": ({}, {"parallel.dp": 4, "system.network.1.npus": 1}),
    "parallel.tp": ({}, {"parallel.tp": 2, "parallel.dp": 4}),
    "parallel.pp": ({}, {"parallel.pp": 2, "parallel.dp": 4}),
    "parallel.cp": ({}, {"parallel.cp": 2, "parallel.dp": 4}),
    "parallel.sp": (TP2, {"parallel.sp": True}),
    "parallel.zero": ({}, {"parallel.zero": 1}),
    "parallel.fsdp": (ZERO3, {"parallel.fsdp": "fsdp1"}),
    "parallel.fsdp_reduce_dtype": (ZERO3, {"parallel.fsdp_reduce_dtype": "fp32"}),
    "parallel.reshard_after_forward": (ZERO3, {"parallel.reshard_after_forward": False}),
    "parallel.grad_reduce": ({"zero": 2}, {"parallel.grad_reduce": "per_step"}),
    "parallel.dp_shard": (ZERO3, {"parallel.dp_shard": 4}),
    "parallel.grad_bucket_mb": ({}, {"parallel.grad_bucket_mb": 1}),
    "parallel.fsdp_prefetch": (ZERO3, {"parallel.fsdp_prefetch": 2}),
    "parallel.pp_schedule": ({"dp": 2, "pp": 4}, {"parallel.pp_schedule": "gpipe"}),
    "parallel.recompute": ({}, {"parallel.recompute": "full"}),
    "parallel.ep": (MOE, {"parallel.ep": 2}),
    "parallel.virtual_stages": (PP2 | {"pp_schedule": "interleaved"}, {"parallel.virtual_stages": 2}),
    "parallel.microbatch_group": (
        {"dp": 2, "pp": 2, "tp": 2, "pp_schedule": "interleaved", "virtual_stages": 2},
        {"parallel.microbatch_group": 4},
    ),
    "parallel.cp_algorithm": ({"dp": 4, "cp": 2}, {"parallel.cp_algorithm": "ring"}),
    "parallel.layer_strategies": (TP2 | {"micro_batch": 2}, {"parallel.layer_strategies": ["tp", "dp"]}),
    "parallel.recompute_every": ({"recompute": "full"}, {"parallel.recompute_every": 2}),
    "parallel.overlap_grad_reduce": ({}, {"parallel.overlap_grad_reduce": False}),
    "parallel.overlap_param_gather": ({"zero": 1}, {"parallel.overlap_param_gather": True}),
    "parallel.tp_comm_overlap": (TP2 | {"sp": True}, {"parallel.tp_comm_overlap": True}),
    "parallel.overlap_p2p_comm": (PP2, {"parallel.overlap_p2p_comm": False}),
    "parallel.first_stage_layers": (PP2, {"parallel.first_stage_layers": 1}),
    "parallel.last_stage_layers": (PP2, {"parallel.last_stage_layers": 1}),
    "system": ({}, {"system": section("system", DGX)}),
    "system.accelerator": ({}, {"system.accelerator": section("system", {"base": "dgx-h200"})["accelerator"]}),
    "system.accelerator.peak_tflops": ({}, {"system.accelerator.peak_tflops": {"bf16": 800.0}}),
    "system.accelerator.hbm_GiB": ({}, {"system.accelerator.hbm_GiB": 0.5}),
    "system.accelerator.hbm_bandwidth_GBps": ({}, {"system.accelerator.hbm_bandwidth_GBps": 1000.0}),
    "system.accelerator.compute_efficiency": (
        {},
        {"system.accelerator.compute_efficiency": dict.fromkeys(("gemm", "attention", "elementwise"), 0.3)}
        | {"system.accelerator.compute_efficiency.norm": 0.3, "system.accelerator.compute_efficiency.embedding": 0.3}
        | {"system.accelerator.compute_efficiency.optimizer": 0.3, "system.accelerator.compute_efficiency.other": 0.3},
    ),
    "system.accelerator.memory_efficiency": ({}, {"system.accelerator.memory_efficiency": 0.5}),
    "system.accelerator.kernel_launch_us": ({}, {"system.accelerator.kernel_launch_us": 10.0}),
    "system.accelerator.gemm_half_efficiency_gflop": (
        {"overrides": {"system.accelerator.sm_count": None}},
        {"system.accelerator.gemm_half_efficiency_gflop": 10.0},
    ),
    "system.accelerator.sm_count": ({}, {"system.accelerator.sm_count": 100}),
    "system.accelerator.gemm_tile": ({}, {"system.accelerator.gemm_tile": [128, 128]}),
    "system.accelerator.overlap_slowdown": ({}, {"system.accelerator.overlap_slowdown": 0.5}),
    "system.accelerator.runtime_reserve_GiB": ({}, {"system.accelerator.runtime_reserve_GiB": 2.0}),
    "system.accelerator.fragmentation": ({}, {"system.accelerator.fragmentation": 0.5}),
    "system.accelerator.measured_table": ({}, {"system.accelerator.measured_table": TABLE}),
    "system.accelerator.attention_kernels": ({}, {"system.accelerator.attention_kernels": None}),
    "system.accelerator.attention_kernels.measured_peak_tflops": (
        {},
        {"system.accelerator.attention_kernels.measured_peak_tflops": 1978.8},
    ),
    **KERNEL_TABLES,
    **MEASURED_GEMMS,
    **MEASURED_COLLECTIVES,
    **MEASURED_EXCHANGE,
    "system.accelerator.clock_share": ({}, {"system.accelerator.clock_share": 0.5}),
    # A tier faster than HBM holds a share of tiny-llama's working set, which speeds its memory-bound ops.
    "system.accelerator.memory_tiers": ({}, {"system.accelerator.memory_tiers": [SRAM]}),
    "system.accelerator.memory_tiers.0.GiB": (SRAM_TIER, {"system.accelerator.memory_tiers.0.GiB": 0.1}),
    "system.accelerator.memory_tiers.0.bandwidth_GBps": (
        SRAM_TIER,
        {"system.accelerator.memory_tiers.0.bandwidth_GBps": 200000.0},
    ),
    "system.network": (
        {},
        {"system.network": [{"topology": "ring", "npus": 8, "bandwidth_GBps": 100.0, "latency_ns": 1000.0}]},
    ),
    "system.network.0.topology": ({}, {"system.network.0.topology": "fully_connected"}),
    "system.network.0.npus": ({}, {"system.network.0.npus": 2, "system.network.1.npus": 4}),
    "system.network.0.bandwidth_GBps": ({}, {"system.network.0.bandwidth_GBps": 10.0}),
    "system.network.0.latency_ns": ({}, {"system.network.0.latency_ns": 1e5}),
    "system.network.0.efficiency": ({}, {"system.network.0.efficiency": 0.5}),
    "system.network.0.algorithm": ({}, {"system.network.0.algorithm": "direct"}),
    "system.network.0.shape": (
        {"overrides": {"system.network.0.topology": "torus2d"}},
        {"system.network.0.shape": [4, 1]},
    ),
    "system.network.0.collectives": ({}, {"system.network.1.collectives": "hierarchical"}),
    "system.network.0.reduction_efficiency": (
        {"system": DGX_NETWORK_MODEL, "overrides": {"system.network.0.reduction_latency_ns": 0.0}},
        {"system.network.0.reduction_efficiency": 1.0},
    ),
    "system.network.0.reduction_latency_ns": (
        {"system": DGX_NETWORK_MODEL},
        {"system.network.0.reduction_latency_ns": 0.0},
    ),
    "system.network.0.leaf_npus": (
        {"overrides": {"system.network.1.leaf_npus": 2, "system.network.1.oversubscription": 4.0}},
        {"system.network.1.leaf_npus": 1},
    ),
    "system.network.0.oversubscription": (
        {"overrides": {"system.network.1.leaf_npus": 1, "system.network.1.oversubscription": 2.0}},
        {"system.network.1.oversubscription": 4.0},
    ),
    "system.network.0.group_npus": ({"overrides": DRAGONFLY}, {"system.network.1.group_npus": 2}),
    "system.network.0.global_bandwidth_GBps": (
        {"overrides": DRAGONFLY},
        {"system.network.1.global_bandwidth_GBps": 1.0},
    ),
    "system.network.0.rails": (
        {**MOE, "ep": 8, "overrides": {"system.network.0.bandwidth_GBps": 10.0}},
        {"system.network.1.rails": True},
    ),
}
LABELS = {
    "model.name": "a model's name, shown in tables, plots and MLflow",
    "system.name": "a system's name, shown in tables, plots and MLflow",
    "system.accelerator.name": "an accelerator's name, shown in tables and messages",
    "system.accelerator.sources": "where the catalog entry's figures come from",
    "system.accelerator.memory_tiers.0.name": "a memory tier's name, for the reader and messages",
    "system.network.0.hardware.sources": "where the network hardware's prices and powers come from",
    "workload.routing.source": "where the routing imbalance comes from, for the reader",
}
LABELLED = {"workload.routing.source": SKEWED, "system.accelerator.memory_tiers.0.name": SRAM_TIER}
"""The point a label is changed on where it needs one beside it (a source needs its imbalance); else tiny-llama."""
FX_ONLY = {
    "model.fx_factory": ({"model.fx_factory": "fx_tiny_llama:llama"}, {"model.fx_factory": "fx_tiny_llama:softcapped"}),
    # tests/test_fx_plans.py: a user's plan leaving the MLP unsharded at tp 2 halves the layer's all-reduces
    "model.fx_plan": ({"model.fx_factory": "fx_zoo_dense:gpt2"}, {"model.fx_plan": {"*.mlp.*": "replicate"}}),
}
"""Read by the fx generator alone, which captures the named PyTorch code (one evaluation each: torch is slow)."""


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A measured kernel table that prices tiny-llama's GEMMs slower than the roofline does (1 TFLOP/s)."""
    path = tmp_path_factory.mktemp("table") / "kernels.csv"
    path.write_text("category,dtype,flops,bytes,time_us\ngemm,bf16,1e3,0,0.001\ngemm,bf16,1e12,0,1e6\n")
    return str(path)


def _placed(value: Any, table: str) -> Any:
    """A change's value with the placeholders for files replaced by the files the fixtures wrote."""
    return table if value == TABLE else TRACE_FILE if value == TRACE else value


TRACE_FILE = str(Path(__file__).parent / "serving_trace.csv")


def build(arguments: dict[str, Any], changes: dict[str, Any] | None = None, table: str = "") -> DesignPoint:
    """make_point's point with the arguments (data parallelism over the 8 NPUs unless they give a layout) and the
    changes applied after the arguments' own overrides."""
    arguments = copy.deepcopy(arguments)  # its sections are the module's, which assigning into them would change
    overrides = dict(arguments.pop("overrides", {}))
    overrides |= {path: _placed(copy.deepcopy(value), table) for path, value in (changes or {}).items()}
    layout = {name: arguments.pop(name) for name in list(arguments) if name not in ("model", "system", "micro_batch")}
    if not {"dp", "tp", "pp", "cp"} & set(layout):
        layout["dp"] = 8
    return make_point(global_batch=16, overrides=overrides, **arguments, **layout)


def metrics(point: DesignPoint, generator: str = "symbolic") -> dict[str, Any]:
    """The figures `dse evaluate` reports for a point a point file may hold."""
    assert ignored_setting(point) is None and infeasibility(point) is None, (
        ignored_setting(point),
        infeasibility(point),
    )
    return evaluate_anyway(point, generator)


def test_every_field_of_a_point_is_in_the_tables():
    covered = set(APPLIES) | set(LABELS) | set(FX_ONLY)
    paths = set(schema_paths(DesignPoint))
    assert len(paths) == 216
    assert paths - covered == set(), "a field neither changes a figure in APPLIES nor is a label in LABELS"
    assert covered - paths == set()


@pytest.mark.parametrize("field", sorted(APPLIES))
def test_a_field_changes_the_priced_result_where_it_applies(field, table):
    arguments, changes = APPLIES[field]
    before, after = metrics(build(arguments, table=table)), metrics(build(arguments, changes, table))
    assert before != after, f"{field}: {changes} changes no figure"


@pytest.mark.parametrize("field", sorted(LABELS))
def test_a_label_changes_no_figure(field):
    value = ["a source"] if field.endswith("sources") else "another name"
    arguments = LABELLED.get(field, {})
    assert metrics(build(arguments)) == metrics(build(arguments, {field: value}))


def test_the_fx_factory_changes_what_the_fx_generator_captures():
    pytest.importorskip("torch")
    before, after = (metrics(build({}, changes), "fx") for changes in FX_ONLY["model.fx_factory"])
    assert before["step_time_s"] != after["step_time_s"]


# Where a field cannot apply: (point arguments, the field set there, a fragment of the one-line refusal). Every rule
# of IGNORED_RULES has a case named "field without partner"; the model's and accelerator's own rules follow.
PREFILL, DECODE = ({"overrides": {"workload.mode": mode}} for mode in ("prefill", "decode"))
NOT_APPLICABLE: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "parallel.fsdp without parallel.zero": ({}, {"parallel.fsdp": "fsdp1"}, "parallel.zero: 3"),
    "parallel.fsdp_reduce_dtype without parallel.zero": ({}, {"parallel.fsdp_reduce_dtype": "fp32"}, "zero: 3"),
    "parallel.reshard_after_forward without parallel.zero": ({}, {"parallel.reshard_after_forward": False}, "3"),
    "parallel.grad_reduce without parallel.zero": ({"zero": 1}, {"parallel.grad_reduce": "per_step"}, "2 or 3"),
    "parallel.dp_shard without parallel.zero": ({}, {"parallel.dp_shard": 4}, "parallel.zero 1, 2 or 3"),
    "parallel.cp_algorithm without parallel.cp": ({}, {"parallel.cp_algorithm": "ring"}, "parallel.cp above 1"),
    "parallel.recompute_every without parallel.recompute": ({}, {"parallel.recompute_every": 2}, "other than none"),
    "parallel.overlap_grad_reduce without parallel.zero": (ZERO3, {"parallel.overlap_grad_reduce": False}, "0, 1"),
    "parallel.grad_bucket_mb without parallel.zero": (ZERO3, {"parallel.grad_bucket_mb": 1}, "parallel.zero 0, 1"),
    "parallel.grad_bucket_mb without workload.mode": (PREFILL, {"parallel.grad_bucket_mb": 1}, "mode: train"),
    "parallel.fsdp_prefetch without parallel.zero": ({}, {"parallel.fsdp_prefetch": 2}, "parallel.zero: 3"),
    "parallel.fsdp_prefetch without workload.mode": (
        {"zero": 3, **PREFILL},  # as infeasible (ZeRO is for training), but refused first as ignored
        {"parallel.fsdp_prefetch": 2},
        "workload.mode: train",
    ),
    "parallel.overlap_param_gather without parallel.zero": ({}, {"parallel.overlap_param_gather": True}, "1 or 2"),
    "parallel.tp_comm_overlap without parallel.sp": (TP2, {"parallel.tp_comm_overlap": True}, "parallel.sp: true"),
    "parallel.overlap_p2p_comm without parallel.pp": ({}, {"parallel.overlap_p2p_comm": False}, "pp above 1"),
    "model.rope_impl without model.position": (
        {"model": "tiny-gpt", "overrides": {"workload.kernels": "eager"}},
        {"model.rope_impl": "real"},
        "model.position: rope",
    ),
    "workload.grad_clip without workload.mode": (PREFILL, {"workload.grad_clip": False}, "workload.mode: train"),
    "workload.serving.decode without workload.serving.kind": (
        SERVE,
        {"workload.serving.decode": {"dp": 4}},
        "workload.serving.kind: disaggregated",
    ),
    "workload.serving.kv_transfer without workload.serving.kind": (
        SERVE,
        {"workload.serving.kv_transfer": "layers"},
        "workload.serving.kind: disaggregated",
    ),
    "workload.attention_kernel without model.flash_attention": (
        {"overrides": {"model.flash_attention": False}},
        {"workload.attention_kernel": "fa3"},
        "model.flash_attention: true",
    ),
    "workload.attention_kernel without model.family": (
        MAMBA,
        {"workload.attention_kernel": "fa2"},
        "a model.family with attention layers (not mamba), and model.family is 'mamba'",
    ),
    "model.rope_impl without workload.kernels": ({}, {"model.rope_impl": "real"}, "workload.kernels: eager"),
    "model.dropout without workload.mode": (PREFILL, {"model.dropout": True}, "workload.mode: train"),
    "parallel.recompute without workload.mode": (DECODE, {"parallel.recompute": "full"}, "workload.mode: train"),
    "parallel.overlap_grad_reduce without workload.mode": (
        PREFILL,
        {"parallel.overlap_grad_reduce": False},
        "workload.mode: train",
    ),
    "parallel.tp_comm_overlap without workload.mode": (
        {"dp": 4, "tp": 2, "sp": True, **PREFILL},
        {"parallel.tp_comm_overlap": True},
        "workload.mode: train",
    ),
    "parallel.sp without parallel.tp": ({}, {"parallel.sp": True}, "parallel.tp above 1, and parallel.tp is 1"),
    "parallel.layer_strategies without parallel.tp": (
        {},
        {"parallel.layer_strategies": ["dp"]},
        "parallel.tp above 1, and parallel.tp is 1",
    ),
    "parallel.recompute_every without model.layers": (
        {"recompute": "full"},
        {"parallel.recompute_every": 5},
        "5 is beyond model.layers=4: the layers it recomputes are 4, 9, ..., and the model has 4",
    ),
    **{
        f"model.{name} without model.family": (MAMBA, {f"model.{name}": value}, "model.family is 'mamba'; remove")
        for name, value in (
            ("heads", 8),
            ("kv_heads", 1),
            ("head_dim", 64),
            ("ffn", 512),
            ("moe", {"experts": 4, "top_k": 1, "expert_ffn": 128}),
            ("mla", {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}),
            ("bias", True),
            ("flash_attention", False),
            ("rope_impl", "real"),
            ("qkv_bias", True),
            ("qk_norm", True),
        )
    },
    **{
        f"model.{name} without model.mla": (
            DEEPSEEK,
            {f"model.{name}": True},
            f"is set; remove model.{name} or remove model.mla",
        )
        for name in ("qkv_bias", "qk_norm")
    },
    "model.qkv_bias without model.bias": ({"model": "tiny-gpt"}, {"model.qkv_bias": True}, "model.bias: false"),
    "model.norm_bias without model.norm": ({}, {"model.norm_bias": False}, "model.norm: layernorm"),
    **{
        f"model.{name} without model.mla": (DEEPSEEK, {f"model.{name}": 8}, "model.mla is set; remove")
        for name in ("kv_heads", "head_dim")
    },
    "model.max_seq without model.position": ({}, {"model.max_seq": 4096}, "model.position is 'rope'"),
    "workload.routing without model.moe": ({}, {"workload.routing": SKEW}, "a model.moe section, and model.moe"),
    "workload.routing without parallel.ep": (MOE, {"workload.routing": SKEW}, "parallel.ep above 1"),
    "system.accelerator.gemm_tile without sm_count": (
        {"overrides": {"system.accelerator.sm_count": None}},
        {"system.accelerator.gemm_tile": [128, 128]},
        "gemm_tile would be ignored",
    ),
}


def test_every_rule_has_a_case_where_its_field_cannot_apply():
    named = {f"{rule.field} without {rule.partner}" for rule in IGNORED_RULES}
    assert named - set(NOT_APPLICABLE) == set()


@pytest.mark.parametrize("case", sorted(NOT_APPLICABLE))
def test_a_setting_that_cannot_apply_is_refused(tmp_path, case):
    arguments, changes, fragment = NOT_APPLICABLE[case]
    field = next(iter(changes))
    path = tmp_path / "point.yaml"
    point = build(arguments)
    assert ignored_setting(point) is None
    raw = point.model_dump(mode="json", exclude_none=True)
    for dotted, value in changes.items():
        assign(raw, dotted, value)
    with pytest.raises(SpecError) as refused:
        load_point(_written(path, raw))
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and field.split(".")[-1] in message and fragment in message, message
    assert "\n" not in message


def _written(path, raw: dict[str, Any]):
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "changes",
    [
        {"recompute": "full", "recompute_every": 5},
        {"recompute": "selective", "recompute_every": 8, "sp": True},
        {"overrides": {"workload.mode": "prefill", "model.dropout": True}, "recompute": "full"},
    ],
    ids=[
        "recompute-every-beyond-the-layers",
        "sp-without-tp-and-recompute-every-beyond",
        "training-settings-in-prefill",
    ],
)
def test_a_point_without_its_ignored_settings_is_the_same_step_under_its_own_key(changes):
    """What a study writes as a best point (`without_ignored_settings`): the same figures, no ignored setting, and
    the key of that point built afresh (not the key of the point it was made from)."""
    point = build(changes)
    assert ignored_setting(point) is not None
    cleaned = without_ignored_settings(point)
    assert ignored_setting(cleaned) is None
    assert metrics(cleaned) == evaluate_anyway(point)
    assert cleaned.key == DesignPoint.model_validate(cleaned.model_dump()).key != point.key


def evaluate_anyway(point: DesignPoint, generator: str = "symbolic") -> dict[str, Any]:
    """The figures of a point whatever it sets (a study's trial runs its point as decoded)."""
    result = evaluate(point, plugins.generator(generator), plugins.cost_model("analytical")).metrics
    return {name: result.get(name) for name in METRICS}
