"""`skyrl-stepwise view <run dir> [--serve]`: the run's trajectory viewer page, <run dir>/view/index.html.

One static page, openable from disk, that shows every step on a timeline and, per step, the recorded trajectories
token by token, each token coloured by what the loss did with it (skyrl_stepwise/view/page.py). A run writes it at
its end; this rebuilds it, e.g. for a run still going or one that was killed. `--serve` serves it on 127.0.0.1
and rebuilds it as steps land: an open page reloads itself when its run has written more.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the view dir; `/stamp` answers the run's input stamp, rebuilding the page first when it changed."""

    def __init__(self, *args, run_dir: Path, lock: threading.Lock, **kwargs) -> None:
        self.run_dir, self.lock = run_dir, lock
        super().__init__(*args, directory=str(run_dir / "view"), **kwargs)

    def do_GET(self) -> None:
        if self.path.split("?")[0] in ("/", "/index.html", "/stamp"):
            with self.lock:
                stamp = _rebuild_if_changed(self.run_dir)
            if self.path.startswith("/stamp"):
                body = stamp.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
        super().do_GET()

    def log_message(self, format: str, *args) -> None:  # one line per request on stderr is noise here
        pass


_built: dict[Path, str] = {}


def _rebuild_if_changed(run_dir: Path) -> str:
    """The run's input stamp; the page is rewritten when the stamp differs from the last build's."""
    from skyrl_stepwise.view.page import input_stamp, write_page

    stamp = input_stamp(run_dir)
    if _built.get(run_dir) != stamp:
        write_page(run_dir, live=True)
        _built[run_dir] = stamp
    return stamp


def serve(run_dir: Path, port: int) -> http.server.ThreadingHTTPServer:
    """A server for the page on 127.0.0.1 (port 0: any free one); call serve_forever() on it."""
    handler = functools.partial(_Handler, run_dir=run_dir, lock=threading.Lock())
    _rebuild_if_changed(run_dir)
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


def main(argv: list[str] | None = None) -> int:
    """Write the page (and with --serve, serve it until Ctrl-C)."""
    from skyrl_stepwise.view.page import write_page

    parser = argparse.ArgumentParser(prog="skyrl-stepwise view", description=__doc__.split("\n\n")[1])
    parser.add_argument("run_dir", type=Path, help="a run directory (logging.output_dir)")
    parser.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1, rebuilt as steps land")
    parser.add_argument("--port", type=int, default=8765, help="--serve's port (0: any free one)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.run_dir.is_dir():
        print(f"{args.run_dir}: not a directory", file=sys.stderr)
        return 1
    if not args.serve:
        path = write_page(args.run_dir)
        print(f"{path} ({path.stat().st_size / 1e6:.2f} MB): open it in a browser")
        return 0
    server = serve(args.run_dir, args.port)
    print(f"serving {args.run_dir / 'view' / 'index.html'} on http://127.0.0.1:{server.server_address[1]}/ "
          "(Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
