"""Rules that make a well-formed design point runnable, checked before any generation is spent on it.

The tool's limits over several fields come first (dse/limits.py): they bound the work the other rules and the
evaluation do.
"""

from dse.errors import InfeasibleError
from dse.kernels import TABLE_DTYPES, attention_table
from dse.limits import MAX_LAYER_PASSES, MAX_PARAMETERS, MAX_PIPELINE_CHUNKS
from dse.modelstats import layer_kinds, param_count, ssm_inner
from dse.routing import busiest_rank_share
from dse.serving.steps import decode_point, step_point
from dse.spec import DesignPoint


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def exceeded_limit(point: DesignPoint) -> str | None:
    """The first of the tool's limits over several fields that the point exceeds, or None."""
    m, w, p = point.model, point.workload, point.parallel
    if (params := param_count(m)) > MAX_PARAMETERS:
        return (
            f"model '{m.name}' has {params:.3g} parameters, over the limit of {MAX_PARAMETERS:.0e} (README: Limits); "
            "lower model.layers or its widths (hidden, ffn, vocab, moe.experts)"
        )
    chunks = p.pp * {"interleaved": p.virtual_stages, "dualpipev": 2}.get(p.pp_schedule, 1)
    per_rank = "2" if p.pp_schedule == "dualpipev" else "virtual_stages"  # DualPipeV's two chunks per rank
    if chunks > MAX_PIPELINE_CHUNKS:
        return (
            f"parallel.pp*{per_rank} = {chunks} pipeline chunks is over the limit of {MAX_PIPELINE_CHUNKS} "
            "(README: Limits); lower parallel.pp or parallel.virtual_stages"
        )
    micro_batches = w.global_batch // (p.dp * w.micro_batch)
    if micro_batches * m.layers > MAX_LAYER_PASSES:
        return (
            f"{micro_batches} micro-batches per step (workload.global_batch / (parallel.dp * workload.micro_batch)) "
            f"x model.layers={m.layers} = {micro_batches * m.layers:,} layer passes is over the limit of "
            f"{MAX_LAYER_PASSES:,} (README: Limits); raise workload.micro_batch or parallel.dp, or lower "
            "workload.global_batch"
        )
    return None


def infeasibility(point: DesignPoint) -> str | None:
    """The first reason the point cannot run, or None. Each reason names the fields and what would fit. A serving
    point runs if its instances' steps do (its KV cache and its load are the serving model's to judge)."""
    if point.workload.mode == "serve":
        return _serving_infeasibility(point)
    if (limit := exceeded_limit(point)) is not None:
        return limit
    m, w, p, s = point.model, point.workload, point.parallel, point.system
    if m.dtype not in s.accelerator.peak_tflops:
        return (
            f"model.dtype={m.dtype} but accelerator '{s.accelerator.name}' has no peak_tflops.{m.dtype}; use a dtype "
            f"in {{{', '.join(s.accelerator.peak_tflops)}}} or add its peak to system.accelerator.peak_tflops"
        )
    if (mismatch := _world_mismatch(point)) is not None:
        return mismatch
    if m.moe is not None and (skew := busiest_rank_share(w.routing.imbalance, p.ep)) is not None:
        return skew
    mixers = {mixer for mixer, _ in layer_kinds(m)}
    attention = bool(mixers & {"attn", "mla"})
    if attention and (missing := _missing_attention_kernel(point)) is not None:
        return missing
    if attention and m.heads % p.tp:
        return f"parallel.tp={p.tp} does not divide model.heads={m.heads}; use tp in {{{_divisors(m.heads)}}}"
    if "attn" in mixers and m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
        return (
            f"parallel.tp={p.tp} and model.kv_heads={m.n_kv_heads} must divide one another "
            f"(kv heads are split or replicated across TP)"
        )
    if "ssm" in mixers and ssm_inner(m) % p.tp:
        return f"parallel.tp={p.tp} does not divide the SSM inner width {ssm_inner(m)} (ssm.expand * model.hidden)"
    if m.family != "mamba" and m.ffn % p.tp:
        return f"parallel.tp={p.tp} does not divide model.ffn={m.ffn}"
    if m.moe and m.moe.expert_ffn % p.tp:
        return f"parallel.tp={p.tp} does not divide model.moe.expert_ffn={m.moe.expert_ffn}"
    if p.ep > 1:
        if m.moe is None:
            return f"parallel.ep={p.ep} needs a mixture-of-experts model (model.moe); use ep 1"
        if m.moe.experts % p.ep:
            return f"parallel.ep={p.ep} does not divide model.moe.experts={m.moe.experts}"
        if p.dp % p.ep:
            return f"parallel.ep={p.ep} does not divide parallel.dp={p.dp} (expert parallelism is carved from dp)"
    chunks = p.virtual_stages if p.pp_schedule == "interleaved" else 1
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved":
        return f"parallel.virtual_stages={p.virtual_stages} needs parallel.pp_schedule: interleaved"
    if p.pp_schedule == "dualpipev" and (problem := _dualpipev(point)) is not None:
        return problem
    if p.first_stage_layers is None and p.last_stage_layers is None:
        if m.layers % p.pp:
            return (
                f"parallel.pp={p.pp} does not divide model.layers={m.layers}; use pp in {{{_divisors(m.layers)}}}, "
                "or set parallel.first_stage_layers / last_stage_layers"
            )
        if m.layers % (p.pp * chunks):
            return (
                f"parallel.pp*virtual_stages = {p.pp * chunks} does not divide model.layers={m.layers}; "
                f"use a divisor of {m.layers}"
            )
    elif (problem := _uneven_stages(point, chunks)) is not None:
        return problem
    if w.global_batch % (p.dp * w.micro_batch):
        return (
            f"workload.global_batch={w.global_batch} is not a multiple of parallel.dp*workload.micro_batch = "
            f"{p.dp}*{w.micro_batch}"
        )
    if p.microbatch_group is not None and (chunks == 1 or w.mode != "train"):
        return (
            f"parallel.microbatch_group={p.microbatch_group} applies to interleaved 1F1B (pp_schedule interleaved, "
            "virtual_stages >= 2, training); remove it"
        )
    if chunks > 1 and w.mode == "train" and (problem := _microbatch_groups(point)) is not None:
        return problem
    if p.sp and w.mode != "decode" and w.seq_len % p.tp:
        return f"workload.seq_len={w.seq_len} is not a multiple of parallel.tp={p.tp} (sequence parallelism)"
    if w.seq_len % p.cp:
        return f"workload.seq_len={w.seq_len} is not a multiple of parallel.cp={p.cp}"
    if "dp" in p.layer_strategies and p.tp > 1:
        if w.mode != "train":
            return f"parallel.layer_strategies 'dp' applies to training only; use all 'tp' with workload.mode={w.mode}"
        if w.micro_batch % p.tp:
            return (
                f"workload.micro_batch={w.micro_batch} is not a multiple of parallel.tp={p.tp}: 'dp' layers in "
                "parallel.layer_strategies split the micro-batch over the tp ranks"
            )
    if p.cp_algorithm == "ring" and p.cp > 1 and w.seq_len % (2 * p.cp):
        return f"workload.seq_len={w.seq_len} is not a multiple of 2*parallel.cp={2 * p.cp} (ring CP's zigzag chunks)"
    if w.mode == "decode" and (p.cp > 1 or p.sp):
        return "workload.mode=decode generates one token per sequence: use parallel.cp 1 and sp false"
    if w.mode != "train" and p.zero:
        return f"parallel.zero={p.zero} applies to training only; use zero 0 with workload.mode={w.mode}"
    if w.mode != "train" and p.pp_schedule == "zb_h1":
        return (
            "parallel.pp_schedule=zb_h1 is a training schedule (it defers weight gradients); use pp_schedule 1f1b "
            f"or gpipe with workload.mode={w.mode}"
        )
    if p.pp_schedule == "zb_h1" and p.zero == 3:
        return (
            "parallel.pp_schedule=zb_h1 with parallel.zero=3 is not modelled: FSDP's held weights and per-step "
            "reduce-scatters do not yet compose with deferred weight gradients; use pp_schedule 1f1b or interleaved, "
            "or zero 1 or 2"
        )
    if w.mode != "train" and chunks > 1:
        return (
            f"parallel.pp_schedule=interleaved with virtual_stages={chunks} is a training schedule (interleaved "
            f"1F1B); use pp_schedule 1f1b or gpipe with workload.mode={w.mode}"
        )
    if (problem := _sharding_groups(point)) is not None:
        return problem
    if p.cp > 1 and p.cp_algorithm == "ring" and p.recompute in ("full", "selective_op") and w.mode == "train":
        # Its recomputed attention's K/V sends and receives do not pair up: the simulated step deadlocks (a bug
        # of the symbolic generator, found by tests/test_bad_input.py). Refused, with a way out, until fixed.
        return (
            f"parallel.cp_algorithm=ring with parallel.recompute={p.recompute} is not supported yet; use "
            "cp_algorithm allgather, or recompute selective or none"
        )
    if not p.overlap_p2p_comm and p.pp_schedule == "interleaved":
        # Blocking p2p needs Megatron's batched exchange of both directions at once, which the interleaved
        # schedule's steps do not post (the step deadlocks); Megatron itself overlaps p2p for it by default.
        return (
            "parallel.overlap_p2p_comm=false with parallel.pp_schedule=interleaved is not supported yet; use "
            "overlap_p2p_comm true (Megatron's default for interleaved schedules), or pp_schedule 1f1b or gpipe"
        )
    return None


def _missing_attention_kernel(point: DesignPoint) -> str | None:
    """Why the point's workload.attention_kernel cannot be priced on its accelerator, or None (auto falls back to
    the flat compute_efficiency.attention; unfused attention runs no fused kernel)."""
    kernel, accelerator, dtype = point.workload.attention_kernel, point.system.accelerator, point.model.dtype
    if kernel == "auto" or not point.model.flash_attention:
        return None
    if dtype not in TABLE_DTYPES:
        return (
            f"workload.attention_kernel={kernel} is priced from its BF16/FP16 benchmark, not model.dtype={dtype}; "
            "use attention_kernel auto (the flat compute_efficiency.attention) or a bf16 model"
        )
    if attention_table(accelerator, kernel, dtype) is None:
        hopper = ": FlashAttention-3 runs on Hopper GPUs only (H100, H200)" if kernel == "fa3" else ""
        tables = accelerator.attention_kernels
        known = ", ".join(tables.measured if tables else []) or "none"
        return (
            f"workload.attention_kernel={kernel} but accelerator '{accelerator.name}' has no measured table for it"
            f"{hopper} (system.accelerator.attention_kernels: {known}); use auto or a kernel it has"
        )
    return None


def _world_mismatch(point: DesignPoint, dp_means: str = "") -> str | None:
    """Why the parallel degrees do not fill the system, or None."""
    p, s = point.parallel, point.system
    if p.world == s.npus:
        return None
    return (
        f"parallel.dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.world} but system '{s.name}' has "
        f"{s.npus} NPUs; choose degrees whose product is {s.npus}{dp_means}"
    )


def _serving_infeasibility(point: DesignPoint) -> str | None:
    """A serving deployment fills its system with instances whose steps can run: one pool's, or a disaggregated
    deployment's prefill pool (parallel) and decode pool (serving.decode) side by side."""
    serving = point.workload.serving
    assert serving is not None
    if serving.kind == "disaggregated":
        assert serving.decode is not None
        p, d, npus = point.parallel, serving.decode, point.system.npus
        if p.world + d.world != npus:
            return (
                f"the prefill pool (parallel.dp*tp*pp = {p.world}) and the decode pool (serving.decode.dp*tp*pp = "
                f"{d.world}) take {p.world + d.world} NPUs but system '{point.system.name}' has {npus}; choose "
                f"degrees whose two products add up to {npus}"
            )
        return _instance_infeasibility(point) or _instance_infeasibility(decode_point(point), "serving.decode.")
    if (mismatch := _world_mismatch(point, " (dp: the instances)")) is not None:
        return mismatch
    return _instance_infeasibility(point)


def _instance_infeasibility(point: DesignPoint, fields: str = "parallel.") -> str | None:
    """Why one instance's steps cannot run, its degrees named as the point names them."""
    p = point.parallel
    if p.dp % p.ep:
        return (
            f"{fields}dp = {p.dp} attention data-parallel ranks do not make whole expert-parallel groups of "
            f"{fields}ep = {p.ep} ranks (the ranks that share their experts, priced together and stepping in lock "
            f"step); use {fields}dp a multiple of {fields}ep, or lower {fields}ep"
        )
    try:
        step = step_point(point, "decode", 1, 1)
    except InfeasibleError as exc:
        return str(exc).replace("parallel.", fields)
    reason = infeasibility(step)
    return None if reason is None else reason.replace("parallel.", fields)


def check_feasible(point: DesignPoint) -> None:
    reason = infeasibility(point)
    if reason:
        raise InfeasibleError(reason)


def _uneven_stages(point: DesignPoint, chunks: int) -> str | None:
    """What is wrong with the pipeline's first_stage_layers / last_stage_layers (over `chunks` model chunks per
    stage), if anything."""
    p, layers = point.parallel, point.model.layers
    fixed = {name: value for name, value in (("first", p.first_stage_layers), ("last", p.last_stage_layers)) if value}
    names = " + ".join(f"parallel.{name}_stage_layers" for name in fixed)
    if p.pp == 1:
        return f"{names} needs a pipeline (parallel.pp >= 2); remove it or raise pp"
    others = p.pp - len(fixed)
    rest = layers - sum(fixed.values())
    if others == 0 and rest != 0:
        return f"{names} = {sum(fixed.values())} must equal model.layers={layers} with parallel.pp=2"
    if others and (rest <= 0 or rest % others):
        return (
            f"{names} = {sum(fixed.values())} leaves {rest} of model.layers={layers} for the other {others} "
            f"stage(s); choose them so that the rest is a positive multiple of {others}"
        )
    per_stage = p.stage_layers(layers)
    if min(per_stage) < chunks:
        return (
            f"parallel.virtual_stages={chunks} needs as many layers on every stage, not {per_stage}; "
            "lower virtual_stages or give the first and last stages more layers"
        )
    return None


def _microbatch_groups(point: DesignPoint) -> str | None:
    """What Megatron-core refuses in interleaved 1F1B's micro-batch groups, if anything
    (`forward_backward_pipelining_with_interleaving`): a group outside [pp, micro-batches], or a last group of
    fewer than pp micro-batches, which leaves the pipeline waiting on its own dependencies."""
    p, m = point.parallel, point.micro_batches
    group = p.microbatch_group or p.pp
    if m < p.pp:
        return (
            f"interleaved 1F1B needs at least parallel.pp={p.pp} micro-batches per step, not {m} "
            "(workload.global_batch / (parallel.dp * workload.micro_batch)); raise workload.global_batch"
        )
    if group > m:
        return f"parallel.microbatch_group={group} is over the {m} micro-batches per step; lower it to at most {m}"
    if group < p.pp:
        return f"parallel.microbatch_group={group} is under parallel.pp={p.pp}; raise it to at least {p.pp}"
    last = m % group
    if 0 < last < p.pp:
        fits = next(g for g in range(p.pp, m + 1) if m % g == 0 or m % g >= p.pp)
        setting = f"parallel.microbatch_group={group}" if p.microbatch_group else f"micro-batch groups of pp={group}"
        return (
            f"interleaved 1F1B with {m} micro-batches per step in {setting} leaves a last group of {last} < "
            f"parallel.pp={p.pp} micro-batches, which Megatron refuses; set parallel.microbatch_group: {fits}, or "
            f"make the micro-batches a multiple of {group}"
        )
    return None


def _sharding_groups(point: DesignPoint) -> str | None:
    """What is wrong with the ZeRO groups parallel.dp_shard (HSDP) and an int parallel.reshard_after_forward set,
    if anything: each must divide the group it splits."""
    p = point.parallel
    reshard = p.reshard_after_forward
    to_ranks = None if isinstance(reshard, bool) or reshard == "auto" else reshard
    if p.dp_shard is None and to_ranks is None:
        return None
    if p.ep > 1:
        fields = "parallel.dp_shard" if p.dp_shard is not None else "parallel.reshard_after_forward"
        return f"{fields} with parallel.ep={p.ep} (expert parallelism) is not supported; use ep 1 or unset {fields}"
    if p.dp_shard is not None and (p.dp % p.dp_shard or p.dp_shard == 1):
        return (
            f"parallel.dp_shard={p.dp_shard} must divide parallel.dp={p.dp} and be at least 2 (1 shards nothing: "
            f"use parallel.zero 0); use dp_shard in {{{', '.join(_divisors(p.dp).split(', ')[1:])}}}"
        )
    shard = p.dp_shard or p.dp
    if to_ranks is not None and (shard % to_ranks or to_ranks in (1, shard)):
        inner = [d for d in range(2, shard) if shard % d == 0]
        return (
            f"parallel.reshard_after_forward={to_ranks} must divide the {shard} ranks of a ZeRO shard group "
            f"(parallel.dp_shard or dp) and lie strictly between 1 and {shard} (FSDP2's post-forward group); use "
            + (f"one of {{{', '.join(map(str, inner))}}}" if inner else "true or false")
        )
    return None


def _dualpipev(point: DesignPoint) -> str | None:
    """Why DualPipeV cannot run the point, or None: it needs two ranks for its V, an even split of the layers
    over its 2 pp virtual stages, at least 2 pp micro-batches (dualpipev.py asserts it: the warm-up alone runs
    2 pp forwards on the first rank), and training; and like zb_h1 it is not modelled with ZeRO 3."""
    m, w, p = point.model, point.workload, point.parallel
    if w.mode != "train":
        return (
            "parallel.pp_schedule=dualpipev is a training schedule (it pairs forwards with backwards); use "
            f"pp_schedule 1f1b or gpipe with workload.mode={w.mode}"
        )
    if p.pp < 2:
        return "parallel.pp_schedule=dualpipev needs parallel.pp >= 2 (two ranks for its V); use pp 2 or more"
    if p.zero == 3:
        return (
            "parallel.pp_schedule=dualpipev with parallel.zero=3 is not modelled: FSDP's held weights and per-step "
            "reduce-scatters do not yet compose with deferred weight gradients; use zero 1 or 2, or pp_schedule "
            "1f1b or interleaved"
        )
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        return (
            "parallel.pp_schedule=dualpipev splits the layers evenly over its 2*pp virtual stages; remove "
            "parallel.first_stage_layers and parallel.last_stage_layers"
        )
    if m.layers % (2 * p.pp):
        fitting = ", ".join(str(pp) for pp in range(2, m.layers // 2 + 1) if m.layers % (2 * pp) == 0)
        return (
            f"parallel.pp_schedule=dualpipev needs 2*parallel.pp = {2 * p.pp} virtual stages to divide "
            f"model.layers={m.layers}; " + (f"use pp in {{{fitting}}}" if fitting else "use pp_schedule zb_h1")
        )
    if point.micro_batches < 2 * p.pp:
        return (
            f"parallel.pp_schedule=dualpipev needs at least 2*parallel.pp = {2 * p.pp} micro-batches per step, not "
            f"{point.micro_batches}; raise workload.global_batch or lower parallel.dp or workload.micro_batch"
        )
    return None
