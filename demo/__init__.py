"""The end-to-end demo (``scripts/demo.sh``); it builds on the harness in tools/ (shared with benchmarks/ and tests).

``tools.harness`` generates image datasets, serves them as a slow remote (tools/slowfs.py),
mounts them with the real ``cubefs-fuse`` CLI, reads them with worker processes and
scrapes the daemon's Prometheus ``/metrics``; ``demo.train`` is the training job (a tiny
CNN, ImageFolder, cube_torch); ``demo.run`` is the demo itself.
"""
