"""DeepSpeed ZeRO's communication buckets and ZeRO-3's live-parameter limits, sized to the model.

DeepSpeed's defaults are sized for no model in particular (DeepSpeed 0.19,
``deepspeed/runtime/zero/config.py``): ``reduce_bucket_size`` and ``allgather_bucket_size`` 5e8
elements (a 1-2 GB buffer per engine, and rayppo runs two per rank, policy and critic; doubled
by ``overlap_comm``, on by default at stage 3), and ``stage3_max_live_parameters`` 1e9, which
lets far more than one gathered module live at once. rayppo sizes them as the transformers
DeepSpeed integration's ``auto`` values do (``transformers/integrations/deepspeed.py``, 5.19):
buckets of h^2 elements, a ZeRO-3 prefetch bucket of 0.9 h^2 and a persistence threshold of 10 h;
and it bounds the live and reuse limits by the largest module the forward gathers (one decoder
layer or the embedding), so a rank holds about one gathered module at a time. ``rayppo plan``
counts the same buffers (``bucket_bytes``). Pure arithmetic: no torch, no DeepSpeed.
"""

from __future__ import annotations


def zero_sizes(hidden: int, largest_module: int, stage: int) -> dict[str, int | bool]:
    """The ``zero_optimization`` entries for a model of width ``hidden`` whose largest gathered
    module has ``largest_module`` parameters, at ZeRO ``stage``."""
    bucket = hidden * hidden
    sizes: dict[str, int | bool] = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        sizes |= {"stage3_prefetch_bucket_size": int(0.9 * bucket), "stage3_param_persistence_threshold": 10 * hidden,
                  "stage3_max_live_parameters": largest_module, "stage3_max_reuse_distance": largest_module}
    return sizes


def overlap_comm(stage: int) -> bool:
    """DeepSpeed's default: ``overlap_comm`` on at stage 3 only (``overlap_comm_valid``), which
    doubles the reduce bucket (one filling while the other is reduced)."""
    return stage == 3


def bucket_bytes(hidden: int, largest_module: int, stage: int, dtype_bytes: int) -> float:
    """Bytes one DeepSpeed engine keeps for its buckets: the reduce bucket (twice with
    ``overlap_comm``) and, at stage 3, the prefetch bucket and up to ``max_live_parameters``
    gathered parameters; at stage 1-2 the all-gather bucket."""
    sizes = zero_sizes(hidden, largest_module, stage)
    elements = sizes["reduce_bucket_size"] * (2 if overlap_comm(stage) else 1)
    if stage == 3:
        elements += sizes["stage3_prefetch_bucket_size"] + sizes["stage3_max_live_parameters"]
    elif stage >= 1:
        elements += sizes["allgather_bucket_size"]
    return float(elements * dtype_bytes)
