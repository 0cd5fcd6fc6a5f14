"""How long one collective takes: the alpha-beta model per kind and world size.

[Note: collective costs]
``P`` is the payload of the call as the ledger counts it ([Note: communication ledger]). A
measured ``(alpha, beta)`` for the kind and world size wins ([Note: calibration]); otherwise a
ring of ``N`` ranks over links of latency ``a`` and bandwidth ``B``:

    kind                      steps          bytes each rank sends
    all_reduce                2 (N - 1)      2 (N - 1) / N * P
    all_gather, reduce_scatter N - 1         (N - 1) / N * P
    broadcast, reduce         N - 1          (N - 1) / N * P   (pipelined chunks)

and ``time = steps * a + bytes / B`` (Patarasuk and Yuan 2009; Thakur et al. 2005). One rank
communicates nothing: 0 s. A ring of more ranks than a node holds, and HSDP's all-reduce across
replica groups, run at the inter-node bandwidth when the calibration gives one.
"""

from tiny_fsdp.plan.calibration import Calibration

_STEPS = {"all_reduce": 2.0}  # every other kind: 1.0


def collective_s(
    calibration: Calibration,
    kind: str,
    payload_bytes: float,
    world_size: int,
    inter_node: bool = False,
) -> float:
    """Seconds of one ``kind`` collective of ``payload_bytes`` on ``world_size`` ranks."""
    if world_size <= 1 and not calibration.collectives.get(kind, {}).get(1):
        return 0.0
    fit = calibration.collectives.get(kind, {}).get(world_size)
    if fit is not None and not inter_node:
        return fit["alpha_s"] + fit["beta_s_per_byte"] * payload_bytes
    n = world_size
    factor = _STEPS.get(kind, 1.0)
    bandwidth = calibration.bandwidth_bytes_per_s
    per_node = calibration.ranks_per_node
    inter_node = inter_node or (per_node is not None and world_size > per_node)
    if inter_node and calibration.inter_node_bandwidth_bytes_per_s:
        bandwidth = calibration.inter_node_bandwidth_bytes_per_s
    steps = factor * (n - 1)
    return steps * calibration.latency_s + factor * (n - 1) / n * payload_bytes / bandwidth
