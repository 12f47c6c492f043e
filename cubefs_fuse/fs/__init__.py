"""The FUSE side of a read: the pyfuse3 adapter over the filesystem core and its metadata."""
