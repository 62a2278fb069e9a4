"""Host tensors and the kernels that compute on them at native speed,
and recorded programs of kernel calls (``Program``)."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

from componentize_py_types import Err
from wit_world.imports import tensors as _tensors

from ._base import _op, _raise

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


class Program:
    """A training step's kernel calls, recorded once and run again with one
    call into the host (``run``): from Python each kernel call costs a few
    microseconds of interpreter and bindings, more than a small step's
    maths, and a program pays that once a step.

    Each method records the kernel of its name with ``Tensor``'s
    arguments, the tensor it writes first; the host checks the call as the
    kernel would and refuses a bad one (``TrainhostError``, nothing
    recorded). The tensors stay the caller's (each kernel reads what they
    hold when a run reaches it); the program keeps a reference to each, so
    that none is dropped while it may run. Hyperparameters are recorded
    with the call. At most 4096 kernels a program::

        step = Program()
        step.gather_rows(x, images)            # the rows each run is given
        step.dense(h, x, w1, b1, "relu")
        step.dense(z, h, w2, b2)
        step.softmax_cross_entropy(z, labels, dz)  # labels of every image
        ...
        [(loss, correct)] = step.run(batch)    # one call a step
    """

    __slots__ = ("_p", "_keep")

    def __init__(self):
        self._p = _tensors.Program()
        # The host refuses to run a program one of whose tensors was
        # dropped; holding them here keeps a temporary alive.
        self._keep = []

    def gather_rows(self, out: Tensor, source: Tensor) -> None:
        """Record ``out.gather_rows(source, rows)`` with the rows each
        ``run`` is given: ``out`` has as many rows as a run gets."""
        try:
            self._p.gather_rows(out._t, source._t)
            self._keep.extend((out, source))
        except Err as e:
            _raise(e)

    def gemm(self, c: Tensor, alpha: float, a: Tensor, b: Tensor, beta: float = 0.0,
             trans_a: bool = False, trans_b: bool = False) -> None:
        """Record ``c.gemm(alpha, a, b, beta, trans_a, trans_b)``."""
        try:
            self._p.gemm(c._t, alpha, a._t, trans_a, b._t, trans_b, beta)
            self._keep.extend((c, a, b))
        except Err as e:
            _raise(e)

    def axpy(self, y: Tensor, alpha: float, x: Tensor) -> None:
        """Record ``y.axpy(alpha, x)``."""
        try:
            self._p.axpy(y._t, alpha, x._t)
            self._keep.extend((y, x))
        except Err as e:
            _raise(e)

    def scale(self, x: Tensor, alpha: float) -> None:
        """Record ``x.scale(alpha)``."""
        try:
            self._p.scale(x._t, alpha)
            self._keep.extend((x,))
        except Err as e:
            _raise(e)

    def add_row(self, x: Tensor, row: Tensor) -> None:
        """Record ``x.add_row(row)``."""
        try:
            self._p.add_row(x._t, row._t)
            self._keep.extend((x, row))
        except Err as e:
            _raise(e)

    def sum_rows(self, out: Tensor, x: Tensor, beta: float = 0.0) -> None:
        """Record ``out.sum_rows(x, beta)``."""
        try:
            self._p.sum_rows(out._t, x._t, beta)
            self._keep.extend((out, x))
        except Err as e:
            _raise(e)

    def activate(self, x: Tensor, f: str) -> None:
        """Record ``x.activate(f)``."""
        try:
            self._p.activate(x._t, _activation(f))
            self._keep.extend((x,))
        except Err as e:
            _raise(e)

    def activate_backward(self, grad: Tensor, output: Tensor, f: str) -> None:
        """Record ``grad.activate_backward(output, f)``."""
        try:
            self._p.activate_backward(grad._t, output._t, _activation(f))
            self._keep.extend((grad, output))
        except Err as e:
            _raise(e)

    def dense(self, out: Tensor, x: Tensor, w: Tensor, bias: Optional[Tensor] = None,
              f: Optional[str] = None) -> None:
        """Record ``out.dense(x, w, bias, f)``."""
        try:
            self._p.dense(out._t, x._t, w._t, None if bias is None else bias._t, _activation(f))
            self._keep.extend((out, x, w, bias))
        except Err as e:
            _raise(e)

    def dense_backward(self, grad: Tensor, x: Tensor, w: Tensor, grad_w: Tensor,
                       grad_bias: Optional[Tensor] = None, grad_x: Optional[Tensor] = None,
                       x_f: Optional[str] = None, beta: float = 0.0) -> None:
        """Record ``Tensor.dense_backward`` with the same arguments."""
        try:
            self._p.dense_backward(grad._t, x._t, w._t, beta, grad_w._t,
                                   None if grad_bias is None else grad_bias._t,
                                   None if grad_x is None else grad_x._t, _activation(x_f))
            self._keep.extend((grad, x, w, grad_w, grad_bias, grad_x))
        except Err as e:
            _raise(e)

    def softmax_cross_entropy(self, logits: Tensor, labels: Sequence[int], grad: Tensor,
                              grad_scale: float = 1.0) -> None:
        """Record ``logits.softmax_cross_entropy(labels', grad, grad_scale)``
        where row k's label is ``labels[rows[k]]`` for the rows each ``run``
        is given: ``labels`` holds a label for every row of the data set
        the rows index (the program keeps a copy). Its loss and count of
        correct rows are among what ``run`` returns."""
        try:
            self._p.softmax_cross_entropy(logits._t, _as_list(labels), grad._t, grad_scale)
            self._keep.extend((logits, grad))
        except Err as e:
            _raise(e)

    def sgd_momentum_list(self, params: Sequence[Tensor], velocity: Sequence[Tensor],
                          grads: Sequence[Tensor], lr: float, momentum: float,
                          grad_scale: float = 1.0) -> None:
        """Record ``Tensor.sgd_momentum_list`` with the same arguments."""
        try:
            self._p.sgd_momentum_list([t._t for t in params], [t._t for t in velocity],
                                      [t._t for t in grads], grad_scale, lr, momentum)
            self._keep.extend((*params, *velocity, *grads))
        except Err as e:
            _raise(e)

    def adam(self, param: Tensor, m: Tensor, v: Tensor, grad: Tensor, lr: float, step: int,
             beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8) -> None:
        """Record ``param.adam(...)``, whose step counts on by itself:
        ``step`` in the program's first run, one more in each later run."""
        try:
            self._p.adam(param._t, m._t, v._t, grad._t,
                         _tensors.AdamStep(lr, beta1, beta2, epsilon, step))
            self._keep.extend((param, m, v, grad))
        except Err as e:
            _raise(e)

    def all_reduce_list(self, tensors: Sequence[Tensor], op: str = "sum") -> None:
        """Record ``Tensor.all_reduce_list(tensors, op)``: collective when
        the program runs, matched with the other ranks' collective calls
        as the call itself is."""
        try:
            self._p.all_reduce_list([t._t for t in tensors], _op(op))
            self._keep.extend((*tensors,))
        except Err as e:
            _raise(e)

    def run(self, rows: Sequence[int]) -> List[Tuple[float, int]]:
        """Run the recorded kernels in order, in one call into the host,
        with ``rows`` for every recorded ``gather_rows`` and
        ``softmax_cross_entropy``; returns each recorded loss's sum and
        count of correct rows, in the order they were recorded. Refused
        (nothing run) when the rows do not fit or a tensor was dropped."""
        try:
            return self._p.run(_as_list(rows))
        except Err as e:
            _raise(e)

