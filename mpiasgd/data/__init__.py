"""Training data: named datasets in memory, per-worker shards, and batch augmentation.

    from mpiasgd.data import load_dataset, ShardSampler
    ds = load_dataset("cifar10")                    # or "digits"; data_dir defaults to default_data_dir()
    sampler = ShardSampler(len(ds.train_y), num_shards=n_workers, shard=rank - 1, seed=seed)
    for start in range(0, len(sampler), batch_size):
        idx = sampler.indices(epoch)[start:start + batch_size]
        x, y = ds.batch("train", idx, rng)          # float32 (B, C, H, W) normalised, int64 (B,)

Files: dataset.py (Dataset, DataError, load_dataset), digits.py and cifar10.py (one loader each),
sampler.py (ShardSampler), augment.py (random crop + flip), stream.py (MinibatchStream: a worker's
minibatches and their augmentation, reproducible from its cursor).
"""

from mpiasgd.data.dataset import DATASETS, DataError, Dataset, default_data_dir, load_dataset
from mpiasgd.data.sampler import ShardSampler
from mpiasgd.data.stream import MinibatchStream, batch_rng, minibatches

__all__ = ["DATASETS", "DataError", "Dataset", "MinibatchStream", "ShardSampler", "batch_rng", "default_data_dir",
           "load_dataset", "minibatches"]
