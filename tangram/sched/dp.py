"""DPArrange (paper appendix B, Alg. 3): optimal discrete split of free units.

Contract
--------
Given ``n`` elastic candidates, where ``choices[i]`` maps each allowed amount of candidate
``i`` to its duration, and the free units of a pool described by an operator, find amounts
``a_i`` (one allowed amount each) that fit together and minimise ``sum(dur_i(a_i))``. At most
the free units are used (leaving units idle is allowed). Inputs are read-only; no I/O.

One table serves every greedy-eviction step: row ``t`` of ``DPTable`` is the optimal split of
the free units among the first ``t`` candidates, so evicting the last candidate is reading an
earlier row (docs/design.md §4.4).

Complexity
----------
- Base operator (interchangeable units): ``O(n · R · |set|)`` elementary operations, executed
  as ``n · |set|`` vectorised numpy row operations of length ``R + 1``; memory ``O(n · R)``.
- Chunk operator (GPU buddy chunks): ``O(n · S · |set|)`` where ``S`` is the number of chunk
  count states reachable from the start (small: tens to hundreds for 8-GPU nodes).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from tangram.model import TangramError
from tangram.sched.operators import BaseOperator, Operator

INF = float("inf")
_MISSING: Any = object()  # successor not taken yet (None: the amount does not fit)


class InfeasibleArrangement(TangramError):
    """Even the minimum amounts of the candidates do not fit the free units."""

    code: ClassVar[str] = "unschedulable"


@dataclass(frozen=True, slots=True)
class Arrangement:
    total: float
    amounts: list[int]
    units: int  # units used


def _check_choices(choices: Sequence[Mapping[int, float]]) -> None:
    for i, c in enumerate(choices):
        if not c:
            raise InfeasibleArrangement(f"candidate {i} has no allowed amount")
        for amount, dur in c.items():
            if amount <= 0:
                raise ValueError(f"candidate {i}: amount {amount} must be positive")
            if not dur >= 0:  # also rejects NaN
                raise ValueError(f"candidate {i}: duration {dur!r} must be >= 0")


class DPTable:
    """Rows of optimal splits for every prefix of the candidates (see module doc)."""

    def __init__(
        self,
        choices: Sequence[Mapping[int, float]],
        operator: Operator[Any],
        start: Hashable | None = None,
    ) -> None:
        _check_choices(choices)
        self.n = len(choices)
        self._choices = [sorted(c.items()) for c in choices]
        self._op = operator
        self._start = operator.start() if start is None else start
        if not choices:  # nothing elastic: row 0 only
            self._mode = "empty"
        elif isinstance(operator, BaseOperator):
            assert isinstance(self._start, int)  # the base operator's state is a unit count
            self._build_vector(self._start)
        else:
            self._build_states()

    # -- base operator: vectorised over the units axis -------------------------------------
    def _build_vector(self, free: int) -> None:
        width = free + 1
        cost = np.full(width, INF)
        cost[0] = 0.0
        self._vec_cost: list[npt.NDArray[np.float64]] = [cost]
        self._vec_pick: list[npt.NDArray[np.intp]] = []
        for options in self._choices:
            fits = [(u, d) for u, d in options if u < width]
            if len(fits) == 1:  # one row: it is the minimum (no grid, no argmin)
                amount, dur = fits[0]
                best = np.full(width, INF)
                np.add(cost[: width - amount], dur, out=best[amount:])
                pick = np.full(width, options.index(fits[0]), dtype=np.intp)
            else:
                grid = np.full((max(1, len(fits)), width), INF)
                for idx, (amount, dur) in enumerate(fits):
                    np.add(cost[: width - amount], dur, out=grid[idx, amount:])
                pick = grid.argmin(axis=0)  # first minimum: smallest amount
                best = grid.min(axis=0)  # the value at pick
                # map grid rows back to indices into the candidate's full option list
                if len(fits) != len(options):
                    index_of = np.array([options.index(f) for f in fits] or [0], dtype=np.intp)
                    pick = index_of[pick]
            pick[best == INF] = -1  # durations are finite or inf, never NaN (checked)
            self._vec_pick.append(pick)
            self._vec_cost.append(best)
            cost = best
        self._mode = "vector"

    # -- any operator: forward DP over reachable states -------------------------------------
    def _build_states(self) -> None:
        layer: dict[Hashable, float] = {self._start: 0.0}
        self._layers: list[dict[Hashable, float]] = [layer]
        self._parents: list[dict[Hashable, tuple[Hashable, int]]] = []
        take = self._op.take
        # each state's successor per amount, taken once per table (a state recurs in many
        # layers and candidates mostly share their amounts)
        moves: dict[Hashable, dict[int, Hashable | None]] = {}
        missing = _MISSING  # a local: compiled, a module global is a dict look-up per read
        for options in self._choices:
            nxt: dict[Hashable, float] = {}
            parent: dict[Hashable, tuple[Hashable, int]] = {}
            for state, base in layer.items():
                succ = moves.get(state)
                if succ is None:
                    succ = moves[state] = {}
                for amount, dur in options:
                    new = succ.get(amount, missing)
                    if new is missing:
                        new = succ[amount] = take(state, amount)
                    if new is None:
                        continue
                    c = base + dur
                    if c < nxt.get(new, INF):
                        nxt[new] = c
                        parent[new] = (state, amount)
            self._layers.append(nxt)
            self._parents.append(parent)
            layer = nxt
        self._mode = "states"

    def row(self, t: int) -> Arrangement:
        """Optimal split among the first ``t`` candidates; raises if their minimums don't fit."""
        if not 0 <= t <= self.n:
            raise IndexError(f"row {t} outside 0..{self.n}")
        if self._mode == "empty":
            return Arrangement(0.0, [], 0)
        if self._mode == "vector":
            return self._row_vector(t)
        return self._row_states(t)

    def feasible(self, t: int) -> bool:
        if self._mode == "empty":
            return True
        if self._mode == "vector":
            return bool(np.isfinite(self._vec_cost[t]).any())
        return bool(self._layers[t])

    def _row_vector(self, t: int) -> Arrangement:
        cost = self._vec_cost[t]
        j = int(np.argmin(cost))  # first minimum = fewest units among equal totals
        total = float(cost[j])
        if total == INF:
            raise InfeasibleArrangement(f"the first {t} candidates do not fit at their minimum")
        used = j
        amounts = [0] * t
        for i in range(t - 1, -1, -1):
            idx = int(self._vec_pick[i][j])
            amount = self._choices[i][idx][0]
            amounts[i] = amount
            j -= amount
        return Arrangement(total, amounts, used)

    def _row_states(self, t: int) -> Arrangement:
        layer = self._layers[t]
        if not layer:
            raise InfeasibleArrangement(f"the first {t} candidates do not fit at their minimum")
        start_units = self._op.units(self._start)
        # min total; ties broken by fewer units used (more free units left), then encoding
        # (the tie-break key is only built for the states at the least total)
        least = min(layer.values())
        tied = [s for s, c in layer.items() if c == least]
        state = (
            tied[0]
            if len(tied) == 1
            else min(tied, key=lambda s: (start_units - self._op.units(s), self._op.encode(s)))
        )
        total = layer[state]
        amounts = [0] * t
        cur = state
        for i in range(t - 1, -1, -1):
            prev, amount = self._parents[i][cur]
            amounts[i] = amount
            cur = prev
        return Arrangement(total, amounts, start_units - self._op.units(state))


def dp_arrange(
    choices: Sequence[Mapping[int, float]],
    units: int,
    operator: Operator[Any] | None = None,
) -> Arrangement:
    """Optimal split of ``units`` free units among candidates (docs/design.md §4.5).

    ``choices[i]`` maps an allowed amount to candidate ``i``'s duration at that amount.
    ``operator=None`` is the base operator over ``units`` interchangeable units; with a
    ``ChunkOperator`` the split must also fit its chunks, and ``units`` caps the units used.
    Returns ``Arrangement(total, amounts, units)``; raises ``InfeasibleArrangement`` when even
    the minimum amounts cannot fit.
    """
    if units < 0:
        raise ValueError(f"units must be >= 0, got {units}")
    if operator is None:
        operator = BaseOperator(units)
    elif not isinstance(operator, BaseOperator) and operator.units(operator.start()) > units:
        return _capped(choices, units, operator)
    if not choices:
        return Arrangement(0.0, [], 0)
    return DPTable(choices, operator).row(len(choices))


def _capped(
    choices: Sequence[Mapping[int, float]], units: int, operator: Operator[Any]
) -> Arrangement:
    """Topology operator with an extra cap on the units used: filter final states."""
    table = DPTable(choices, operator)
    n = len(choices)
    start_units = operator.units(operator.start())
    layer = table._layers[n]
    ok = {s: c for s, c in layer.items() if start_units - operator.units(s) <= units}
    if not ok:
        raise InfeasibleArrangement(f"the {n} candidates do not fit in {units} units")
    table._layers[n] = ok
    return table.row(n)
