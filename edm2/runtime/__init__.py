"""What every procedure runs on: atomic files and downloads, locks, the process group, bounded JSON,
pinned files, speed settings, and EMA tracks sharded over the processes."""
