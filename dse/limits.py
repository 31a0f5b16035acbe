"""The largest inputs the tool accepts, checked before any work starts (README: Limits).

Each limit sits one to two orders of magnitude above the largest published training run, so a real plan never
meets one; what they stop is a slip of the keyboard (`layers: 1000000000000`, `seq_len: 1e9`) that would
otherwise run for hours, exhaust memory, or print a step time nobody could mean. Limits on one field are
constraints of that field (dse/spec.py, dse/space.py, dse/yamlio.py), so the error names it; limits over
several fields are the first feasibility rules (dse/feasibility.py), so a study records such a point as pruned,
with the reason.
"""

# The design point: the model.
MAX_LAYERS = 1024
"""model.layers, and every count of layers (stage layers, recompute_every, attention_every, ...)."""
MAX_WIDTH = 2**20
"""Every width, head count, vocabulary and expert count of a model (1,048,576)."""
MAX_PARAMETERS = 10**14
"""Parameters of a model (100 trillion), counted before anything is generated."""

# The workload and the parallel layout.
MAX_SEQ_LEN = 2**24
"""workload.seq_len and model.max_seq (16,777,216 tokens)."""
MAX_GLOBAL_BATCH = 2**24
"""workload.global_batch and micro_batch (16,777,216 sequences)."""
MAX_WORLD = 2**20
"""NPUs of a system, and every parallel degree (1,048,576)."""
MAX_PIPELINE_CHUNKS = 512
"""Model chunks in the pipeline (parallel.pp x virtual_stages); each is a program the cost model schedules."""
MAX_LAYER_PASSES = 2**18
"""Micro-batches per step x model.layers: the layer passes the cost model may schedule one by one (GPipe and
interleaved schedules are simulated whole, 1F1B over its steady state of about 2 pp + 2 micro-batches): 262,144,
which the slowest evaluation the limits admit prices in about 15 s."""

# The system: physical ranges, wide enough for hardware a thousand times today's, narrow enough that every
# time and rate the cost model derives from them is a finite float.
MAX_NETWORK_DIMS = 8
MIN_RATE = 1e-3
"""Lowest peak_tflops (TFLOP/s), hbm_bandwidth_GBps and bandwidth_GBps (GB/s)."""
MAX_RATE = 1e7
"""Highest of the same rates."""
MIN_SHARE = 1e-3
"""Lowest efficiency (a share of a peak rate; the highest is 1)."""
MAX_CAPACITY_GIB = 1e6
"""hbm_GiB and runtime_reserve_GiB (a PiB)."""
MAX_LATENCY_NS = 1e9
"""latency_ns and reduction_latency_ns (one second)."""
MAX_LAUNCH_US = 1e6
"""kernel_launch_us (one second)."""

# Study files and the YAML they are written in.
MAX_TRIALS = 10**7
MAX_WORKERS = 2**16
MAX_SEED = 2**31 - 1
"""Optuna's samplers take seeds below 2**32, and a resumed study offsets the seed by its trials."""
MAX_CHOICES = 1000
"""Choices of one study parameter (each is checked when the study loads)."""
MAX_SEARCHED = 100
"""Parameters of a study's space, and its derived values: each is assigned (or computed) for every point decoded, and
the load decodes a point per choice (a tenth of a second per 10 parameters); real studies search under 20."""
MAX_GRID_SEARCH = 10**6
"""Points of a grid searched trial by trial (sampler grid without sweep): Optuna's grid sampler lists and shuffles
every point each time the study opens, about 160 MB and 2 s per million points of a dozen parameters (10^11 points
ran out of memory); a sweep (up to MAX_TRIALS points) lists none."""
MAX_RANGE_VALUES = 10**7
"""Values of a stepped float range ((high - low) / step): more than a study could ever try (MAX_TRIALS), so a finer
step is a continuous range, and Optuna's exact check of the step fails on a step of 1e-300."""
MAX_LOCAL_VALUES = 10_000
"""Values over all parameters of a study with sampler local: the neighbours of a point, which it walks (and lists
once) for every front point at every ask."""
MAX_EXPRESSION_CHARS = 500
MAX_EXPRESSION_DEPTH = 32
"""Nesting of a derived expression (operators and parentheses)."""
MAX_NAME_CHARS = 100
"""A study's name (also its output folder's), and a model's, accelerator's or system's."""
MAX_FILE_BYTES = 2**20
"""A point or study file (1 MiB; the shipped ones are under 2 KiB)."""
MAX_NESTING = 32
"""Nesting of mappings and lists in a YAML file."""
MAX_VALUES = 100_000
"""Values in a YAML file once its aliases are expanded."""
