"""Process groups and collectives; the only package that imports ``torch.distributed``."""

from shardline_runtime.distributed.communication_op import (
    all_gather_pyobj,
    all_reduce_min_int,
    barrier,
    broadcast_pyobj,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from shardline_runtime.distributed.expert_parallel import (
    ExpertParallelLayout,
    broadcast_tensor,
    expert_parallel_combine,
    get_expert_parallel_layout,
    init_expert_parallel,
)
from shardline_runtime.distributed.parallel_state import (
    DistributedInitError,
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    tp_ranks_of_node,
)

__all__ = [
    "DistributedInitError",
    "ExpertParallelLayout",
    "all_gather_pyobj",
    "broadcast_tensor",
    "expert_parallel_combine",
    "get_expert_parallel_layout",
    "init_expert_parallel",
    "all_reduce_min_int",
    "barrier",
    "broadcast_pyobj",
    "destroy_distributed_environment",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tp_ranks_of_node",
]
