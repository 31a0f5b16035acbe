"""The op rows `op_rows.rows` assembles from skeletons encoded once each are the plans' ops transposed plainly, op by
op, whether the skeletons' encodings are kept (`Skeleton.encoding`, `op_rows._ENCODINGS`) or made afresh."""

from itertools import chain

import numpy as np

from simulators.analytical import op_rows
from simulators.analytical.call_layout import call_arrays
from simulators.analytical.compiled_engine import CompiledScheduler
from simulators.analytical.recipes import COLLECTIVE, COMPUTE
from simulators.analytical.skeletons import Plan, Skeleton
from tests.test_plan_cache import workloads  # noqa: F401  (the fixture)


def _plain(plans: list[Plan], streams: int) -> dict[str, list]:
    """Every field, op by op, as lists."""
    out: dict[str, list] = {name: [] for name in op_rows._FIELDS}
    for name in ("p_op_ptr", "p_category_ptr", "o_dep_ptr", "o_mark_ptr", "o_share_ptr"):
        out[name].append(0)
    out |= {"compute": [], "comm": [], "mails": [], "link_ptr": [0], "link_ids": [], "p_ops": [], "gather": []}
    links: dict = {}
    parts: list[list[int]] = [[], [], []]  # where o_seconds, o_mark_offset and p_category_seconds are in the seconds
    at = 0
    for plan in plans:
        skeleton = plan.skeleton
        out["p_output"].append(skeleton.output)
        out["p_slots"].append(len(skeleton.block.ops))
        out["p_category"] += skeleton.totals
        out["p_category_ptr"].append(len(out["p_category"]))
        comm, p2p, marks = [0] * streams, 0, 0
        for kind, stream, deps, waits, slot, marked, category, link, shares in skeleton.ops:
            out["o_kind"].append(kind)
            out["o_stream"].append(stream)
            out["o_waits"].append(waits)
            out["o_slot"].append(slot)
            out["o_category"].append(category)
            out["o_mail"].append(-1 if link is None else p2p)
            for name, ptr, values in (("o_deps", "o_dep_ptr", deps), ("o_mark_slot", "o_mark_ptr", marked)):
                out[name] += values
                out[ptr].append(len(out[name]))
            out["o_shares"] += shares
            out["o_share_ptr"].append(len(out["o_shares"]))
            if kind == COLLECTIVE or link is not None:
                comm[stream] += 1
            if link is not None:
                p2p += 1
                out["link_ids"].append(links.setdefault(link, len(links)))
            marks += len(marked)
        ops = len(skeleton.ops)
        for part, count in enumerate((ops, marks, len(skeleton.totals))):
            parts[part] += range(at, at + count)
            at += count
        out["p_op_ptr"].append(len(out["o_kind"]))
        out["compute"].append(sum(op[0] == COMPUTE for op in skeleton.ops))
        out["comm"] += comm
        out["mails"].append(p2p)
        out["link_ptr"].append(out["link_ptr"][-1] + p2p)
        out["p_ops"].append(ops)
    out["gather"] = [*parts[0], *parts[1], *parts[2]]
    return out


def _assembled(found: op_rows.Rows) -> dict[str, list]:
    per_plan = found.per_plan
    return {
        **{name: values.tolist() for name, values in found.fields.items()},
        **{"compute": per_plan.compute.tolist(), "comm": per_plan.comm.ravel().tolist()},
        **{"mails": per_plan.mails.tolist(), "link_ptr": found.link_ptr.tolist(), "link_ids": found.link_ids.tolist()},
        **{"p_ops": found.p_ops.tolist(), "gather": found.gather.tolist()},
    }


def test_rows_are_the_ops_transposed(workloads):  # noqa: F811
    for name, workload, system in workloads:
        scheduler = CompiledScheduler(workload, system)
        calls = [call_arrays(program) for program in workload.programs]
        planner = scheduler._planner
        places = [planner.plans(own.used, index) for index, own in enumerate(calls)]
        plans = [planner.handed[place] for place in dict.fromkeys(chain.from_iterable(places))]
        streams = len(scheduler._planner.streams)
        want = _plain(plans, streams)
        for kept in (False, True):
            op_rows._ROWS.clear()
            if not kept:
                op_rows._ENCODINGS.clear()
                for plan in plans:
                    plan.skeleton.encoding = None
            found = op_rows.rows(plans, streams)
            assert found.fields["o_waits"].dtype == np.bool_ and found.per_plan.comm.shape == (len(plans), streams)
            assert _assembled(found) == want, (name, kept)
        assert op_rows.rows(plans, streams) is found  # kept per tuple of encodings


def test_skeletons_alike_share_their_encoding_and_rows(workloads):  # noqa: F811
    """A skeleton made anew with another's content (as another configuration's blocks give) finds that one's
    encoding, and a set of such plans that one's rows."""
    for name, workload, system in workloads:
        scheduler = CompiledScheduler(workload, system)
        planner = scheduler._planner
        places = [planner.plans(call_arrays(program).used, index) for index, program in enumerate(workload.programs)]
        plans = [planner.handed[place] for place in dict.fromkeys(chain.from_iterable(places))]
        streams = len(planner.streams)
        op_rows._ENCODINGS.clear()  # encodings are found alike only while kept
        for plan in plans:
            plan.skeleton.encoding = None
        found = op_rows.rows(plans, streams)
        alike = [Plan(_anew(plan.skeleton), plan.seconds, plan.totals) for plan in plans]
        assert op_rows.rows(alike, streams) is found, name
        assert all(a.skeleton.encoding is p.skeleton.encoding for a, p in zip(alike, plans, strict=True)), name


def _anew(skeleton: Skeleton) -> Skeleton:
    return Skeleton(skeleton.block, skeleton.ops, skeleton.output, skeleton.totals, skeleton.categories)
