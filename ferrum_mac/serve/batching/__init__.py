"""Continuous batching of one model's requests, and the registry of the models a server holds loaded.

`Scheduler` runs one model on its own thread: the planner decides each step (`planner`), the
runner executes it (`runner`) over the batch of running sequences (`batch`); `models` loads
and unloads models, each on its scheduler, under keep-alive.
"""
