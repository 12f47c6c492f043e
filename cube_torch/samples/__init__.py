"""The processed-sample cache: what ``dataset[i]`` returns, computed once, stored under
(name, i): ``CachedDataset`` (dataset.py) and ``SampleCache`` (cache.py) over a
:class:`~cube_torch.samples.store.SampleStore` (the node's daemon, daemon_store.py, by
default; one Redis server or a Redis Cluster, redis_store.py), samples encoded by codec.py,
never pickled."""
