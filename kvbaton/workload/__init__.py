"""Workloads, torch-free: datasets, arrival processes, per-request records, metrics and reports. Shared by the
load generator (`bench`), the simulator (`sim`) and the planner (`plan`), and by nothing in the serving stack."""
