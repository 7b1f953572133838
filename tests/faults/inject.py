"""Fault injection at the package's seams, from outside it: a seam's Nth call (or its first
call that ``match`` accepts) raises ``KeyboardInterrupt`` before or after the real call (a
process stopped at that step), an upload or a reported loss is made NaN, malformed or
oversized, a client refuses a release as a spent ledger does, and a Flower node's reply to
its Nth message is an error or never comes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def patched(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(real)`` for the block."""
    real = getattr(owner, name)
    setattr(owner, name, make(real))
    try:
        yield
    finally:
        setattr(owner, name, real)


def seam(name: str) -> tuple[Any, str]:
    """The object and attribute of a seam: the transcript's record, the simulator's
    checkpoint writer, the uplink's client and server halves."""
    import privfedcal.federation.simulator as simulator
    from privfedcal.privacy.transcript import Transcript
    from privfedcal.privacy.uplink import Uplink

    return {"record": (Transcript, "record"), "checkpoint": (simulator, "save_checkpoint"),
            "client_side": (Uplink, "client_side"), "server_side": (Uplink, "server_side"),
            "admit": (Uplink, "admit")}[name]


class Stop:
    """Counts a seam's calls; the ``nth`` (counting only calls ``match`` accepts) stops the
    process before or after the real call. ``fired`` says whether it did."""

    def __init__(self, nth: int = 1, when: str = "after",
                 match: Callable[..., bool] | None = None) -> None:
        self.nth, self.when, self.match = nth, when, match
        self.calls, self.fired = 0, False

    def __call__(self, real: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            hit = False
            if not self.fired and (self.match is None or self.match(*args, **kwargs)):
                self.calls += 1
                hit = self.calls == self.nth
            if hit and self.when == "before":
                self.fired = True
                raise KeyboardInterrupt
            out = real(*args, **kwargs)
            if hit:
                self.fired = True
                raise KeyboardInterrupt
            return out

        return wrapped


def nan_like(value: Any) -> Any:
    """A NaN payload of the same shape, or a malformed (truncated) ciphertext."""
    if isinstance(value, bytes | bytearray):
        return bytes(value[: len(value) // 2])
    if isinstance(value, dict):
        return {k: torch.full_like(v, float("nan")) if torch.is_tensor(v)
                and v.is_floating_point() else v for k, v in value.items()}
    return value


class NanUpload:
    """The ``nth`` upload through the uplink's client half leaves NaN (or malformed)."""

    def __init__(self, nth: int) -> None:
        self.nth, self.calls, self.fired = nth, 0, False

    def __call__(self, real: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            self.calls += 1
            if self.calls == self.nth:
                self.fired = True
                return nan_like(out)
            return out

        return wrapped


class Refuse:
    """The ``nth`` client asked for a release refuses it, as a client whose ledger is spent
    does (``BudgetRefused``)."""

    def __init__(self, nth: int) -> None:
        self.nth, self.calls, self.fired = nth, 0, False

    def __call__(self, real: Callable) -> Callable:
        from privfedcal.errors import BudgetRefused

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == self.nth:
                self.fired = True
                raise BudgetRefused("the client's ledger is spent")
            return real(*args, **kwargs)

        return wrapped


class NanLoss:
    """The ``nth`` round's first client reports a NaN training loss."""

    def __init__(self, nth: int) -> None:
        self.nth, self.calls, self.fired = nth, 0, False

    def __call__(self, real: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            results, averaged, sent, checked = real(*args, **kwargs)
            self.calls += 1
            if self.calls == self.nth and checked:
                self.fired = True
                checked = [checked[0]._replace(loss=float("nan")), *checked[1:]]
            return results, averaged, sent, checked

        return wrapped


def lossy_grid(client_app, run_config, clients: int, node_config: dict, *, victim: int,
               nth: int = 1, reply: str = "error",
               match: Callable[[Any], bool] | None = None):
    """An in-process Flower grid (the package's ``InProcessGrid``) whose node of client
    ``victim`` fails on its ``nth`` message (among those ``match`` accepts): an error reply
    (``reply="error"``, the ClientApp raised) or no reply at all (``"drop"``). The grid's
    ``hit`` holds (message type, group) of the failed message."""
    from privfedcal.flower.grid import NODE_BASE, InProcessGrid

    class LossyGrid(InProcessGrid):
        def __init__(self) -> None:
            super().__init__(client_app, run_config, clients, node_config=node_config)
            self.hit: tuple[str, str] | None = None
            self.seen, self.silenced = 0, set()
            real = self.client_app

            def app(msg, context):
                meta = msg.metadata
                if (self.hit is None and meta.dst_node_id == NODE_BASE + victim
                        and (match is None or match(msg))):
                    self.seen += 1
                    if self.seen == nth:
                        self.hit = (meta.message_type, meta.group_id)
                        if reply == "drop":
                            self.silenced.add(meta.message_id)
                        else:
                            raise RuntimeError("the node was lost")
                return real(msg, context)

            self.client_app = app

        def push_messages(self, messages):
            ids = list(super().push_messages(messages))
            for i in ids:
                if i in self.silenced:
                    self._replies.pop(i, None)  # the reply never comes
            return ids

    return LossyGrid()


class Oversized:
    """The ``nth`` upload of release ``label`` through the uplink's client half is scaled so
    that its largest entry is ``peak`` (a buggy or faulty client: past the declared bound,
    still within what CKKS can encode)."""

    def __init__(self, label: str, nth: int = 1, peak: float = 1e6) -> None:
        self.label, self.nth, self.peak = label, nth, peak
        self.calls, self.fired = 0, False

    def __call__(self, real: Callable) -> Callable:
        def wrapped(uplink, payload, rel, *args, **kwargs):
            if rel.label == self.label and isinstance(payload, dict):
                self.calls += 1
                if self.calls == self.nth:
                    self.fired = True
                    top = max(float(v.abs().max()) for v in payload.values()
                              if torch.is_tensor(v) and v.numel())
                    payload = {k: v * (self.peak / top) if torch.is_tensor(v) else v
                               for k, v in payload.items()}
            return real(uplink, payload, rel, *args, **kwargs)

        return wrapped
