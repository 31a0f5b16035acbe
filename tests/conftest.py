"""Session-wide fixtures: one local Ray for every test that needs it.

Starting Ray costs 10-18 s on a 2-core machine, so it starts once per session, only if a test asks for it.
In-process studies reuse it (the executor never shuts down a Ray it did not start) and `dse run` subprocesses
join it with --address.
"""

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    import ray

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
