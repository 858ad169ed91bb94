"""Training data: named datasets in memory, per-worker shards, and batch augmentation.

    from mpiasgd.data import load_dataset, ShardSampler
    ds = load_dataset("cifar10")                    # or "digits"; data_dir defaults to default_data_dir()
    sampler = ShardSampler(len(ds.train_y), num_shards=n_workers, shard=rank - 1, seed=seed)
    for start in range(0, len(sampler), batch_size):
        idx = sampler.indices(epoch)[start:start + batch_size]
        x, y = ds.batch("train", idx, rng)          # float32 (B, C, H, W) normalised, int64 (B,)

Files: dataset.py (Dataset), errors.py (DataError), digits.py, cifar10.py and synthetic.py (one loader
each), loader.py (load_dataset: a built-in by name; open_data: a name or a dataset file, h5data.py),
sampler.py (ShardSampler; the test slices, test_slice and lost_test_share), augment.py (random crop + flip),
stream.py (MinibatchStream: a worker's minibatches and their augmentation, reproducible from its cursor).
"""

from mpiasgd.data.dataset import DATASETS, Dataset, default_data_dir
from mpiasgd.data.errors import DataError
from mpiasgd.data.loader import load_dataset
from mpiasgd.data.sampler import ShardSampler, lost_test_share, test_slice
from mpiasgd.data.stream import MinibatchStream, batch_rng, minibatches

__all__ = ["DATASETS", "DataError", "Dataset", "MinibatchStream", "ShardSampler", "batch_rng", "default_data_dir",
           "load_dataset", "lost_test_share", "minibatches", "test_slice"]
