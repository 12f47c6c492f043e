"""Where bytes come from: the backend contract and its implementations (a local/NFS directory)."""
