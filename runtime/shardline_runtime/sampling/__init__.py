"""Sampling parameters and their per-batch tensor form (``SamplingBatchInfo``)."""

from shardline_runtime.sampling.sampling_batch_info import SamplingBatchInfo
from shardline_runtime.sampling.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["SamplingBatchInfo", "SamplingParams", "SamplingParamsError"]
