"""The simulator and capacity planner: ``kvtier simulate | plan | calibrate``.

Replays a workload through a model of the serving system (vLLM's scheduler and prefix
cache, kvtier's tiers) without running a model. Module map: docs/structure.md; the model
and its limits: docs/simulator.md.
"""
