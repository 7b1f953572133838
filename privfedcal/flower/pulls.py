"""How soon Flower retries pulling a message's objects that are not there yet.

Flower 1.41 sends a message as its object tree first and its objects after, and a receiver
that finds an object missing waits 1 s before its first retry (then 2, 4, ... up to 10 s;
``flwr.supercore.inflatable.inflatable_utils``). On a deployment whose parties answer within
milliseconds that first wait is most of a round's slack: a warm ClientApp asks for its
message while its SuperNode is still fetching it from the SuperLink, and the ServerApp,
which polls for replies every ``flower.poll-interval``, often finds a reply whose model is
still being uploaded. ``quick_object_pulls`` makes the first wait 0.05 s in this process
(and in processes forked from it); later retries double from there as Flower's do, and the
time limit and the number of tries are Flower's. Nothing else about a pull changes.
"""

from __future__ import annotations

#: seconds before the first retry of a missing object (Flower's default: 1 s)
PULL_INITIAL_BACKOFF = 0.05
#: the functions of ``inflatable_utils`` whose ``initial_backoff`` default is changed: the
#: ServerApp's Grid calls ``pull_objects``, a ClientApp ``pull_and_inflate_object_from_tree``
PULLERS = ("pull_objects", "pull_and_inflate_object_from_tree")


def quick_object_pulls(seconds: float = PULL_INITIAL_BACKOFF) -> list[str]:
    """Set the default first retry wait of Flower's object pulls in this process to
    ``seconds``; returns the functions changed (none where this Flower has no such
    argument: then nothing changes)."""
    from flwr.supercore.inflatable import inflatable_utils

    changed = []
    for name in PULLERS:
        defaults = getattr(getattr(inflatable_utils, name, None), "__kwdefaults__", None)
        if defaults and "initial_backoff" in defaults:
            defaults["initial_backoff"] = seconds
            changed.append(name)
    return changed


__all__ = ["PULLERS", "PULL_INITIAL_BACKOFF", "quick_object_pulls"]
