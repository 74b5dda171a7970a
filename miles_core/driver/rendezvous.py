"""Rank 0's rendezvous address: MASTER_ADDR / MASTER_PORT, found on rank 0's node before the ranks start.

The driver runs `rendezvous_address` as a Ray task placed like rank 0 (miles_core/driver/placement.py).
It lives in a light module of its own (not beside the trainer, whose package imports torch) so that the
task's worker process imports only this: about 2 CPU-seconds less for every run that starts a trainer.
"""

from __future__ import annotations


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port on it."""
    import ray

    from miles_core.engines.launcher import free_port

    return ray.util.get_node_ip_address(), free_port("")
