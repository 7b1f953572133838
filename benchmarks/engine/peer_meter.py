"""What one way of ``peers.py`` did in each round, told from inside its process.

A way writes one line on stderr at the end of every round (``TICK`` and a JSON object);
the driver stamps each line as it arrives, so every way's round is timed by the same clock
as the wall time between the ends of consecutive rounds. privfedcal needs no such line: its
own per-round progress line (``round k/N: ...``, printed after the round's metrics, logs
and checkpoint are written) is the tick.

With counting on, the line also carries the work done so far, counted by global module hooks
on the network's first layer (the ``nn.Linear`` that takes the flattened image, or the
``nn.Conv2d`` that takes its channels), whatever code calls it:

* ``train_batches`` / ``train_samples``: forwards in training mode with gradients on;
* ``steps``: backward passes through that layer (one per SGD step);
* ``eval_batches`` / ``eval_samples``: forwards without gradients or in eval mode.

privfedcal's vectorised trainer (``--client-batch K``) runs one forward for K clients inside
``torch.func.vmap``, where module hooks see one client's slice of a batched tensor and no
backward hook can be attached; its training work is therefore counted from the step plan the
trainer executes (``Meter.count_plan``: each client's steps and the real, weight-1 rows of its
batches, padding rows left out), and its training forwards are not counted by the hook
(``plan_counted``). Its evaluation runs outside vmap and is counted by the hook as everywhere.

privfedcal's MLP steps by hand under the plain cross-entropy (``federation/chain_steps.py``:
no module is called and no backward runs through the layer), so each of those steps is
counted where it runs, one step and its batch's rows; its evaluation goes through the
modules and is counted by the hook.

The driver differences consecutive lines into one round's work.
"""

from __future__ import annotations

import json
import sys
from typing import Any

TICK = "peers-tick"
COUNTERS = ("steps", "train_batches", "train_samples", "eval_batches", "eval_samples")


class Meter:
    """The ticks and (with ``count``) the work counters of one process."""

    def __init__(self, count: bool = False, *, in_channels: int = 1, image_size: int = 8,
                 cnn: bool = False) -> None:
        self.count = count
        #: training work is counted from the vectorised trainer's plan (``count_plan``)
        self.plan_counted = False
        self.totals = dict.fromkeys(COUNTERS, 0)
        self._first = (("conv", in_channels) if cnn
                       else ("linear", in_channels * image_size * image_size))
        if count:
            from torch.nn.modules.module import register_module_forward_hook

            register_module_forward_hook(self._forward)

    def _is_first_layer(self, module: Any) -> bool:
        from torch import nn

        kind, size = self._first
        if kind == "conv":
            return isinstance(module, nn.Conv2d) and module.in_channels == size
        return isinstance(module, nn.Linear) and module.in_features == size

    def _forward(self, module: Any, inputs: tuple, output: Any) -> None:
        import torch

        if not self._is_first_layer(module):
            return
        n = int(inputs[0].shape[0])
        if module.training and torch.is_grad_enabled():
            if self.plan_counted:
                return
            self.totals["train_batches"] += 1
            self.totals["train_samples"] += n
            if output.requires_grad:
                output.register_hook(self._backward)
        else:
            self.totals["eval_batches"] += 1
            self.totals["eval_samples"] += n

    def _backward(self, grad: Any) -> None:
        self.totals["steps"] += 1

    def count_plan(self, steps: list[int], real_rows: int) -> None:
        """One group of the vectorised trainer: each client's number of SGD steps
        (``steps``) and the real rows of all their batches (``real_rows``)."""
        self.totals["steps"] += sum(steps)
        self.totals["train_batches"] += sum(steps)
        self.totals["train_samples"] += real_rows

    def add(self, counts: dict[str, Any]) -> None:
        """Work counted in another process (Flower's ClientApps) added to this one's."""
        for k in COUNTERS:
            self.totals[k] += int(counts.get(k, 0))

    def tick(self, round_: int) -> None:
        """The end of round ``round_``: one line on stderr, flushed at once."""
        record: dict[str, Any] = {"round": round_}
        if self.count:
            record.update(self.totals)
        print(f"{TICK} {json.dumps(record)}", file=sys.stderr, flush=True)


def round_work(ticks: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Each timed round's work: the difference of consecutive tick lines (the first round,
    before the first tick, has no line to start from and is left out)."""
    return [{"round": b["round"], **{k: b[k] - a[k] for k in COUNTERS}}
            for a, b in zip(ticks, ticks[1:], strict=False)]


def work_differences(work: dict[str, list[dict[str, int]]]) -> list[str]:
    """Every place where a way's per-round work differs from the first way's: empty when
    all ways did the same work round by round."""
    ways = list(work)
    if not ways:
        return []
    ref_name, ref = ways[0], work[ways[0]]
    found = []
    for name in ways[1:]:
        if len(work[name]) != len(ref):
            found.append(f"{name}: {len(work[name])} timed rounds, {ref_name}: {len(ref)}")
            continue
        for a, b in zip(ref, work[name], strict=True):
            for k in COUNTERS:
                if k == "eval_batches":
                    continue  # an evaluation's batch size is the tool's choice; its samples not
                if a[k] != b[k]:
                    found.append(f"round {a['round']}: {k} {name} {b[k]}, {ref_name} {a[k]}")
    return found
