"""The FUSE side of a read: the C session and its Python side over the filesystem core and its metadata."""
