"""Command line: ctrlcomm store, ctrlcomm run and ctrlcomm bench."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from ._launch import add_run_parser
from .bench._cli import _port_from, add_bench_parser


def _store(args: argparse.Namespace) -> int:
    from .rendezvous._server import StoreServer
    from .transport._net import auth_key_or_env

    key = auth_key_or_env()  # (without one, beyond the loopback, the server says what that means)
    if args.encrypt and not key:
        print("--encrypt needs CTRLCOMM_AUTH_KEY in the environment (the store's keys are "
              "derived from it)", file=sys.stderr)
        return 2
    from ._errors import CtrlcommError

    try:
        srv = StoreServer(args.host, args.port, auth_key=key, encrypt=args.encrypt)
    except CtrlcommError as e:  # the port is in use (named), the host is not ours...
        print(f"ctrlcomm store: {e}", file=sys.stderr)
        return 1
    print(f"ctrlcomm store serving on {args.host}:{srv.port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        pass
    srv.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from . import __version__

    p = argparse.ArgumentParser(prog="ctrlcomm", description=__doc__)
    p.add_argument("--version", action="version", version=f"ctrlcomm {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("store", help="run a rendezvous store alone")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port_from(0), default=29600,
                   help="0: one the OS picks (printed)")
    s.add_argument("--encrypt", action="store_true",
                   help="CurveZMQ encryption (for groups made with encrypt=True)")
    s.set_defaults(func=_store)

    add_run_parser(sub)
    add_bench_parser(sub)

    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = argv[1:]  # (after "bench": for the JSON's record of the command)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
