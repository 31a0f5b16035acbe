"""The standard objectives and the memory constraint.

MFU counts model FLOPs by the convention of Megatron and torchtitan (6 N T plus 12 L h s T for attention,
recomputation excluded) over the dense bf16 peak of every GPU for the whole step. A serving point's step is its
engine iteration, its tokens per second per GPU its output tokens', its MFU its requests' prefill and decode FLOPs
per second (`dse.serving.deployment`).
"""

from dse.interfaces import SimResult
from dse.objective import Constraint, Objective
from dse.serving.deployment import ServingResult
from dse.spec import DesignPoint
from dse.workload import Workload


def _step_time(point: DesignPoint, workload: Workload, result: SimResult) -> float:
    return result.step_time_s


def _peak_memory(point: DesignPoint, workload: Workload, result: SimResult) -> float:
    return result.peak_memory_bytes


def _overlap(point: DesignPoint, workload: Workload, result: SimResult) -> float:
    return result.overlap_ratio


def _mfu(point: DesignPoint, workload: Workload, result: SimResult) -> float:
    if isinstance(result, ServingResult):
        return result.serving["mfu"]
    peak = point.system.accelerator.peak_flops(point.model.dtype) * point.parallel.world
    return workload.model_flops / (result.step_time_s * peak)


def _tokens_per_s_per_gpu(point: DesignPoint, workload: Workload, result: SimResult) -> float:
    if isinstance(result, ServingResult):
        return result.serving["tokens_per_s_per_gpu"]
    return workload.tokens / result.step_time_s / point.parallel.world


def _memory_excess(point: DesignPoint, workload: Workload, result: SimResult) -> float:
    return result.peak_memory_bytes - point.system.accelerator.memory_bytes


step_time = Objective("step_time", "step_time_s", "minimize", "s", _step_time)
peak_memory = Objective("peak_memory", "peak_memory_bytes", "minimize", "B", _peak_memory)
overlap_ratio = Objective("overlap_ratio", "overlap_ratio", "maximize", "", _overlap)
mfu = Objective("mfu", "mfu", "maximize", "", _mfu)
tokens_per_s_per_gpu = Objective(
    "tokens_per_s_per_gpu", "tokens_per_s_per_gpu", "maximize", "tokens/s", _tokens_per_s_per_gpu
)
fits_memory = Constraint("fits_memory", "memory_excess_bytes", "B", _memory_excess)
