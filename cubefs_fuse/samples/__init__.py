"""The processed-sample cache's daemon store: ``store.py`` keeps the index, the budgets and
the plan-aware eviction on the trio thread, ``files.py`` the NVMe format (worker threads
only); the data socket ops are control/sampleplane.py and the training side
cube_torch/samples/."""
