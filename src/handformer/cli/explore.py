"""``handformer explore --run DIR [--port P] [--host H] [--allow-remote] [--open]``.

Registered into the main parser by ``register(subparsers)``; the handler returns an exit
code: 0 after Ctrl-C or SIGTERM (the ways to stop the server), 1 for a run folder that does
not load or a port it cannot listen on, 2 for a non-loopback ``--host`` without
``--allow-remote``.
"""

from __future__ import annotations

import argparse
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any

from handformer.cli.common import device_name, port_number

__all__ = ["DEFAULT_PORT", "register", "run_explore"]

DEFAULT_PORT = 8765


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``explore`` to ``subparsers`` (from ``parser.add_subparsers()``); the parsed
    namespace carries ``handler=run_explore``."""
    parser = subparsers.add_parser(
        "explore", help="look inside a run in the browser: attention, masks, KV cache",
        description="Serve a local page that shows a run's attention weights and masks, "
        "steps generation token by token with the KV cache, and plots the loss curve.")
    parser.add_argument("--run", type=Path, required=True, help="run folder to explore")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                        help=f"port to listen on (default {DEFAULT_PORT}; 0 = any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, this machine only)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback --host: anyone who can reach it can use "
                        "the model")
    parser.add_argument("--open", action="store_true", help="open the page in a web browser")
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="device to run the model on (cpu)")
    parser.set_defaults(handler=run_explore)
    return parser


def run_explore(args: argparse.Namespace, *,
                on_ready: Callable[[Any], None] | None = None) -> int:
    """Load the run, listen, print the URL and serve until interrupted (or until
    ``server.shutdown()``; ``on_ready(server)`` is called just before serving)."""
    from handformer.cli.common import UsageError
    from handformer.cli.errors import EXPECTED, report
    from handformer.explore.explorer import Explorer
    from handformer.explore.run import load_explore_run
    from handformer.explore.server import ExploreServer, RemoteBindError, check_host

    try:
        try:
            check_host(args.host, args.allow_remote)  # before the model is loaded
        except RemoteBindError as err:
            raise UsageError(str(err)) from None
        run = load_explore_run(args.run, device=args.device)
        explorer = Explorer(run)
    except EXPECTED as err:
        return report("explore", err)
    try:
        server = ExploreServer(explorer, args.host, args.port, allow_remote=args.allow_remote)
    except OSError as err:
        return report("explore", OSError(
            f"cannot listen on {args.host}:{args.port} ({err}); pick another --port "
            "(0 = any free port)"))

    def ready() -> None:
        print(f"handformer explore: {run.kind} run {run.run_dir} at {server.url}  "
              "(Ctrl-C to stop)", flush=True)
        if args.open:
            webbrowser.open(server.url)
        if on_ready is not None:
            on_ready(server)

    if server.serve_until_stopped(ready) is not None:
        print("handformer explore: stopped", flush=True)
    return 0
