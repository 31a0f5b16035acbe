"""Pre-flight: what a run would otherwise find trial by trial, found before the first one.

A missing ASTRA-sim binary, a library it cannot load, an emulator command that is not there, a model factory that
does not import, a storage server that does not answer: each fails every trial of a study with the same reason,
which then sits in trials.parquet while the run exits 0. `dse check`, `dse run` (before its first trial) and
`dse evaluate` (before generating) run these checks, and each problem is one line and exit code 2.

The plugins' own checks are their optional capabilities (dse.interfaces.PreflightCostModel, PreflightGenerator);
this module only gathers what to check: the study's cost models, its generator with the points that vary one
parameter at a time from the first, its storage.
"""

from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from dse import plugins
from dse.errors import DseError
from dse.interfaces import CostModel, WorkloadGenerator
from dse.search.decoding import vary
from dse.search.space import StudySpec
from dse.search.storage import describe
from dse.spec import DesignPoint

STORAGE_TIMEOUT_S = 5
"""Seconds a storage server may take to answer (whole seconds: libpq's connect_timeout takes no fraction)."""


def check_point(
    point: DesignPoint,
    source: str,
    generator_name: str,
    cost_model: CostModel | None = None,
    cost_model_flag: str = "",
) -> WorkloadGenerator:
    """The generator for one point file, built, once the point sets no field it never reads and the generator's
    (and the cost model's, if one will price it) pre-flights pass. source: the point file; cost_model_flag: how
    the cost model was chosen ('--cost-model astrasim'), which a cost model's error begins with."""
    plugins.refuse_unread_fields(generator_name, lambda path: [_value(point, path)], source)
    generator = plugins.generator(generator_name)
    cost_models = {} if cost_model is None else {cost_model_flag: cost_model}
    _located(source, lambda: plugins.preflight(generator, cost_models, [point]))
    return generator


def check_study(spec: StudySpec) -> None:
    """A study's storage answers, its cost models (and refining one) can run here, and its generator can build
    the points that vary one parameter at a time from the first (load_study has checked everything the file
    alone decides)."""
    check_storage(spec.storage, spec.source)
    _located(spec.source, lambda: _check_plugins(spec))


def _check_plugins(spec: StudySpec) -> None:
    """The study's plugins, built as its evaluations build them, and their pre-flights."""
    cost_models = {f"cost model '{spec.cost_model}'": plugins.cost_model(spec.cost_model, spec.cost_model_options)}
    if (refine := spec.refine) is not None:
        options = refine.cost_model_options
        refiner = plugins.cost_model(refine.cost_model, options, field="refine.cost_model_options")
        cost_models[f"refine cost model '{refine.cost_model}'"] = refiner
    points = [outcome for _, _, outcome in vary(spec) if isinstance(outcome, DesignPoint)]
    plugins.preflight(plugins.generator(spec.generator), cost_models, points)


def check_storage(url: str | None, source: str) -> None:
    """A PostgreSQL, MySQL or Redis storage answers within STORAGE_TIMEOUT_S; their clients would otherwise wait
    on an unreachable host for minutes (the TCP connect timeout) before the study could say so. A journal file or
    sqlite is opened (and its errors reported) by the study itself; a missing client package likewise."""
    scheme = urlsplit(url).scheme.split("+")[0] if url else ""
    try:
        if scheme in ("postgresql", "mysql"):
            import sqlalchemy
            from sqlalchemy.pool import NullPool

            engine = sqlalchemy.create_engine(
                url, poolclass=NullPool, connect_args={"connect_timeout": STORAGE_TIMEOUT_S}
            )
            try:
                with engine.connect():
                    pass
            finally:
                engine.dispose()
        elif scheme == "redis":
            import redis

            client = redis.Redis.from_url(
                url, socket_connect_timeout=STORAGE_TIMEOUT_S, socket_timeout=STORAGE_TIMEOUT_S
            )
            try:
                client.ping()
            finally:
                client.close()
    except ImportError:
        return  # the study's open_storage names the client package to install
    except Exception as exc:  # sqlalchemy's and redis's own hierarchies: the message is what matters
        first = (f"{type(exc).__name__}: {exc}".strip().splitlines() or [""])[0]
        raise DseError(
            f"{source}: field 'storage': {describe(url, Path())} does not answer ({first}; waited up to "
            f"{STORAGE_TIMEOUT_S} s); check that the server is up and the URL is right"
        ) from None


def _located(source: str, check: Callable[[], None]) -> None:
    """Run a check; its error names the file first, as the loading errors do."""
    try:
        check()
    except DseError as error:
        if str(error).startswith(source):
            raise
        raise type(error)(f"{source}: {error}") from None


def _value(point: DesignPoint, path: str) -> object:
    """The point's value at a dotted field path ('model.fx_factory')."""
    section, name = path.split(".")
    return getattr(getattr(point, section), name)
