"""`batch_steady._window_categories`, which sums a steady window's busy seconds per category plan by plan over every
system at once and skips what adds 0.0, against the sums made system by system in the order the per-point rules
make them: bit for bit, on windows that differ between systems, plans that no window runs, transfers outside a
window, and seconds that are infinite or NaN."""

import numpy as np

from simulators.analytical.batch_steady import _window_categories


def _system_by_system(plan_of_call, plan_categories, first, calls, columns, call, category, seconds):
    """Per system of `columns`: each plan's count in its window times its seconds, summed over every plan in order
    from 0.0, then every transfer's seconds added in order, 0.0 for one outside the window."""
    plans, categories = plan_categories.shape[:2]
    out = np.empty((categories, len(columns)))
    for j, s in enumerate(columns.tolist()):
        at = int(first[s])
        count = np.zeros(plans)
        for i in range(at, min(at + calls, len(plan_of_call))):
            count[plan_of_call[i]] += 1.0
        for c in range(categories):
            total = 0.0
            for p in range(plans):
                total += count[p] * plan_categories[p, c, s]
            out[c, j] = total
        for k in range(len(call)):
            out[category[k], j] += seconds[k, s] if at <= call[k] < at + calls else 0.0
    return out


def test_a_window_s_categories_are_the_sums_made_system_by_system():
    rng = np.random.default_rng(0)
    for draw in range(300):
        plans, categories, systems = (int(rng.integers(1, n)) for n in (20, 8, 30))
        calls = int(rng.integers(1, 120))
        plan_of_call = rng.integers(0, plans, calls).astype(np.int32)
        plan_categories = rng.random((plans, categories, systems)) * 10.0 ** rng.uniform(-6, 0)
        if draw % 4 == 0:
            where = tuple(rng.integers(0, n) for n in plan_categories.shape)
            plan_categories[where] = np.inf if draw % 8 else np.nan
        first = rng.integers(0, calls, systems) if draw % 2 else np.full(systems, rng.integers(0, calls))
        columns = np.sort(rng.choice(systems, int(rng.integers(0, systems + 1)), replace=False))
        window = int(rng.integers(0, calls))
        transfers = int(rng.integers(0, 30))
        call, category = rng.integers(0, calls, transfers), rng.integers(0, categories, transfers)
        seconds = rng.random((transfers, systems))
        arrays = (first, window, columns, call, category, seconds)
        finite = bool(np.isfinite(plan_categories).all())
        found = _window_categories(plan_of_call, plan_categories, finite, *arrays)
        with np.errstate(invalid="ignore"):  # 0 x inf, as the compiled loop makes it
            expected = _system_by_system(plan_of_call, plan_categories, *arrays)
        assert found.shape == expected.shape
        assert np.array_equal(found.view(np.int64), expected.view(np.int64))
