"""trainhost for training loops written in Python.

Build a loop with ``scripts/build-python-guest.sh loop.py -o loop.wasm``
(componentize-py puts CPython, this package and the loop into one WASI
component) and run it with ``trainhost run loop.wasm``. The loop module
declares its entry point::

    import trainhost

    @trainhost.entry
    def train():
        cfg = trainhost.config()
        for epoch in range(cfg.get("epochs", 3)):
            trainhost.report({"epoch": epoch, "loss": 1.0 / (epoch + 1)})

Module top-level code runs once, when the component is built, and its
state is frozen into it: read the rank, the config, the checkpoint and
randomness inside the entry function, never at import time.

An exception escaping the entry function fails the run with its
traceback as the error.
"""

import json
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import wit_world
from componentize_py_types import Err
from wit_world.imports import collective as _collective
from wit_world.imports import context as _context
from wit_world.imports import session as _session

from ._base import TrainhostError, _op, _raise
from .tensors import Program, Tensor

__all__ = [
    "entry", "report", "get_checkpoint", "preemption_requested", "config",
    "world_rank", "world_size", "local_rank", "local_world_size", "node_rank",
    "run_name", "scratch_dir", "barrier", "broadcast", "all_gather",
    "all_reduce", "Tensor", "Program", "TrainhostError",
]


def entry(train: Callable[[], None]) -> Callable[[], None]:
    """Declare ``train`` as the loop's entry point (a decorator): binds in
    ``train``'s module the ``WitWorld`` class componentize-py exports, whose
    ``train`` calls it. An exception escaping it becomes the guest's error,
    the traceback its message."""

    class WitWorld(wit_world.WitWorld):
        def train(self) -> None:
            try:
                train()
            except BaseException:
                raise Err(traceback.format_exc().rstrip())

    import sys
    module = sys.modules.get(train.__module__)
    if module is not None:
        setattr(module, "WitWorld", WitWorld)
    return train


# --- context -----------------------------------------------------------

def world_rank() -> int:
    """This rank's index among all ranks of the run, from 0; rank 0's
    metrics are the ones recorded."""
    return _context.world_rank()


def world_size() -> int:
    """How many ranks the run has."""
    return _context.world_size()


def local_rank() -> int:
    """This rank's index among the ranks on the same host."""
    return _context.local_rank()


def local_world_size() -> int:
    """How many ranks run on this rank's host."""
    return _context.local_world_size()


def node_rank() -> int:
    """The index of this rank's host among the hosts of the run."""
    return _context.node_rank()


def run_name() -> str:
    """The run's name."""
    return _context.run_name()


def scratch_dir() -> str:
    """This rank's private read-write directory, where checkpoints are
    written before they are reported; also the working directory."""
    return _context.scratch_dir()


def config() -> Dict[str, Any]:
    """The run's config (``--config``), parsed; {} without one."""
    text = _context.config()
    return json.loads(text) if text.strip() else {}


# --- session -----------------------------------------------------------

def _metric(name: str, value: Any) -> _session.Metric:
    if isinstance(value, bool):
        v = _session.MetricValue_Boolean(value)
    elif isinstance(value, int):
        v = _session.MetricValue_Integer(value)
    elif isinstance(value, float):
        v = _session.MetricValue_Float(value)
    elif isinstance(value, str):
        v = _session.MetricValue_Text(value)
    else:
        raise TypeError(f"metric {name!r} is a {type(value).__name__}; metrics are int, float, bool or str")
    return _session.Metric(name, v)


def report(metrics: Dict[str, Any], checkpoint: Optional[str] = None, hand_over: bool = False) -> None:
    """Report ``metrics`` (rank 0's are recorded, and count toward the
    host's ``--max-output-rate``: report per step or epoch, not per sample)
    and, optionally, the directory ``checkpoint`` below the scratch
    directory. Collective: every rank calls it. With ``hand_over`` the host takes the directory and
    leaves an empty one in its place."""
    items = [_metric(k, v) for k, v in metrics.items()]
    try:
        if hand_over:
            if checkpoint is None:
                raise ValueError("hand_over needs a checkpoint directory")
            _session.report_handing_over(items, checkpoint)
        else:
            _session.report(items, checkpoint)
    except Err as e:
        _raise(e)


def get_checkpoint() -> Optional[str]:
    """The directory of the checkpoint to resume from, read-only, or None."""
    return _session.get_checkpoint()


def preemption_requested() -> bool:
    """Whether the host asked the run to stop early (preemption, or the
    user interrupted it): true on every rank right after the same
    ``report``. Save a final checkpoint, report it, and return."""
    return _session.preemption_requested()


# --- collectives -------------------------------------------------------

def barrier() -> None:
    """Wait until every rank has called it. Collective."""
    try:
        _collective.barrier()
    except Err as e:
        _raise(e)


def broadcast(data: bytes, root: int = 0) -> bytes:
    """Rank ``root``'s ``data``, on every rank. Collective."""
    try:
        return _collective.broadcast(data, root)
    except Err as e:
        _raise(e)


def all_gather(data: bytes) -> List[bytes]:
    """Every rank's ``data``, in rank order, on every rank. Collective."""
    try:
        return _collective.all_gather(data)
    except Err as e:
        _raise(e)


def all_reduce(values: Sequence[float], op: str = "sum", dtype: str = "f32") -> List[float]:
    """Combine every rank's ``values`` element-wise (f32, f64 or s64)."""
    call = {"f32": _collective.all_reduce_f32, "f64": _collective.all_reduce_f64,
            "s64": _collective.all_reduce_s64}.get(dtype)
    if call is None:
        raise ValueError(f"unknown dtype {dtype!r}; use f32, f64 or s64")
    try:
        return call(list(values), _op(op))
    except Err as e:
        _raise(e)
