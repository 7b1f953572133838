"""The head adapter of the plugin: ``privfedcal.models.head`` (Flower-free, so that
``privfedcal.ownloop`` uses the same adapter in a base install)."""

from privfedcal.models.head import HEAD_PREFIX, HeadAdapter, find_head

__all__ = ["HEAD_PREFIX", "HeadAdapter", "find_head"]
