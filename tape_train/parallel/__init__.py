"""Parallelism from outside the model: the dp × sp × tp rank grid, Ulysses sequence
parallelism, AutoTP tensor-parallel specs and TAPE's state under head sharding.

See docs/parallelism.md for the integration steps and the communication model.
"""

from tape_train.parallel.grid import ParallelGroups, RankGrid
from tape_train.parallel.parallelize import (deepspeed_config_updates, loss_scale, parallelize,
                                             verify_engine)
from tape_train.parallel.sequence import (ParallelAttentionCore, SequenceParallelEvalModel,
                                          sequence_chunk, sequence_parallel_loss, shard_batch)
from tape_train.parallel.tensor import autotp_partition_config, partition_dim

__all__ = ["ParallelAttentionCore", "ParallelGroups", "SequenceParallelEvalModel", "RankGrid",
           "autotp_partition_config", "deepspeed_config_updates", "loss_scale", "parallelize", "partition_dim", "sequence_chunk", "sequence_parallel_loss",
           "shard_batch", "verify_engine"]
