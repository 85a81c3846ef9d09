"""The control API: JSON over HTTP on the daemon's Unix socket (runtime dir, mode 0600).

- :mod:`.server`: routes and the socket server (runs in the daemon);
- :mod:`.snapshots`: live snapshots for the UIs (runs in the daemon);
- :mod:`.client`: the client the CLI, the TUI and the tray use (runs in those processes);
- :mod:`.commands`: the ``ostinato status|ps|load|unload|residency|logs|pause|resume`` commands.

Importing this package imports nothing of the server: the UIs import only :mod:`.client`.
"""
