"""cubefs_fuse: a FUSE daemon that serves a remote dataset volume through a RAM + NVMe block cache."""

__version__ = "0.1.0"
