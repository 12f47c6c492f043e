"""The processed-sample cache's daemon store: entries in RAM and on NVMe, per owner and name.

``store.py`` keeps the index, the budgets and the plan-aware eviction on the trio thread;
``files.py`` is the NVMe format (worker threads only).  The wire (data socket ops) is in
control/sampleplane.py; the training side is cube_torch/samples/.
"""
