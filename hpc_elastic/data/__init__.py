"""Data-side helpers for training scripts: the elastic sampler."""

from hpc_elastic.data.sampler import ElasticSampler, Window, epoch_permutation

__all__ = ["ElasticSampler", "Window", "epoch_permutation"]
