"""A fault-injecting simulation as the project's own test harness: seeded runs with faults
(stopped processes, lost nodes, malformed uploads, budget refusals, resume and extension),
each checked afterwards from the server's folder alone by a solver that shares no code with
the package's planner or checker (README.md in this folder)."""
