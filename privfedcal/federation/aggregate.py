"""Weighted averaging of client states, in one place: FedAvg's average of the model
updates in the clear (``federation/simulator.py``) and every other weighted mean of states."""

from __future__ import annotations

import torch

from privfedcal.tensors import State, nonfinite_key


class RunningAverage:
    """The weighted average of client states, computed as the states arrive: one
    accumulator instead of every client's state, so peak memory does not grow with the
    number of clients per round. Floating-point entries: ``sum_k (w_k / sum w) * s_k``
    accumulated in float32 (float64 for float64 entries) in arrival order, then cast back;
    integer buffers (BatchNorm counters) take the maximum."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = list(weights)
        self.total = float(sum(weights))
        self.count = 0
        self.acc: State = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.bytes = 0
        self.bad: list[str | None] = []
        #: the first state's entries, its floating-point ones and the others: a state with
        #: the same entries is added with one call for all its floating-point tensors
        self.keys: list[str] = []
        self.floats: list[str] = []
        self.others: list[str] = []

    def add(self, state: State) -> None:
        w = self.weights[self.count]
        if list(state) == self.keys:  # the same entries as the first state: one call each
            if self.floats:
                torch._foreach_add_([self.acc[k] for k in self.floats],
                                    [state[k] for k in self.floats], alpha=w / self.total)
            for key in self.others:
                torch.maximum(self.acc[key], state[key], out=self.acc[key])
        else:
            self._add_each(state, w)
        self.bytes += sum(v.numel() * v.element_size() for v in state.values())
        same = list(state) == self.keys
        self.bad.append(_nonfinite_key(state, self.floats if same else None))  # per client
        self.count += 1

    def _add_each(self, state: State, w: float) -> None:
        """``add`` entry by entry: the first state (the accumulators are made from it), or
        one whose entries differ from it."""
        for key, v in state.items():
            if key not in self.acc:
                self.dtypes[key] = v.dtype
                if v.is_floating_point():
                    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
                    self.acc[key] = torch.zeros_like(v, dtype=dt)
                else:
                    self.acc[key] = v.clone()
                    continue
            if v.is_floating_point():
                self.acc[key].add_(v, alpha=w / self.total)
            else:
                torch.maximum(self.acc[key], v, out=self.acc[key])
        if not self.keys:
            self.keys = list(state)
            self.floats = [k for k in self.keys if state[k].is_floating_point()]
            self.others = [k for k in self.keys if k not in self.floats]

    def nonfinite_marker(self, i: int) -> State:
        """For the divergence check: empty if the i-th state was finite, else its first
        non-finite entry as a NaN scalar (the state itself is gone)."""
        key = self.bad[i]
        return {} if key is None else {key: torch.tensor(float("nan"))}

    def result(self) -> State:
        if self.count != len(self.weights):
            raise RuntimeError(f"averaged {self.count} of {len(self.weights)} states")
        return {k: (v.to(self.dtypes[k]) if v.is_floating_point() else v)
                for k, v in self.acc.items()}


def _nonfinite_key(state: State, floats: list[str] | None) -> str | None:
    """``nonfinite_key(state)``; ``floats``, when given, names every floating-point entry of
    ``state``. Then one reduction over their sums decides the common case (a NaN or an Inf
    anywhere makes the total non-finite); entry by entry otherwise, and when finite values
    overflow the total."""
    if floats:
        total = torch.stack([state[k].sum().to(torch.float32) for k in floats]).sum()
        if bool(torch.isfinite(total)):
            return None
    return nonfinite_key(state)


def weighted_average(states: list[State], weights: list[float]) -> State:
    """``RunningAverage`` of ``states`` in list order."""
    running = RunningAverage(weights)
    for state in states:
        running.add(state)
    return running.result()


__all__ = ["RunningAverage", "weighted_average"]
