"""Emulator hooks: any program that runs a workload's traces and measures its step is a dse cost model.

The contract (`cost_model: emulator`, options `EmulatorCostModel.Options`):

1. dse writes, in a private run folder (deleted after the run unless `keep_runs` names a folder to keep it in):
   - `trace.<rank>.et`: one Chakra execution trace per rank (`dse.point.chakra.export` with the system's network
     sizes and accelerator, so compute nodes carry `duration_micros` from dse's compute model);
   - `trace.comm_groups.json`: `{"<pg id>": [ranks...]}`, the process groups collectives name in `pg_name`;
   - `system.json`: the SystemSpec (`model_dump`): accelerator and network dimensions;
   - `workload.json`: `point_key`, `world`, `layout` ([[axis, size], ...] innermost first), `tokens`, `dtype`.
2. It runs `command + args` (an argument list, no shell) with the folder's path in place of any `{folder}` in
   them, or appended when none has it; default command: `<this Python> -m simulators.emulator.replay`. The
   command runs in a new session (its own process group) with `timeout_s`; on timeout, and after it exits, the
   whole group is killed, so nothing it started outlives the trial.
3. It reads one JSON object of metrics from the last non-empty line of stdout (`metrics: stdout`) or from a file
   of that name in the folder: `step_time_s` (required); optional `comm_time_s`, `exposed_comm_time_s`,
   `compute_time_s` (means over ranks), `peak_memory_bytes`, and `ranks: [{rank, end_s, compute_s, comm_s,
   exposed_comm_s, node}]` (node: where the rank ran, optional). Seconds and bytes, finite and non-negative, and a
   step time above 0 (a zero step measured nothing).
4. It builds a SimResult with one ClassResult per rank class of the workload: its ranks' mean figures where
   `ranks` is given, else the step's; a figure not reported is NaN (not measured). Peak memory is the reported
   one, else the analytical memory model's for the class.

Every failure (a command that is missing or not executable, a non-zero exit or signal, a timeout, no JSON,
JSON without step_time_s, a negative or non-finite figure) raises `EmulatorError` (a DseError) with a one-line
message quoting the last lines of stderr, so a study marks the trial failed and goes on.

The emulator shipped with dse is the gloo replay (`replay.py`): every rank's trace executed for real over
torch.distributed, locally on loopback or as Ray actors across a cluster. It needs torch, the `fx` extra.
"""

from simulators.emulator.contract import EmulatorError, Metrics
from simulators.emulator.cost_model import EmulatorCostModel

__all__ = ["EmulatorCostModel", "EmulatorError", "Metrics"]
