"""The tests' name for the package's in-process Grid (``privfedcal.flower.grid``): the
Flower tests and ``benchmarks/flower/flower_overhead.py`` import ``LoopbackGrid`` from here."""

from privfedcal.flower.grid import NODE_BASE, over_the_wire
from privfedcal.flower.grid import InProcessGrid as LoopbackGrid

__all__ = ["NODE_BASE", "LoopbackGrid", "over_the_wire"]
