"""How the suite is split between ``make test`` and ``make check``.

``make test`` (and CI) deselects tests marked ``long``; ``make check`` runs everything. A long test
is one of many variations of a check that ``make test`` already makes once: the other backends,
collates or stopping points of a matrix (:func:`covering`), a second way to reach the same state.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import pytest

#: Runs in ``make check`` only.
long = pytest.mark.long


def covering(names: str, *axes: Sequence[Any]) -> Any:
    """``pytest.mark.parametrize`` over the product of `axes`, where ``make test`` runs a diagonal
    (every value of every axis at least once) and ``make check`` the whole product.

    Parameters
    ----------
    names
        The parameter names, comma-separated, one per axis.
    axes
        The values of each parameter.
    """
    width = max(len(axis) for axis in axes)
    diagonal = {tuple(axis[i % len(axis)] for axis in axes) for i in range(width)}
    params = [pytest.param(*combo, marks=() if combo in diagonal else (long,))
              for combo in itertools.product(*axes)]
    return pytest.mark.parametrize(names, params)
