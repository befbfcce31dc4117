"""Entry point of a rank process: ``python -m jupyter_shard.rank`` (started by a launcher)."""

from jupyter_shard.rank.runtime import main

if __name__ == "__main__":
    main()
