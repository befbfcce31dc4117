"""Code that runs only inside rank processes: the event loop, the shell, output capture, ``shard``."""
