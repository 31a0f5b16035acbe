"""The ASTRA-sim cost model's settings (a study's `cost_model_options`), validated with pydantic."""

from typing import Annotated, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, ConfigDict, Field

from dse.fields import Whole
from dse.limits import MAX_WORLD
from dse.options import ExistingFile, Folder, TimeoutSeconds

MAX_CHUNKS = 64
"""Chunks of a collective (in flight per dimension, or split into): ASTRA-sim's runs slow with each, to no end."""
Chunks = Annotated[Whole, Ge(1), Le(MAX_CHUNKS)]


class AstraSimOptions(BaseModel):
    """How ASTRA-sim is run. Every field has a default, so `AstraSimCostModel()` runs the binary ASTRA_SIM_BIN names
    with the settings under which ASTRA-sim's collectives reproduce the analytical model's closed forms.

    Strict as a point file is (no quoted numbers, no booleans for numbers, every number finite and bounded); the
    binary must be an existing file and keep_runs a folder (checked when the study or point loads), and the
    binary's libraries are checked by the cost model's pre-flight."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    binary: ExistingFile | None = Field(
        None,
        description="ASTRA-sim's analytical binary; unset: the environment variable ASTRA_SIM_BIN. For the "
        "congestion-aware backend, a binary named AstraSim_Analytical_Congestion_Unaware (as CI sets it) stands for "
        "the AstraSim_Analytical_Congestion_Aware beside it; a binary of any other name is run as given",
    )
    backend: Literal["congestion_unaware", "congestion_aware"] = Field(
        "congestion_unaware",
        description="ASTRA-sim's analytical network backend; the congestion-aware one simulates 1-D networks only",
    )
    compute: Literal["model", "roofline"] = Field(
        "model",
        description="model: compute nodes take the durations the Chakra export writes from our compute model; "
        "roofline: ASTRA-sim's own roofline, at the accelerator's peak x compute_efficiency.gemm x clock_share and "
        "its HBM bandwidth x memory_efficiency (which then also prices the local reductions of collectives; it has "
        "no kernel launch cost)",
    )
    scheduling_policy: Literal["LIFO", "FIFO"] = Field(
        "LIFO", description="ASTRA-sim's order among ready collectives (its scheduling-policy)"
    )
    active_chunks_per_dimension: Chunks = Field(
        1, description="chunks of a collective in flight per dimension; 1 reproduces the closed forms"
    )
    preferred_dataset_splits: Chunks = Field(
        1, description="chunks a collective is split into; 1 reproduces the closed forms"
    )
    max_npus: Annotated[Whole, Ge(2), Le(MAX_WORLD)] | None = Field(
        None,
        description="large worlds: simulate a world of more NPUs on as few data-parallel replicas as bring it to this "
        "many (at least 2), each data-parallel collective resized to keep its time, so that a 1024-GPU point takes "
        "seconds; the replica axis must lie inside one network dimension. Unset: every NPU is simulated",
    )
    timeout_s: TimeoutSeconds = Field(600.0, description="seconds before a run is killed as hung")
    keep_runs: Folder | None = Field(
        None,
        description="folder to keep every run's configuration, traces and log in (one subfolder per run); unset: "
        "run folders are deleted after parsing",
    )
