"""The control API: HTTP server over a Unix socket, routes, wire protocol and client, volume file."""
