"""Rules that make a well-formed design point runnable, checked before any generation is spent on it."""

from dse.errors import InfeasibleError
from dse.spec import DesignPoint


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def infeasibility(point: DesignPoint) -> str | None:
    """The first reason the point cannot run, or None. Each reason names the fields and what would fit."""
    m, w, p, s = point.model, point.workload, point.parallel, point.system
    if p.world != s.npus:
        return (
            f"parallel.dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.world} but system '{s.name}' has "
            f"{s.npus} NPUs; choose degrees whose product is {s.npus}"
        )
    if m.heads % p.tp:
        return f"parallel.tp={p.tp} does not divide model.heads={m.heads}; use tp in {{{_divisors(m.heads)}}}"
    if m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
        return (
            f"parallel.tp={p.tp} and model.kv_heads={m.n_kv_heads} must divide one another "
            f"(kv heads are split or replicated across TP)"
        )
    if m.ffn % p.tp:
        return f"parallel.tp={p.tp} does not divide model.ffn={m.ffn}"
    if m.layers % p.pp:
        return f"parallel.pp={p.pp} does not divide model.layers={m.layers}; use pp in {{{_divisors(m.layers)}}}"
    if w.global_batch % (p.dp * w.micro_batch):
        return (
            f"workload.global_batch={w.global_batch} is not a multiple of parallel.dp*workload.micro_batch = "
            f"{p.dp}*{w.micro_batch}"
        )
    if p.sp and w.seq_len % p.tp:
        return f"workload.seq_len={w.seq_len} is not a multiple of parallel.tp={p.tp} (sequence parallelism)"
    if w.seq_len % p.cp:
        return f"workload.seq_len={w.seq_len} is not a multiple of parallel.cp={p.cp}"
    return None


def check_feasible(point: DesignPoint) -> None:
    reason = infeasibility(point)
    if reason:
        raise InfeasibleError(reason)
