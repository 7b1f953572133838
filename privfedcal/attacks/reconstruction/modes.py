"""Model modes for attacking and scoring.

Every forward pass an attack or a score makes runs the model in eval mode: BatchNorm uses
the running statistics recorded in the transcript's model state (not the statistics of
the batch being optimised or scored, which would also overwrite the running buffers),
dropout is off. ``eval_mode`` restores each submodule's own mode afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` (every submodule) in eval mode for the block, then restore each
    submodule's previous ``training`` flag, also on error."""
    before = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in before:
            m.training = training
