"""The `pdserve` command."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.bench import cli as bench
from pdserve.config import ConfigError
from pdserve.entrypoints import proxy_cli, serve, up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    proxy_cli.add_parser(sub)
    up.add_parser(sub)
    bench.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
