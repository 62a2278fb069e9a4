"""What the SDK's modules share: the error a refused call raises, and
the reductions of the collectives by name."""

from componentize_py_types import Err
from wit_world.imports import collective as _collective


class TrainhostError(Exception):
    """A call the host refused: the message says why and what to do."""


def _raise(e: Err) -> None:
    """Raise the error the host's ``e`` says: its innermost case names
    the kind (``Shape``, ``Invalid``, ``Aborted``, ...); a program's
    errors wrap a kernel's or a collective's."""
    value = e.value
    kind = type(value).__name__.split("_")[-1]
    while not isinstance(value, str) and hasattr(value, "value"):
        kind, value = type(value).__name__.split("_")[-1], value.value
    raise TrainhostError(f"{kind}: {value}") from None


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
