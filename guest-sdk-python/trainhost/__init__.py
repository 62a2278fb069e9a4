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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import wit_world
from componentize_py_types import Err
from wit_world.imports import collective as _collective
from wit_world.imports import context as _context
from wit_world.imports import session as _session
from wit_world.imports import tensors as _tensors

__all__ = [
    "entry", "report", "get_checkpoint", "preemption_requested", "config",
    "world_rank", "world_size", "local_rank", "local_world_size", "node_rank",
    "run_name", "scratch_dir", "barrier", "broadcast", "all_gather",
    "all_reduce", "Tensor", "TrainhostError",
]


class TrainhostError(Exception):
    """A call the host refused: the message says why and what to do."""


def _raise(e: Err) -> None:
    value = e.value
    message = getattr(value, "value", value)
    kind = type(value).__name__.split("_")[-1]
    raise TrainhostError(f"{kind}: {message}") from None


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
    """Report ``metrics`` (rank 0's are recorded) and, optionally, the
    directory ``checkpoint`` below the scratch directory. Collective: every
    rank calls it. With ``hand_over`` the host takes the directory and
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

_OPS = {
    "sum": _collective.ReduceOp.SUM,
    "mean": _collective.ReduceOp.MEAN,
    "min": _collective.ReduceOp.MIN,
    "max": _collective.ReduceOp.MAX,
}


def _op(op: str) -> _collective.ReduceOp:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(_OPS)}") from None


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


# --- tensors -----------------------------------------------------------
#
# A kernel call costs a few microseconds of interpreter and binding work,
# more than a small layer's maths, and a training step makes several: the
# methods below call the binding directly inside ``try`` (free in CPython
# while nothing is raised) instead of through a helper that packs their
# arguments, and hand lists over without copying them when they already
# are lists.

_ACTIVATIONS = {
    "relu": _tensors.Activation.RELU,
    "tanh": _tensors.Activation.TANH,
    "sigmoid": _tensors.Activation.SIGMOID,
    "exp": _tensors.Activation.EXP,
}


def _activation(f: Optional[str]) -> Optional[_tensors.Activation]:
    """The binding's activation named ``f``; None for None."""
    if f is None:
        return None
    found = _ACTIVATIONS.get(f)
    if found is None:
        raise ValueError(f"unknown activation {f!r}; use one of {', '.join(_ACTIVATIONS)}")
    return found


def _as_list(values: Sequence[Any]) -> List[Any]:
    """``values`` as the list the binding takes, copied only if it is not one."""
    return values if type(values) is list else list(values)


class Tensor:
    """An f32 tensor of rank 1 or 2 that lives in the host; kernels run
    on it at native speed and write into the tensor they are called on."""

    __slots__ = ("_t",)

    def __init__(self, handle: _tensors.Tensor):
        self._t = handle

    @staticmethod
    def from_list(shape: Sequence[int], data: Sequence[float]) -> "Tensor":
        """A tensor of ``shape`` holding ``data``, row-major."""
        try:
            return Tensor(_tensors.Tensor.from_list(_as_list(shape), _as_list(data)))
        except Err as e:
            _raise(e)

    @staticmethod
    def zeros(shape: Sequence[int]) -> "Tensor":
        """A tensor of ``shape`` full of zeros."""
        try:
            return Tensor(_tensors.Tensor.zeros(_as_list(shape)))
        except Err as e:
            _raise(e)

    @staticmethod
    def uniform(shape: Sequence[int], low: float, high: float, seed: int) -> "Tensor":
        """A tensor of ``shape`` drawn uniformly from [low, high) by a
        generator seeded with ``seed``: the same values on every host."""
        try:
            return Tensor(_tensors.Tensor.uniform(_as_list(shape), low, high, seed))
        except Err as e:
            _raise(e)

    @property
    def shape(self) -> List[int]:
        """The shape: ``[n]`` or ``[rows, cols]``."""
        return self._t.shape()

    def to_list(self) -> List[float]:
        """A copy of the values, row-major."""
        return self._t.to_list()

    def assign(self, data: Sequence[float]) -> None:
        """Overwrite the values with ``data``, which must fill the shape."""
        try:
            self._t.assign(_as_list(data))
        except Err as e:
            _raise(e)

    def gemm(self, alpha: float, a: "Tensor", b: "Tensor", beta: float = 0.0,
             trans_a: bool = False, trans_b: bool = False) -> None:
        """self = alpha * op(a) @ op(b) + beta * self."""
        try:
            _tensors.gemm(self._t, alpha, a._t, trans_a, b._t, trans_b, beta)
        except Err as e:
            _raise(e)

    def gather_rows(self, source: "Tensor", rows: Sequence[int]) -> None:
        """Row k of self = row ``rows[k]`` of ``source``: a minibatch taken
        from a dataset kept in the host."""
        try:
            _tensors.gather_rows(self._t, source._t, _as_list(rows))
        except Err as e:
            _raise(e)

    def axpy(self, alpha: float, x: "Tensor") -> None:
        """self = self + alpha * x, element by element (same shapes)."""
        try:
            _tensors.axpy(self._t, alpha, x._t)
        except Err as e:
            _raise(e)

    def scale(self, alpha: float) -> None:
        """self = alpha * self."""
        _tensors.scale(self._t, alpha)

    def add_row(self, row: "Tensor") -> None:
        """Add ``row`` (``[cols]``) to every row of self (``[rows, cols]``): a bias."""
        try:
            _tensors.add_row(self._t, row._t)
        except Err as e:
            _raise(e)

    def sum_rows(self, x: "Tensor", beta: float = 0.0) -> None:
        """self = beta * self + the sum of x's rows (x: ``[rows, cols]``,
        self: ``[cols]``): a bias's gradient."""
        try:
            _tensors.sum_rows(self._t, x._t, beta)
        except Err as e:
            _raise(e)

    def activate(self, f: str) -> None:
        """self = f(self), element by element; ``f`` is "relu", "tanh",
        "sigmoid" or "exp"."""
        _tensors.activate(self._t, _activation(f))

    def activate_backward(self, output: "Tensor", f: str) -> None:
        """self = self * f', element by element, with f' taken from
        ``output = f(input)``: a gradient back through an activation."""
        try:
            _tensors.activate_backward(self._t, output._t, _activation(f))
        except Err as e:
            _raise(e)

    def dense(self, x: "Tensor", w: "Tensor", bias: Optional["Tensor"] = None,
              f: Optional[str] = None) -> None:
        """self = f(x @ w + bias), a dense layer's forward pass in one call
        into the host (the values of ``gemm``, ``add_row`` and ``activate``;
        no bias or function when None)."""
        try:
            _tensors.dense(self._t, x._t, w._t, None if bias is None else bias._t, _activation(f))
        except Err as e:
            _raise(e)

    @staticmethod
    def dense_backward(grad: "Tensor", x: "Tensor", w: "Tensor", grad_w: "Tensor",
                       grad_bias: Optional["Tensor"] = None, grad_x: Optional["Tensor"] = None,
                       x_f: Optional[str] = None, beta: float = 0.0) -> None:
        """A dense layer's backward pass in one call into the host, from
        ``grad``, the loss's gradient at ``x @ w + bias``: grad_w = beta *
        grad_w + x.T @ grad, grad_bias = beta * grad_bias + grad's row sum,
        grad_x = (grad @ w.T) * f' with f' from ``x = x_f(...)`` (the
        previous layer's activation), so that it is that layer's ``grad``."""
        try:
            _tensors.dense_backward(grad._t, x._t, w._t, beta, grad_w._t,
                            None if grad_bias is None else grad_bias._t,
                            None if grad_x is None else grad_x._t, _activation(x_f))
        except Err as e:
            _raise(e)

    def softmax_cross_entropy(self, labels: Sequence[int], grad: "Tensor", grad_scale: float = 1.0) -> Tuple[float, int]:
        """Softmax cross-entropy of self (logits, ``[rows, classes]``)
        against ``labels`` (one per row, each below ``classes``). Returns the
        summed loss and how many rows' largest logit is their label, and
        writes into ``grad`` (self's shape) the summed loss's gradient times
        ``grad_scale``."""
        try:
            return _tensors.softmax_cross_entropy(self._t, _as_list(labels), grad._t, grad_scale)
        except Err as e:
            _raise(e)

    def sgd_momentum(self, velocity: "Tensor", grad: "Tensor", lr: float, momentum: float) -> None:
        """SGD with momentum on self, in place: velocity = momentum *
        velocity + grad, self = self - lr * velocity (same shapes)."""
        try:
            _tensors.sgd_momentum(self._t, velocity._t, grad._t, lr, momentum)
        except Err as e:
            _raise(e)

    def adam(self, m: "Tensor", v: "Tensor", grad: "Tensor", lr: float, step: int,
             beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8) -> None:
        """One Adam step on self, in place, with moments ``m`` and ``v``
        (same shapes); ``step`` counts from 1 for the bias corrections."""
        try:
            _tensors.adam(self._t, m._t, v._t, grad._t, _tensors.AdamStep(lr, beta1, beta2, epsilon, step))
        except Err as e:
            _raise(e)

    def all_reduce(self, op: str = "sum") -> None:
        """Combine every rank's values of this tensor in place in the host
        (``op``: "sum", "mean", "min" or "max"). Collective: every rank
        calls it, in the same order as its other collective calls."""
        try:
            _tensors.all_reduce(self._t, _op(op))
        except Err as e:
            _raise(e)

    def broadcast(self, root: int = 0) -> None:
        """Replace every rank's values of this tensor by rank ``root``'s,
        in place in the host. Collective."""
        try:
            _tensors.broadcast(self._t, root)
        except Err as e:
            _raise(e)

    @staticmethod
    def all_reduce_list(tensors: Sequence["Tensor"], op: str = "sum") -> None:
        """``all_reduce`` of several tensors in one collective round, as
        one all-reduce of their values one after the other."""
        try:
            _tensors.all_reduce_list([t._t for t in tensors], _op(op))
        except Err as e:
            _raise(e)

    @staticmethod
    def sgd_momentum_list(params: Sequence["Tensor"], velocity: Sequence["Tensor"],
                          grads: Sequence["Tensor"], lr: float, momentum: float,
                          grad_scale: float = 1.0) -> None:
        """``sgd_momentum`` of every tensor of a model in one call into the
        host, each gradient times ``grad_scale`` (the gradients are not
        changed)."""
        try:
            _tensors.sgd_momentum_list([t._t for t in params], [t._t for t in velocity],
                               [t._t for t in grads], grad_scale, lr, momentum)
        except Err as e:
            _raise(e)

    @staticmethod
    def save(path: str, named: Dict[str, "Tensor"]) -> None:
        """Write the tensors under their names into the safetensors file
        ``path`` (below the scratch directory), from the host; the file
        appears whole or not at all."""
        try:
            _tensors.save(path, [(k, t._t) for k, t in named.items()])
        except Err as e:
            _raise(e)

    @staticmethod
    def load(path: str) -> Dict[str, "Tensor"]:
        """Every tensor of the safetensors file ``path`` (in the scratch
        directory or a restored checkpoint), as new host tensors."""
        try:
            return {k: Tensor(t) for k, t in _tensors.load(path)}
        except Err as e:
            _raise(e)
