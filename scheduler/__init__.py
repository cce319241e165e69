"""Central scheduler: block pool, prefix sharing, copy-on-write, swap, step plans.

Pure Python on purpose (no torch, no Ray) so every block decision is testable
in milliseconds.
"""
