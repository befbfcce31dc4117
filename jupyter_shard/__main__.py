"""``python -m jupyter_shard pools`` lists the kept pools of this user on this machine;
``python -m jupyter_shard stop ID [--force]`` ends one (``--force``: also while a kernel holds it)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jupyter_shard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pools", help="list kept pools (%%distributed --keep)")
    stop = commands.add_parser("stop", help="end a kept pool's ranks")
    stop.add_argument("id", help="its id, as `pools` shows it (a unique prefix will do)")
    stop.add_argument("--force", action="store_true", help="also while a kernel is attached to it")
    args = parser.parse_args(argv)

    from jupyter_shard.errors import PoolError
    from jupyter_shard.pool.keep import kept_pools, pools_table
    from jupyter_shard.pool.keep import stop as stop_pool

    try:
        print(pools_table(kept_pools()) if args.command == "pools" else stop_pool(args.id, args.force))
    except PoolError as exc:
        print(f"jupyter_shard: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
