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

    def add(self, state: State) -> None:
        w = self.weights[self.count]
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
        self.bytes += sum(v.numel() * v.element_size() for v in state.values())
        self.bad.append(nonfinite_key(state))  # one check per client, not per step
        self.count += 1

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


def weighted_average(states: list[State], weights: list[float]) -> State:
    """``RunningAverage`` of ``states`` in list order."""
    running = RunningAverage(weights)
    for state in states:
        running.add(state)
    return running.result()


__all__ = ["RunningAverage", "weighted_average"]
